"""bench/peers.py's arguments, without starting a router: every live and offline run
is replaced by a failure, so a test passes only if the script stops (or renders) before them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import peers

SLICE = ["--routers", "gorgo", "--duration", "5", "--loads", "0.6", "--sim-seeds", "0"]


@pytest.fixture(autouse=True)
def _no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def ran(*_: Any, **__: Any) -> None:
        raise AssertionError("a run started")

    for name in ("run_live", "run_offline", "ensure_peers"):
        monkeypatch.setattr(peers, name, ran)
    monkeypatch.setattr(peers, "stop_on_signals", lambda: None)  # keep pytest's handlers


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert peers.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench/peers.py: "), err
    return err


@pytest.mark.parametrize(("argv", "says"), [
    (["--routers", "foo"], "--routers: router 'foo'"),
    (["--routers", ","], "--routers: expected at least one router"),
    (["--loads", "0"], "--loads: must be a finite number > 0"),
    (["--loads", "0.6,x"], "--loads: expected a number, got 'x'"),
    (["--duration", "0"], "--duration: must be a finite number > 0"),
    (["--capacity", "0"], "--capacity: must be a finite number > 0"),
    (["--capacity", "nan"], "--capacity: must be >= 0"),
    (["--timeout", "-1"], "--timeout: must be >= 0"),
    (["--repeats", "-1"], "--repeats: must be >= 0"),
    (["--offset", "1e9", "--sim-seeds", "1"], "no requests in trace time 1e+09-1e+09 s"),
])
def test_a_bad_argument_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str],
                                               argv: list[str], says: str) -> None:
    # Each was a traceback (ValueError, ZeroDivisionError), exit 1.
    assert says in _refused(capsys, argv)


def test_missing_render_file_is_one_line(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    err = _refused(capsys, ["--render", str(tmp_path / "none.json")])
    assert f"cannot read a saved run from {tmp_path / 'none.json'}" in err


def test_out_in_a_missing_folder_is_refused_before_the_offline_runs(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # It was a FileNotFoundError once the offline simulations (here: a failure) had run.
    out = tmp_path / "missing" / "x.json"
    err = _refused(capsys, [*SLICE, "--sim-seeds", "1", "--out", str(out)])
    assert f"cannot write {out}" in err
