from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import floor
from bench.matrix import LOADS, TRACES


def _run(policy: str, window: int, ttft: float, e2e: float, load: float = 0.05) -> dict:
    return {"policy": policy, "window": window, "seed": 0, "load": load,
            "metrics": {"ttft_p95_ms": ttft, "e2e_p95_ms": e2e}}


def test_a_row_is_the_floor_over_the_best_peer_per_window_and_marks_an_unreachable_goal() -> None:
    # floor: the lowest p95 of the floor policies per window (100 / 200 ms TTFT)
    floor_runs = [_run("kv-cost", 0, 100, 1000), _run("gorgo@ttft", 0, 120, 900),
                  _run("kv-cost", 1, 200, 2000), _run("gorgo@ttft", 1, 250, 2100)]
    matrix_runs = []
    for load in LOADS:
        for w, (peer_ttft, variant_ttft) in enumerate([(110, 150), (220, 300)]):
            matrix_runs += [_run("cache-aware", w, peer_ttft, 5000, load),
                            _run("round-robin", w, 10 * peer_ttft, 4000, load),
                            _run("gorgo@e2e", w, variant_ttft, 3000, load),
                            _run("oracle", w, 1, 1, load)]  # a bound is no peer
    line = floor.row("chat", floor_runs, matrix_runs, list(LOADS), "gorgo@e2e")
    cells = [c.strip() for c in line.strip("| \n").split("|")]
    assert cells[0] == "chat"
    assert cells[1] == "100 / 200"
    # 100/110 and 200/220: 0.91 at every load, above the goal's 0.85, so bold
    assert cells[2] == " / ".join(["**0.91**"] * len(LOADS))
    assert cells[3] == " / ".join(["1.50"] * len(LOADS))  # 150/100, 300/200
    # E2E: the best peer by E2E is round-robin (4000): 900/4000, 2000/4000
    assert cells[4] == " / ".join([f"{(900 / 4000 + 2000 / 4000) / 2:.2f}"] * len(LOADS))


def _results(path: Path, windows: int, requests: int, loads: tuple[float, ...], policies: list[str]
             ) -> None:
    """A results.json of ``windows`` windows (runs pair with the floor's by window index)."""
    path.mkdir(parents=True, exist_ok=True)
    runs = [_run(p, w, 100 + w, 1000, load) for load in loads for w in range(windows)
            for p in policies]
    doc = {"windows": [{"label": f"t[{w * requests}:{(w + 1) * requests}]", "requests": requests}
                       for w in range(windows)], "loads": list(loads), "runs": runs}
    (path / "results.json").write_text(json.dumps(doc))


def _fake_floor_runs(monkeypatch: pytest.MonkeyPatch, windows: int) -> list[tuple[int, int]]:
    """`run_pair` replaced by one writing a floor of ``windows`` windows; the (windows, requests)
    each call was asked for."""
    asked: list[tuple[int, int]] = []

    def fake_pair(trace: str, fleet: str, pols: list[str], at: argparse.Namespace,
                  capacity: Path | None = None) -> Path:
        asked.append((at.windows, at.requests))
        out = at.out / f"{trace}-{fleet}"
        _results(out, windows, 1500, at.loads, pols)
        return out

    monkeypatch.setattr(floor, "run_pair", fake_pair)
    return asked


@pytest.mark.parametrize(("floor_windows", "code"), [(5, 0), (3, 2)])
def test_the_floor_runs_the_matrix_windows_and_refuses_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, floor_windows: int, code: int) -> None:
    """The floor pairs its runs with the matrix's by window index: it had its own --windows 3,
    so on a five-window matrix its window 1 was another slice of the trace than the matrix's."""
    matrix = tmp_path / "matrix"
    for trace in TRACES:
        _results(matrix / f"{trace}-{floor.FLEET}", 5, 1500, LOADS,
                 ["cache-aware", "gorgo@e2e"])
    asked = _fake_floor_runs(monkeypatch, floor_windows)
    assert floor.main(["--matrix", str(matrix), "--out", str(tmp_path / "floor")]) == code
    assert asked[0] == (5, 1500)


@pytest.mark.parametrize(("loads", "code"), [((0.8,), 0), ((0.5, 0.8), 0), (None, 2)])
def test_the_floor_reads_the_loads_the_matrix_ran(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        loads: tuple[float, ...] | None, code: int) -> None:
    """A matrix run with `--loads 0.8` alone failed with a KeyError on the missing loads; traces
    that ran other loads than each other are refused (one header for the table)."""
    matrix = tmp_path / "matrix"
    for i, trace in enumerate(TRACES):
        ran = loads if loads is not None else ((0.8,) if i == 0 else (0.5, 0.8))
        _results(matrix / f"{trace}-{floor.FLEET}", 2, 1500, ran, ["cache-aware", "gorgo@e2e"])
    _fake_floor_runs(monkeypatch, 2)
    assert floor.main(["--matrix", str(matrix), "--out", str(tmp_path / "floor")]) == code
    out, err = capsys.readouterr()
    if code:
        assert "ran other loads than the other traces" in err
        return
    lines = out.splitlines()
    assert f"at {' / '.join(f'{x:g}' for x in loads)} (bold" in lines[0]
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("| \n").split("|")]
        assert len(cells[2].split(" / ")) == len(loads)
