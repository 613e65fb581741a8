"""What the tuner believes, unit by unit (issue 12, findings 5, 6, 7 and 10): no one export can
set a prefill rate or decide an evaluation, a fitted rate stays near the fleet file's hint, and
the routers, not the spans, say which replicas exist and which weights version is live."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import numpy as np
import pytest

from gorgo.core.weights import Weights
from tests.tuner.test_calibration import traffic
from tuner.calibration import CalibrationConfig, PrefillCalibrator
from tuner.optimizer import INCUMBENT, OptimizerConfig, Proposal, Tuner
from tuner.publisher import Publisher, RouterTarget
from tuner.samples import Sample

TRUE_RATE = 20_000.0


def sourced(samples: list[Sample], first: int, per_export: int) -> list[Sample]:
    """The samples as exports of ``per_export`` each, numbered from ``first``."""
    return [dataclasses.replace(s, source=first + k // per_export) for k, s in enumerate(samples)]


def calibrator(**cfg: Any) -> PrefillCalibrator:
    return PrefillCalibrator(CalibrationConfig(window=400, min_samples=50, **cfg),
                             hints={"r0": TRUE_RATE})


# --- calibration ------------------------------------------------------------------------------


def test_one_burst_of_forged_spans_cannot_set_a_rate() -> None:
    """One export of 400 spans once set a replica's rate to 150 tok/s (true 20,000)."""
    rng = np.random.default_rng(1)
    forged = sourced(traffic(rng, 400, rate=150.0, router_rate=TRUE_RATE), 1, 400)
    cal = calibrator()
    for s in forged:
        cal.observe(s)
    assert cal.rates() == {}  # a quarter of the window at most, and nothing without it
    honest = sourced(traffic(rng, 400, rate=TRUE_RATE, router_rate=TRUE_RATE), 2, 5)
    for s in honest[:300] + forged + honest[300:]:
        cal.observe(s)
    assert cal.rates()["r0"] == pytest.approx(TRUE_RATE, rel=0.05)


def test_a_burst_that_would_carry_the_fit_is_not_trusted() -> None:
    """A fast burst of a quarter of the window pulls the low quantile to itself (the rate would
    be 7.5x the true one): without that one export the fit disagrees, so nothing is published
    (the rate the routers hold stays)."""
    def window(source: int | None) -> list[Sample]:
        rng = np.random.default_rng(2)
        honest = sourced(traffic(rng, 300, rate=TRUE_RATE, router_rate=TRUE_RATE), 1, 5)
        forged = [dataclasses.replace(s, source=source) for s in
                  traffic(rng, 100, rate=7.5 * TRUE_RATE, router_rate=TRUE_RATE, fixed=0.0,
                          noise=0.0)]
        return honest[:150] + forged + honest[150:]

    unattributed = calibrator()
    for s in window(None):
        unattributed.observe(s)
    assert unattributed.rates()["r0"] == pytest.approx(7.5 * TRUE_RATE, rel=0.01)
    cal = calibrator()
    for s in window(999):
        cal.observe(s)
    assert "r0" not in cal.rates()


@pytest.mark.parametrize(("true_rate", "published"), [(TRUE_RATE / 20, False),
                                                      (TRUE_RATE / 5, True),
                                                      (TRUE_RATE * 20, False)])
def test_a_rate_stays_within_a_factor_of_the_hint(true_rate: float, published: bool) -> None:
    rng = np.random.default_rng(3)
    cal = PrefillCalibrator(CalibrationConfig(window=400, min_samples=50, max_rate=1e9),
                            hints={"r0": TRUE_RATE})
    for s in sourced(traffic(rng, 400, rate=true_rate, router_rate=true_rate,
                             uncached=(640, 40960)), 1, 5):
        cal.observe(s)
    assert ("r0" in cal.rates()) == published


def test_a_replica_no_router_knows_is_forgotten() -> None:
    rng = np.random.default_rng(4)
    t = Tuner(OptimizerConfig(), calibration=CalibrationConfig(window=400, min_samples=50))
    for name in ("r0", "gone"):
        for s in traffic(rng, 200, rate=TRUE_RATE, router_rate=TRUE_RATE, replica=name):
            t.observe(s)
    t.rates = {"r0": 19_000.0, "gone": 5000.0}
    assert set(t.calibrator.rates()) == {"r0", "gone"}
    t.follow({"r0"}, {"r0": TRUE_RATE})
    assert t.rates == {"r0": 19_000.0} and set(t.calibrator.rates()) == {"r0"}
    assert t.calibrator.hints == {"r0": TRUE_RATE}


