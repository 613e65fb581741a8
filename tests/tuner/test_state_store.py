"""The state file: atomic replace, resume, and refusal of a file it cannot trust."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from tuner.optimizer import OptimizerConfig, Tuner
from tuner.state_store import StateError, check_state, load_state, save_state

MAX_MS = 600_000.0


def state(**over: Any) -> dict[str, Any]:
    """A tuner's real snapshot, through JSON, with ``over`` applied (None deletes a key)."""
    t = Tuner(OptimizerConfig(), {"rtt": 1.0, "queue": 0.5}, seed=1, next_version=7)
    t.rates = {"r0": 20000.0}
    snap = json.loads(json.dumps(t.snapshot()))
    for k, v in over.items():
        if v is None:
            snap.pop(k, None)
        else:
            snap[k] = v
    return snap


def test_round_trip_and_no_temporary_files_left(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.json"
    assert load_state(path, MAX_MS) is None
    save_state(path, state(next_version=5))
    save_state(path, state(next_version=6))
    assert load_state(path, MAX_MS) == state(next_version=6)
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_failed_write_keeps_the_old_state(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    save_state(path, state(next_version=5))
    with pytest.raises(ValueError):
        save_state(path, {"bad": float("nan")})  # not valid JSON: refused before writing
    assert load_state(path, MAX_MS)["next_version"] == 5
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


@pytest.mark.parametrize(("text", "match"), [
    ("{half", "not valid JSON"), ("[1]", "object"),
    ("[" * 100_000, "not valid JSON"),  # a RecursionError escaped the state error
])
def test_unusable_state_file_is_an_error(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(text)
    with pytest.raises(StateError, match=match):
        load_state(path, MAX_MS)


def test_a_state_file_that_is_not_utf8_is_a_state_error(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b'{"format": 1}\xff')
    with pytest.raises(StateError, match="not UTF-8"):
        load_state(path, MAX_MS)


def test_scores_above_a_lowered_request_timeout_are_forgotten_not_the_state(
        tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    # any factor: 400 s scored under 600 s, the timeout now 30 s (refused at more than 10x)
    path.write_text(json.dumps(state(incumbent_p95=45_000.0, last_good_p95=1_000.0,
                                     baseline_p95=400_000.0)))
    loaded = load_state(path, 30_000.0)
    assert loaded["incumbent_p95"] is None and loaded["last_good_p95"] == 1_000.0
    assert loaded["baseline_p95"] is None
    # far beyond any timeout it was scored under: no score (it once switched regression
    # detection off), the state is refused
    path.write_text(json.dumps(state(incumbent_p95=1.7e305)))
    with pytest.raises(StateError, match="incumbent_p95"):
        load_state(path, 30_000.0)
    assert loaded["next_version"] == state()["next_version"]


def test_a_snapshot_and_a_format_1_file_are_accepted() -> None:
    check_state(state(), MAX_MS)
    check_state(state(format=1, incumbent=[0.7, 3.0], last_good=[1, 1], model_tried=None),
                MAX_MS)
    # A replica since removed from the fleet file is no reason to refuse: the tuner forgets it
    # once the routers have said which replicas they know (TunerService._follow).
    check_state(state(prefill_rate={"gone": 1000.0}), MAX_MS)
    # Spreads per evaluation: per lag (fractional df: a pair of an arm of 3 windows counts 2/3),
    # none (no arm had two windows), or one of any lag as older tuners wrote them
    check_state(state(spreads=[[[0.1, 0.05, 0.67, 1], [0.2, 0.1, 1.33, 2]], [],
                               [0.1, 0.1, 2], [0.3, 0.1]]), MAX_MS)


def test_a_nan_where_no_field_check_looks_is_refused_before_a_save_could_fail(
        tmp_path: Path) -> None:
    # Python reads NaN; the first save after the start refused it and stopped the tuner
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state(history=[{"event": "evaluation", "p95_candidate": math.nan}])))
    with pytest.raises(StateError, match="not JSON compliant"):
        load_state(path, MAX_MS)


BIG = int("1" + "0" * 400)  # parses as JSON; once accepted as a version (issue 12, finding 8)


@pytest.mark.parametrize(("over", "field"), [
    ({"format": None}, "format"),
    ({"format": 99}, "format"),
    ({"format": True}, "format"),
    ({"incumbent": None}, "incumbent"),
    ({"incumbent": {"rtt": 1, "warp": 2}}, "incumbent"),
    ({"incumbent": {"rtt": 1, "queue": -1}}, "incumbent"),
    ({"incumbent": {"rtt": 1, "queue": 1e-300}}, "incumbent.queue"),  # near zero
    ({"incumbent": {"rtt": 1, "queue": 1e300}}, "incumbent.queue"),
    ({"format": 1, "incumbent": [1, 1, 1]}, "incumbent"),
    ({"format": 2, "incumbent": [1, 1]}, "incumbent"),
    ({"last_good": {"rtt": "fast", "queue": 1}}, "last_good"),
    ({"next_version": BIG}, "next_version"),
    ({"next_version": 2**63}, "next_version"),
    ({"next_version": 0}, "next_version"),
    ({"next_version": 3.5}, "next_version"),
    ({"evaluations": -1}, "evaluations"),
    ({"evaluations": 2, "accepted": 3}, "accepted"),
    ({"failures": True}, "failures"),
    ({"sigma": 0}, "sigma"),
    ({"sigma": -0.5}, "sigma"),
    ({"sigma": 1e308}, "sigma"),
    ({"sigma": 10**400}, "sigma"),  # an integer past a float's range: OverflowError, a traceback
    ({"prefill_rate": {"r0": 10**400}}, "prefill_rate.r0"),
    ({"phase": "dancing"}, "phase"),
    ({"baseline_p95": -1}, "baseline_p95"),
    ({"prefill_rate": {"r0": -20000}}, "prefill_rate.r0"),
    ({"prefill_rate": {"r0": 1e-300}}, "prefill_rate.r0"),
    ({"prefill_rate": {"r0": 1e308}}, "prefill_rate.r0"),
    ({"prefill_rate": {"r0": "fast"}}, "prefill_rate.r0"),
    ({"prefill_rate": {"": 1000}}, "prefill_rate"),
    ({"prefill_rate": [1000]}, "prefill_rate"),
    ({"history": {"event": "x"}}, "history"),
    ({"spreads": [[0.1]]}, "spreads"),
    ({"spreads": {"between": 0.1}}, "spreads"),
    ({"spreads": [[-0.1, 0.1]]}, "spreads[0][0]"),
    ({"spreads": [[0.1, 0.1], [0.1, "wide"]]}, "spreads[1][1]"),
    ({"spreads": [[[0.1, 0.1, 2.0, 1]], [[0.1, 0.1, 2.0, 0]]]}, "spreads[1][0][3]"),
    ({"spreads": [[[0.1, 0.1, 2.0]]]}, "spreads[0][0]"),
    ({"spreads": [[[0.1, 0.1, -2.0, 1]]]}, "spreads[0][0][2]"),
    ({"spreads": [[0.1, 0.1, -1]]}, "spreads[0][2]"),
    ({"spreads": [[0.1, 0.1, 2, 3]]}, "spreads"),
    ({"rng": {"bit_generator": "MT19937"}}, "rng"),
])
def test_an_untrustworthy_state_is_refused_naming_its_field(tmp_path: Path, over: dict,
                                                           field: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state(**over)))
    with pytest.raises(StateError) as exc:
        load_state(path, MAX_MS)
    message = str(exc.value)
    assert message.startswith(f"{path}: {field}") and "move it away" in message
    assert "\n" not in message and len(message) < 300 + len(str(path))
