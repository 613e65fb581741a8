"""bench/matrix.py's cells and docs blocks, with every `gorgo bench sim` replaced by a recorder."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import matrix

EXACT_BLOCK = ("# Results\n\n## Offline matrix: every trace, fleet and load\n\n"
               "<!-- bench/matrix.py begin -->\nthe exact run\n<!-- bench/matrix.py end -->\n")


@pytest.fixture()
def benches(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(matrix.bench, "main", lambda a: seen.append(a) or 0)
    monkeypatch.setattr(matrix, "stop_on_signals", lambda: None)  # keep pytest's handlers
    return seen


def test_a_bound_runs_every_trace_with_it_into_its_own_block(
        tmp_path: Path, benches: list[argparse.Namespace]) -> None:
    doc = tmp_path / "results.md"
    doc.write_text(EXACT_BLOCK)
    assert matrix.main(["--bound", "4096", "--loads", "0.8", "--write-docs", str(doc),
                        "--out", str(tmp_path / "m")]) == 0
    assert {a.trace for a in benches} == {
        "mooncake:max_tokens=4096", "azure:max_tokens=4096",
        "azure:system_tokens=0,max_tokens=4096", "chat:max_tokens=4096"}
    assert {a.load for a in benches} == {"0.8"}
    text = doc.read_text()
    assert "the exact run" in text  # the acceptance block is another one
    block = text.split("<!-- bench/matrix.py max_tokens=4096 begin -->", 1)[1]
    assert "Every client sends `max_tokens` 4096" in block
    rows = [line for line in block.splitlines() if line.startswith(("| mooncake", "| chat"))]
    assert len(rows) == 6 and all("| 0.8 |" in r for r in rows)  # one load, no row dropped


def test_the_exact_run_is_unchanged(tmp_path: Path, benches: list[argparse.Namespace]) -> None:
    assert matrix.main(["--out", str(tmp_path / "m")]) == 0
    assert {a.trace for a in benches} == set(matrix.TRACES.values())
    assert {a.load for a in benches} == {"0.5,0.8,0.95"}
    assert {(a.windows, a.seeds) for a in benches} == {(5, 2)}  # t over 5 windows, not 3


def test_a_bound_without_out_gets_its_own_folder(benches: list[argparse.Namespace],
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert matrix.main(["--bound", "none", "--loads", "0.8"]) == 0
    assert {a.out.parent for a in benches} == {Path("results/matrix-max_tokens-none")}


@pytest.mark.parametrize("argv", [["--bound", "0"], ["--bound", "many"], ["--loads", "-1"]])
def test_bad_flags_are_refused(argv: list[str], benches: list[argparse.Namespace]) -> None:
    with pytest.raises(SystemExit) as exc:
        matrix.main(argv)
    assert exc.value.code == 2 and not benches