# --- evaluations ------------------------------------------------------------------------------


def sample(ttft: float, version: int, source: int | None) -> Sample:
    return Sample(ttft, ttft + 400.0, 200, "r0", "near", "gorgo", version, ttft,
                  {"rtt": 1.0, "queue": 0.0, "admission": 0.0, "prefill": 1.0,
                   "penalty": 0.0}, 0, 100,
                  source=source)


def run_evaluation(per_export: int) -> Tuner:
    """One evaluation (1 pair of 10-sample windows) whose candidate is far better; the samples
    of each window come in exports of ``per_export``."""
    t = Tuner(OptimizerConfig(window_samples=10, pairs=1, bootstrap=200, model_step=False,
                              calibrate=False), {"rtt": 1.0, "queue": 1.0})
    source = 0
    p = t.next_weights(0.0)
    for _ in range(2):  # the two windows, in the order the tuner drew
        ttft = 200.0 if p.arm == INCUMBENT else 20.0
        for k in range(10):
            source += k % per_export == 0
            t.observe(sample(ttft + k, p.weights.version, source))
        p = t.next_weights(1.0)
    return t


def test_one_export_cannot_decide_an_evaluation() -> None:
    """Forged spans once decided an evaluation and a candidate was published."""
    t = run_evaluation(per_export=10)  # every window filled by one export
    assert t.evaluations == 0 and t.accepted == 0
    assert t.history[-1]["event"] == "discarded" and t.history[-1]["reason"] == "one_export"
    honest = run_evaluation(per_export=2)
    assert honest.evaluations == 1 and honest.accepted == 1


# --- the publisher follows the routers ------------------------------------------------------


def test_a_router_that_lost_the_acknowledged_version_is_due_again() -> None:
    pub = Publisher([RouterTarget("http://a", "t")])
    t = pub.targets[0]
    pub._track[t.url].acked = 5
    pub.observe(t, {"version": 5, "prefill_rate": {"r0": 1.0}})
    assert pub._track[t.url].acked == 5
    pub.observe(t, {"version": 0, "prefill_rate": {"r0": 1.0}})  # restarted on its fleet file
    assert pub._track[t.url].acked == -1 and pub.replicas() == {"r0"}


def test_a_router_is_sent_rates_only_for_the_replicas_it_reported() -> None:
    pub = Publisher([RouterTarget("http://a", "t"), RouterTarget("http://b", "t")])
    a, b = pub.targets
    prop = Proposal(Weights({"rtt": 1.0, "queue": 1.0}, 3),
                    {"r0": 1000.0, "r1": 2000.0, "made-up": 5.0}, INCUMBENT)
    assert pub.replicas() is None
    assert pub._body(a, prop)["prefill_rate"] == prop.prefill_rate  # not reported yet
    pub.observe(a, {"version": 0, "prefill_rate": {"r0": 1.0, "r1": 1.0}})
    pub.observe(b, {"version": 0, "prefill_rate": {"r9": 1.0}})
    assert pub._body(a, prop)["prefill_rate"] == {"r0": 1000.0, "r1": 2000.0}
    assert "prefill_rate" not in pub._body(b, prop)
    assert pub.replicas() == {"r0", "r1", "r9"}


# --- the service follows the routers ----------------------------------------------------------


