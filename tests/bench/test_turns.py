"""bench.turns: the open and closed replays of the same chat windows, and its one-line errors."""

from __future__ import annotations

import pytest

from bench import turns


def test_a_closed_replay_holds_follow_ups_back_and_reports_each_share() -> None:
    # 40 req/s on six replicas, twice their capacity: the open replay sends every follow-up
    # before its answer, and the closed one holds each back.
    share, early_end, early_first, held, hold_s, cached_open, cached_closed = turns.measure(
        "round-robin", 1.0, 1, 200, 40.0, "paper")
    assert 0.2 < share < 0.9  # the first 200 requests: many first turns
    assert 0.0 <= early_first <= early_end == 1.0
    assert held == 1.0 and hold_s > 1.0
    assert 0.0 <= cached_open <= 1.0 and 0.0 <= cached_closed <= 1.0


@pytest.mark.parametrize(("argv", "error"), [
    (["--loads", "x"], "expected comma-separated numbers"),
    (["--loads", "0"], "loads must be finite and > 0"),
    (["--policies", "nope"], "--policies: unknown nope"),
])
def test_bad_arguments_are_one_line(argv: list[str], error: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert turns.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert error in err and "\n" not in err
