from __future__ import annotations

from bench import floor
from bench.matrix import LOADS


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
    line = floor.row("chat", floor_runs, matrix_runs, "gorgo@e2e")
    cells = [c.strip() for c in line.strip("| \n").split("|")]
    assert cells[0] == "chat"
    assert cells[1] == "100 / 200"
    # 100/110 and 200/220: 0.91 at every load, above the goal's 0.85, so bold
    assert cells[2] == " / ".join(["**0.91**"] * len(LOADS))
    assert cells[3] == " / ".join(["1.50"] * len(LOADS))  # 150/100, 300/200
    # E2E: the best peer by E2E is round-robin (4000): 900/4000, 2000/4000
    assert cells[4] == " / ".join([f"{(900 / 4000 + 2000 / 4000) / 2:.2f}"] * len(LOADS))