def test_a_rate_for_a_replica_no_router_knows_never_wedges_publishing(tmp_path,
                                                                       span_builders) -> None:
    """A name from a span, or a replica removed from the fleet file, once got every update
    refused (400 unknown replica), and a restart failed the same way."""
    import asyncio

    from tests.tuner.test_service import RouterApp, export_samples, write_config
    from tuner.main import UNKNOWN_REPLICA, TunerService, load_config
    from tuner.receiver import LOG_PREFIX
    from tuner.samples import Sample
    from tuner.state_store import save_state

    async def body() -> None:
        a = RouterApp()
        await a.start()
        cfg = load_config(write_config(tmp_path, [a]))
        t = Tuner(cfg.optimizer, {"rtt": 1.0, "queue": 1.0}, next_version=4)
        t.rates = {"r0": 9000.0, "removed": 5000.0}  # saved before "removed" left the fleet
        save_state(cfg.state_file, t.snapshot())
        svc = TunerService(cfg)
        await svc.start()
        try:
            assert svc.tuner.rates == {"r0": 9000.0}
            await svc.tick(0.0)
            assert a.weights.version == 4 and svc.publisher.status()[0]["error"] == ""
            assert float(a.router.state.prefill_rate[0]) == 9000.0
            # Spans that name a replica the router does not have get no buffer.
            attrs, span, export = span_builders
            await export_samples(svc.otlp_port, 4, 3, 100_000,
                                 (lambda **kw: attrs(gorgo__replica="ghost", **kw), span, export))
            assert svc.receiver.counts[UNKNOWN_REPLICA] == 3
            assert svc.tuner.seen == 0 and "ghost" not in svc.tuner.calibrator._rows
            # TTFT log records naming it are counted as log records, not as spans
            early = Sample(120.0, math.nan, 200, "ghost", "near", "gorgo", 4, 100.0, {}, 0,
                           100, decision_id="early-ghost")
            svc._on_samples([early, early])
            assert svc.receiver.counts[UNKNOWN_REPLICA] == 3
            assert svc.receiver.counts[LOG_PREFIX + UNKNOWN_REPLICA] == 2
        finally:
            await svc.stop()
            await a.stop()

    asyncio.run(body())


def test_a_restarted_router_is_republished_to_within_two_ticks(tmp_path) -> None:
    """After a router restarted on its fleet file's weights (v0) the tuner once believed its
    version live for minutes."""
    import asyncio

    from tests.tuner.test_service import RouterApp, write_config
    from tuner.main import TunerService, load_config

    async def body() -> None:
        a = RouterApp()
        await a.start()
        svc = TunerService(load_config(write_config(tmp_path, [a])))
        await svc.start()
        try:
            await svc.tick(0.0)
            live = a.weights
            assert live.version == 1
            port = int(a.url.rsplit(":", 1)[1])
            await a.stop()
            a = RouterApp()  # the same router, restarted: fleet-file weights, version 0
            await a.start(port)
            assert a.weights.version == 0
            for tick in range(2):
                await svc.tick(0.1 * (tick + 1))
                if a.weights.version:
                    break
            assert a.weights.version >= live.version
            assert dict(a.weights) == dict(live)
        finally:
            await svc.stop()
            await a.stop()

    asyncio.run(body())


def test_a_replica_removed_by_a_router_reload_leaves_the_tuner_within_one_tick(
        tmp_path, span_builders) -> None:
    """Issue 15: a replica the router's fleet reload removed must not keep a rate, calibration
    rows or a place in the live proposal, and its late spans are no samples."""
    import asyncio

    from gorgo.core.fleet import parse_fleet
    from tests.tuner.test_service import RouterApp, export_samples, write_config
    from tuner.main import UNKNOWN_REPLICA, TunerService, load_config

    async def body() -> None:
        a = RouterApp()
        await a.start()
        svc = TunerService(load_config(write_config(tmp_path, [a])))
        await svc.start()
        try:
            svc.tuner.rates = {"r0": 9000.0, "r1": 5000.0}
            svc.tuner.calibrator._rows["r1"] = deque()
            await svc.tick(0.0)
            version = a.weights.version
            assert float(a.router.state.prefill_rate[1]) == 5000.0
            a.router.reload(parse_fleet({"regions": {"local": {}}, "replicas": [
                {"name": "r0", "engine": "sim", "region": "local", "address": "127.0.0.1:1"}]}))
            await svc.tick(0.5)  # one tick: the router's GET /admin/weights names only r0
            assert svc.tuner.rates == {"r0": 9000.0}
            assert "r1" not in svc.tuner.calibrator._rows
            assert svc.status()["tuner"]["active"]["prefill_rate"] == {"r0": 9000.0}
            attrs, span, export = span_builders
            await export_samples(svc.otlp_port, version, 3, 100_000,
                                 (lambda **kw: attrs(gorgo__replica="r1", **kw), span, export))
            assert svc.receiver.counts[UNKNOWN_REPLICA] == 3
            assert "r1" not in svc.tuner.calibrator._rows
        finally:
            await svc.stop()
            await a.stop()

    asyncio.run(body())
