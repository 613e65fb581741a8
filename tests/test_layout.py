"""The project's layout, checked statically: which package may import which, what the router and
the tuner load at import time, and what the wheel ships.

Dependency direction (docs/dependencies.md):
- ``gorgo.core`` is the pure core: it imports nothing of the project outside itself, except
  ``gorgo.errors`` (stdlib only; the core's errors derive from its ``UserError``).
- The router (``extproc``) and the tuner (``tuner``) never import the simulator (``gorgo.sim``) or
  the dev harness (``gorgo.harness``).
- The tuner never imports the router (``extproc``): they share names through
  ``gorgo.core.contract`` and talk over HTTP.

Every import counts: top-level, inside functions, under ``if TYPE_CHECKING``, and literal
``importlib.import_module("...")`` calls.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

REPO = Path(__file__).resolve().parents[1]
SHIPPED = ("gorgo", "extproc", "tuner")  # the wheel's top-level packages
PROJECT = {*SHIPPED, "bench", "tests", "protos"}  # top-level names that are the project's own
GENERATED = "gorgo._xds"  # protobuf stubs: they import only protobuf and each other
HEAVY = ("scipy", "matplotlib")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@cache
def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the shipped packages (generated stubs excluded)."""
    out = {}
    for top in SHIPPED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            name = ".".join(parts)
            if not _within(name, GENERATED):
                out[name] = path
    return out


def _resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(name: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file, wherever it sits."""
    known = _modules()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"  # `from gorgo import errors` imports gorgo.errors
                yield node.lineno, sub if sub in known else base
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.lineno, node.args[0].value


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT


def _core_outside(module: str) -> bool:
    return (_is_project(module) and not _within(module, "gorgo.core")
            and module != "gorgo.errors")


def _sim_or_harness(module: str) -> bool:
    return _within(module, "gorgo.sim") or _within(module, "gorgo.harness")


# (importing package, forbidden import, what the rule says)
RULES: dict[str, tuple[str, Callable[[str], bool], str]] = {
    "core-is-pure": ("gorgo.core", _core_outside,
                     "gorgo.core imports nothing of the project outside gorgo.core "
                     "(gorgo.errors excepted)"),
    "router-no-sim": ("extproc", _sim_or_harness,
                      "the router (extproc) never imports gorgo.sim or gorgo.harness"),
    "tuner-no-sim": ("tuner", _sim_or_harness,
                     "the tuner never imports gorgo.sim or gorgo.harness"),
    "tuner-no-router": ("tuner", lambda m: _within(m, "extproc"),
                        "the tuner never imports the router (extproc)"),
}


def test_the_module_scan_sees_every_package() -> None:
    found = {name.split(".")[0] for name in _modules()}
    assert found == set(SHIPPED)
    for pkg in ("gorgo.core", "gorgo.core.policies", "gorgo.sim", "gorgo.harness", "extproc",
                "tuner"):
        assert pkg in _modules(), pkg
    # function-level and relative imports are seen too
    tree = ast.parse("from . import a\nfrom ..b import c\ndef f():\n    import gorgo.sim\n")
    rel = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _resolve("gorgo.core.x", Path("x.py"), rel[0]) == "gorgo.core"
    assert _resolve("gorgo.core.x", Path("x.py"), rel[1]) == "gorgo.b"
    assert _resolve("gorgo.core", Path("__init__.py"), rel[1]) == "gorgo.b"


@pytest.mark.parametrize("rule", sorted(RULES))
def test_dependency_direction(rule: str) -> None:
    package, forbidden, says = RULES[rule]
    bad = []
    for name, path in _modules().items():
        if not _within(name, package):
            continue
        for line, target in _imports(name, path):
            if forbidden(target):
                bad.append(f"{path.relative_to(REPO)}:{line}: {name} imports {target}")
    assert not bad, f"{says}; found:\n" + "\n".join(bad)


# --- heavy dependencies stay off the router's and the tuner's import path ----------------------


@pytest.mark.parametrize("module", ["extproc.main", "extproc.service", "tuner.main"])
def test_import_loads_no_scipy_or_matplotlib(module: str) -> None:
    """irb imports scipy inside its solver and only the demo and the benches plot, so neither
    is loaded by starting the router or the tuner (a clean interpreter per module)."""
    code = (f"import {module}, sys; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", f"import {module} loads {out.stdout.strip()}"


# --- packaging ---------------------------------------------------------------------------------


@cache
def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_wheel_ships_only_gorgo_extproc_and_tuner() -> None:
    """The packages setuptools puts in the wheel, found as the build finds them (pyproject's
    `packages.find`, namespace packages included, which is setuptools' pyproject default)."""
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools) <= {"packages"}, "py-modules or package-dir would ship more"
    find = setuptools["packages"]["find"]
    assert find.get("namespaces", True)  # what the finder below assumes
    packages = find_namespace_packages(where=str(REPO / find.get("where", [""])[0]),
                                       include=find.get("include", ["*"]),
                                       exclude=find.get("exclude", ()))
    assert {p.split(".")[0] for p in packages} == set(SHIPPED), sorted(packages)
    for pkg in ("gorgo.core", "gorgo.core.policies", "gorgo.sim", "gorgo.harness", "gorgo._xds"):
        assert pkg in packages, pkg


def _names(requirements: list[str]) -> set[str]:
    out = set()
    for req in requirements:
        name = req.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        out.add(name.strip().lower())
    return out


def test_router_runtime_dependencies_carry_no_plotting() -> None:
    project = _pyproject()["project"]
    runtime = _names(project["dependencies"])
    extras = project["optional-dependencies"]
    assert "matplotlib" not in runtime
    assert "scipy" in runtime  # irb is a shipped router policy; its solver imports scipy lazily
    assert "matplotlib" in _names(extras["sim"])
    # `make venv` installs .[dev]: the tests and the demo need the plots too
    dev = extras["dev"]
    assert any(r.replace(" ", "").lower().startswith(f"{project['name']}[sim") for r in dev) or (
        "matplotlib" in _names(dev)), dev
