"""Issue 12, the router's side under load, replayed against the real processes: `gorgo sim fleet`
+ `gorgo extproc` + real Envoy (LiveStack), all on loopback.

One test per finding: cheap bodies that exhausted the router's event loop and got healthy
replicas ejected (2), prompts an engine refused that stayed booked as queued work (3), and
shedding that outlived a fleet-wide outage (9). Normal traffic is open loop
(tests/support/load.py), every run is bounded in requests and time, and each test compares with
a baseline measured in the same test, never with a wall-clock figure. Figures are printed (pytest
-s) for docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.presets import fleet_document
from gorgo.sim.profiles import get_profile
from tests.support.load import (
    Answer,
    Planned,
    Sampler,
    chat_body,
    normal_traffic,
    p50_ms,
    per_replica,
    run,
    shares,
)

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

PROFILE = "h100-llama3-8b"
LINKS = {"near": {"rtt_ms": 5.0, "jitter_ms": 0.5}, "far": {"rtt_ms": 40.0, "jitter_ms": 2.0}}
PROBE_INTERVAL_S = 0.5
RATE = 10.0  # normal requests per second
# Scheduling slack on a shared two-core machine: added to every time bound, never to a count.
SLACK_S = 1.0


def fleet(**sections: Any) -> dict[str, Any]:
    """Two near replicas (5 ms) and two far ones (40 ms): normal traffic goes near."""
    doc = fleet_document({"near": 2, "far": 2}, profile=PROFILE, links=LINKS, name="load")
    doc["signals"] = {"probe_interval_s": PROBE_INTERVAL_S, "scrape_interval_s": 0.5,
                      "metrics_stale_s": 2.0}
    doc["timeouts"] = {"probe_ms": 500, "request_s": 60}
    doc.update(sections)
    return doc


@contextmanager
def live(tmp: Path, doc: dict[str, Any]) -> Iterator[LiveStack]:
    with LiveStack(with_free_ports(doc), tmp, StackOptions(stream_interval=16)) as stack:
        run(stack.url, normal_traffic(RATE, 2.0))  # warm: connections, RTT samples
        yield stack
        assert stack.wait_idle(30), f"in flight after the scenario: {stack.inflight()}"


def report(finding: str, **figures: Any) -> None:
    parts = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()]
    print(f"\n[security] {finding}: " + " ".join(parts))


def routed(answers: list[Answer]) -> float:
    return sum(a.status == 200 and a.replica is not None for a in answers) / len(answers)


def error_code(a: Answer) -> str | None:
    try:
        return json.loads(a.body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def test_cheap_huge_bodies_neither_starve_requests_nor_eject_replicas(tmp_path: Path) -> None:
    """Finding 2: ten 3.6 MB bodies of 300k `tools` entries, one every 2 s beside 10 normal
    requests/s. Each cost the router 2.6 s of its only event loop: 2 of 200 normal requests were
    routed, and the probes on the same loop timed out until every healthy replica was ejected."""
    attack = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "tools": [{"abc": 1}] * 300_000}).encode()
    assert 3.4e6 < len(attack) < 3.8e6
    with live(tmp_path, fleet()) as stack:
        errors0 = sum(per_replica(stack, "gorgo_probe_errors_total").values())
        quiet = run(stack.url, normal_traffic(RATE, 10.0))
        with Sampler(lambda: per_replica(stack, "gorgo_replica_healthy")) as health:
            loud = run(stack.url, normal_traffic(RATE, 20.0) + [
                Planned(1.0 + 2.0 * k, "attack", attack) for k in range(10)])
        errors = sum(per_replica(stack, "gorgo_probe_errors_total").values()) - errors0
    normal = [a for a in loud if a.kind == "normal"]
    attacks = [a for a in loud if a.kind == "attack"]
    ejected = sum(v < 1.0 for _, values in health.samples for v in values.values())
    report("huge bodies", routed=routed(normal), quiet_p50_ms=p50_ms(quiet),
           attack_p50_ms=p50_ms(normal), attack_statuses=sorted({a.status for a in attacks}),
           attack_max_s=max(a.latency_s for a in attacks), ejected_samples=ejected,
           probe_errors=errors)
    assert all(a.status == 413 and error_code(a) == "request_too_large" for a in attacks), [
        (a.status, a.body[:200]) for a in attacks]
    assert routed(quiet) == 1.0
    assert routed(normal) >= 0.95
    assert p50_ms(normal) <= 2 * p50_ms(quiet)
    assert len(health.samples) > 50 and ejected == 0


def explain_queue_ms(stack: LiveStack) -> dict[str, float]:
    """Each replica's queue term for a small request, on the router's live state."""
    out = stack.explain(json.loads(chat_body("probe")))
    return {row["replica"]: row["queue_ms"] for row in out["replicas"]}


def _after(actions: list[tuple[float, Callable[[], Any]]], marks: dict[int, float]) -> None:
    """Run each ``(delay_s, fn)`` in a thread, recording when each returned."""
    t0 = time.monotonic()

    def go() -> None:
        for k, (at, fn) in enumerate(actions):
            time.sleep(max(0.0, t0 + at - time.monotonic()))
            fn()
            marks[k] = time.monotonic()

    threading.Thread(target=go, daemon=True).start()


def test_a_prompt_the_engine_refuses_leaves_no_queue_behind(tmp_path: Path) -> None:
    """Finding 3: prompts that passed the router but that every engine refuses at once (here the
    fleet file's KV hint is 10x what the engines hold) stayed booked as queued prefill, drained
    only at the prefill rate: 20 s each here, so all traffic went to the one replica left."""
    capacity = get_profile(PROFILE).kv_capacity_tokens
    doc = fleet()
    for r in doc["replicas"]:
        r["kv_capacity_tokens"] = 10 * capacity
    tokens = capacity + capacity // 8
    big = [chat_body(os.urandom(8).hex() + "x" * (4 * tokens)) for _ in range(3)]
    with live(tmp_path, doc) as stack:
        near = [r["name"] for r in doc["replicas"] if r["region"] == "near"]
        names = [r["name"] for r in doc["replicas"]]
        with Sampler(lambda: explain_queue_ms(stack), period_s=0.1) as queue:
            answers = run(stack.url, normal_traffic(RATE, 16.0) + [
                Planned(5.0, "oversized", b) for b in big])
    oversized = [a for a in answers if a.kind == "oversized"]
    normal = [a for a in answers if a.kind == "normal"]
    refused_at = max(a.sent + a.latency_s for a in oversized)
    sent_at = min(a.sent for a in oversized)
    before = [a for a in normal if a.sent < sent_at]
    after = [a for a in normal if a.sent >= refused_at + 2.0]
    near_before = shares(before, names)[[names.index(n) for n in near]].sum()
    near_after = shares(after, names)[[names.index(n) for n in near]].sum()
    peak = max((max(v.values()) for t, v in queue.samples if t >= sent_at), default=np.nan)
    cleared = next((t for t, v in queue.samples if t >= refused_at and max(v.values()) < 50),
                   None)
    report("refused prompts", statuses=sorted({a.status for a in oversized}),
           refused_in_s=refused_at - sent_at, peak_queue_ms=peak,
           queue_cleared_after_s=None if cleared is None else cleared - refused_at,
           near_share_before=near_before, near_share_after=near_after, routed=routed(normal))
    assert all(a.status == 400 for a in oversized)  # by the engines: the router let them pass
    assert cleared is not None and cleared - refused_at <= 2.0, "queue not cleared within 2 s"
    assert len(after) >= 50 and near_after >= 0.8 * near_before
    assert routed(normal) == 1.0


def test_a_request_no_replica_can_hold_is_refused_by_the_router(tmp_path: Path) -> None:
    """Finding 3's other half: with the fleet file's KV sizes right, such a prompt (or an absurd
    `max_tokens`) is a 400 from the router itself and is booked nowhere."""
    capacity = get_profile(PROFILE).kv_capacity_tokens
    with live(tmp_path, fleet()) as stack:
        answers = run(stack.url, [
            Planned(0.0, "long", chat_body("y" * (4 * capacity + 40))),
            Planned(0.0, "max_tokens", chat_body("hello", max_tokens=10**30)),
            Planned(0.0, "sum", chat_body("z" * (2 * capacity), max_tokens=capacity // 2 + 10)),
        ])
        queue = explain_queue_ms(stack)
        decisions = sum(stack.metric_values("gorgo_decisions_total").values())
    codes = {a.kind: (a.status, error_code(a)) for a in answers}
    report("too large for any replica", **{k: str(v) for k, v in codes.items()})
    assert codes == {"long": (400, "context_length_exceeded"),
                     "max_tokens": (400, "integer_above_max_value"),
                     "sum": (400, "context_length_exceeded")}
    assert max(queue.values()) < 50
    warm = round(RATE * 2.0)
    assert decisions == warm  # the warm-up's, none of these


def test_admission_resumes_within_a_probe_interval_after_a_fleet_wide_outage(
    tmp_path: Path,
) -> None:
    """Finding 9: every replica down for 4 s, then back. Their failure penalties were counted as
    predicted latency, so every request got 429 for about 12 s with all replicas healthy."""
    doc = fleet(shedding={"slo_ms": 1000})
    names = [r["name"] for r in doc["replicas"]]
    with live(tmp_path, doc) as stack:
        marks: dict[int, float] = {}
        _after([(3.0, lambda: [stack.control(n, "kill") for n in names]),
                (7.0, lambda: [stack.control(n, "revive") for n in names])], marks)
        answers = run(stack.url, normal_traffic(RATE, 16.0))
        penalty = max(per_replica(stack, "gorgo_penalty_seconds").values())
    back = marks[1]
    after = [a for a in answers if a.sent >= back]
    first_ok = min((a.sent for a in after if a.status == 200), default=np.inf) - back
    late = [a for a in after if a.sent >= back + PROBE_INTERVAL_S + SLACK_S]
    report("outage", first_ok_after_s=first_ok, shed_after=sum(a.status == 429 for a in after),
           failed_late=sum(a.status != 200 for a in late), penalty_s=penalty,
           statuses=sorted({str(a.status) for a in answers}))
    assert first_ok <= PROBE_INTERVAL_S + SLACK_S
    assert len(late) >= 50 and all(a.status == 200 for a in late), sorted(
        {(a.status, error_code(a)) for a in late if a.status != 200}, key=str)
