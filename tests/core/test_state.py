"""Fleet state: RTT smoothing, waiting-token model, health ejection and backoff."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from gorgo.core.features import RequestFeatures, extract_features
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.state import BACKOFF_MAX_S, FAILURES_TO_EJECT, FleetState
from gorgo.core.weights import Weights


def spec(**signals: float) -> FleetSpec:
    return parse_fleet({
        "regions": {"us-east": {}, "ap-seoul": {}},
        "block_tokens": 4,
        "chars_per_token": 1.0,
        "signals": {"rtt_ewma_alpha": 0.5, "metrics_stale_s": 5.0, **signals},
        "replicas": [
            {"name": "a", "engine": "sim", "region": "us-east", "address": "h:1",
             "prefill_rate": 1000,
             "kv_capacity_tokens": 40},
            {"name": "b", "engine": "sim", "region": "ap-seoul", "address": "h:2",
             "prefill_rate": 2000},
            {"name": "c", "engine": "sim", "region": "us-east", "address": "h:3",
             "prefill_rate": 4000},
        ],
    })


def prompt(text: str, s: FleetState) -> RequestFeatures:
    return extract_features("/v1/completions", {}, json.dumps({"prompt": text}).encode(), s.tok)


def test_initial_state() -> None:
    s = FleetState(spec())
    assert s.n == 3
    assert s.names == ["a", "b", "c"]
    assert s.clusters == ["a", "b", "c"]
    np.testing.assert_array_equal(s.region_idx, [0, 1, 0])
    assert (s.tok.chars_per_token, s.tok.block_tokens) == (1.0, 4)
    np.testing.assert_array_equal(s.prefill_rate, [1000.0, 2000.0, 4000.0])
    assert np.isnan(s.rtt_ms).all()
    assert s.routable().all()
    np.testing.assert_array_equal(s.waiting_tokens(), [0, 0, 0])
    assert s.weights == Weights()


def test_prefix_capacity_from_kv_tokens() -> None:
    s = FleetState(spec())
    assert s.prefix.capacity == [10, 125_000, 125_000]  # kv tokens // block tokens
    assert FleetState(spec(), unbounded_prefix=True).prefix.capacity is None


def test_rtt_ewma() -> None:
    s = FleetState(spec())
    s.observe_rtt(0, 100.0)
    assert s.rtt_ms[0] == 100.0  # first sample taken as is
    s.observe_rtt(0, 200.0)
    assert s.rtt_ms[0] == pytest.approx(150.0)  # alpha 0.5
    s.observe_rtt(0, 50.0)
    assert s.rtt_ms[0] == pytest.approx(100.0)
    assert s.rtt_samples[0] == 3
    assert np.isnan(s.rtt_ms[1])
    for bad in (math.inf, -5.0, math.nan):  # no clock measures these: an inf priced every
        s.observe_rtt(0, bad)  # replica out (503) and broke irb's solver
        s.observe_rtt(1, bad)
    assert s.rtt_ms[0] == pytest.approx(100.0) and s.rtt_samples[0] == 3
    assert np.isnan(s.rtt_ms[1]) and s.rtt_samples[1] == 0


def test_unprobed_replicas_priced_at_worst_known_rtt() -> None:
    s = FleetState(spec())
    np.testing.assert_array_equal(s.rtt_or_default(), [0.0, 0.0, 0.0])
    s.observe_rtt(0, 40.0)
    s.observe_rtt(2, 300.0)
    np.testing.assert_array_equal(s.rtt_or_default(), [40.0, 300.0, 300.0])


def test_backlog_drains_at_prefill_rate() -> None:
    s = FleetState(spec())
    s.now = 10.0
    s.add_inflight(0, prompt_tokens=3000, uncached=2000)
    s.add_inflight(1, prompt_tokens=3000, uncached=2000)
    np.testing.assert_allclose(s.waiting_tokens(), [2000, 2000, 0])
    s.now = 10.5
    np.testing.assert_allclose(s.waiting_tokens(), [1500, 1000, 0])
    s.now = 12.5
    np.testing.assert_allclose(s.waiting_tokens(), [0, 0, 0])  # never negative


def test_backlog_accumulates_after_partial_drain() -> None:
    s = FleetState(spec())
    s.now = 0.0
    s.add_inflight(0, 1000, 1000)
    s.now = 0.25  # 250 drained
    s.add_inflight(0, 500, 500)
    assert s.backlog_tokens[0] == pytest.approx(1250.0)
    assert s.backlog_at[0] == 0.25
    s.now = 2.0  # a long idle gap does not bank negative backlog
    s.add_inflight(0, 100, 100)
    assert s.backlog_tokens[0] == pytest.approx(100.0)


def test_inflight_accounting() -> None:
    s = FleetState(spec())
    s.add_inflight(1, 300, 100)
    s.add_inflight(1, 200, 200)
    assert s.inflight_reqs[1] == 2 and s.inflight_prompt_tokens[1] == 500
    assert s.sent_since_scrape[1] == 300
    s.release_inflight(1, 300)
    assert s.inflight_reqs[1] == 1 and s.inflight_prompt_tokens[1] == 200
    assert s.mean_uncached[1] == pytest.approx(1000 + 0.1 * (100 - 1000) + 0.1 * (
        200 - (1000 + 0.1 * (100 - 1000))))


def test_fresh_scrape_counts_other_routers_load() -> None:
    s = FleetState(spec())
    s.now = 100.0
    s.observe_engine(0, now=100.0, queue_reqs=3, running_reqs=1, kv_usage=0.5)
    # 3 queued requests at the 1000-token prior, none of ours in flight.
    np.testing.assert_allclose(s.waiting_tokens(), [3000, 0, 0])
    s.add_inflight(0, 500, 500)  # sent after the scrape: queued behind it
    assert s.waiting_tokens()[0] == pytest.approx(3000 + 500)


def test_what_was_sent_after_a_scrape_drains_and_the_scraped_queue_holds() -> None:
    """What this router sent after a scrape is prefilled at the replica's rate: an engine view
    in which it only grew until the next scrape made a replica look busier the longer ago it was
    scraped, and the router chased the freshest scrape (docs/results.md, "Bursts and the engine
    view of the queue"). The scraped queue itself is held until the next scrape: it is what
    shows an engine slower than its hinted rate, which a drain at that rate would hide."""
    s = FleetState(spec())
    s.observe_engine(0, now=10.0, queue_reqs=3, running_reqs=1, kv_usage=0.5)
    s.now = 10.5  # replica a prefills 1000 tokens/s
    s.add_inflight(0, 400, 400)
    assert s.engine_backlog(0) == pytest.approx(3000 + 400)
    s.now = 10.7
    assert s.waiting_tokens()[0] == pytest.approx(3000 + 200)
    s.now = 12.0
    assert s.waiting_tokens()[0] == pytest.approx(3000)
    s.observe_engine(0, now=12.0, queue_reqs=0, running_reqs=1, kv_usage=0.5)
    assert s.waiting_tokens()[0] == 0.0


def test_release_bounds_the_engine_view_by_what_is_open() -> None:
    """A request that ended waits for nothing: the engine view keeps the scrape's share that is
    still draining and no more of ours than is still open."""
    s = FleetState(spec())
    s.observe_engine(0, now=0.0, queue_reqs=1, running_reqs=1, kv_usage=0.1)
    s.add_inflight(0, 3000, 3000)
    s.release_inflight(0, 3000, 3000)  # refused at once: nothing of ours is open
    assert s.engine_backlog(0) == pytest.approx(1000)


def test_fresh_scrape_smaller_than_own_backlog_is_ignored() -> None:
    s = FleetState(spec())
    s.now = 0.0
    s.add_inflight(0, 5000, 5000)
    s.observe_engine(0, now=0.0, queue_reqs=0, running_reqs=1, kv_usage=0.1)
    assert s.waiting_tokens()[0] == pytest.approx(5000)


def test_stale_scrape_is_ignored() -> None:
    s = FleetState(spec())
    s.observe_engine(1, now=10.0, queue_reqs=30, running_reqs=0, kv_usage=0.0)
    s.now = 15.0  # exactly metrics_stale_s old: still fresh
    assert s.waiting_tokens()[1] == pytest.approx(30_000)
    s.now = 15.01
    assert s.waiting_tokens()[1] == 0.0


def test_scrape_resets_sent_since_scrape() -> None:
    s = FleetState(spec())
    s.add_inflight(2, 400, 400)
    s.observe_engine(2, now=0.0, queue_reqs=1, running_reqs=0, kv_usage=0.2)
    assert s.sent_since_scrape[2] == 0.0
    # The scraped request at the mean uncached size, nothing of ours (it was read after ours).
    assert s.engine_backlog(2) == pytest.approx(s.mean_uncached[2])
    assert (s.eng_queue_reqs[2], s.eng_running_reqs[2], s.eng_kv_usage[2]) == (1, 0, 0.2)
    assert s.eng_scraped_at[2] == 0.0


def test_health_ejection_backoff_and_readmission() -> None:
    s = FleetState(spec())
    for _ in range(FAILURES_TO_EJECT - 1):
        s.record_failure(1, now=100.0)
    assert s.healthy[1]
    assert s.routable()[1]
    s.record_failure(1, now=100.0)
    assert not s.healthy[1]
    np.testing.assert_array_equal(s.routable(), [True, False, True])
    assert s.retry_at[1] == 101.0
    s.record_failure(1, now=101.0)
    assert s.retry_at[1] == 103.0  # backoff doubles
    s.record_failure(1, now=103.0)
    assert s.retry_at[1] == 107.0
    for _ in range(20):
        s.record_failure(1, now=200.0)
    assert s.retry_at[1] == 200.0 + BACKOFF_MAX_S  # capped
    s.record_success(1)
    assert s.healthy[1] and s.failures[1] == 0 and s.retry_at[1] == 0.0


def test_success_resets_failure_count() -> None:
    s = FleetState(spec())
    s.record_failure(0, now=0.0)
    s.record_failure(0, now=0.0)
    s.record_success(0)
    s.record_failure(0, now=0.0)
    s.record_failure(0, now=0.0)
    assert s.healthy[0]


def test_a_good_answer_resets_failures_but_only_a_probe_re_admits() -> None:
    # A late 200 for a request routed before the ejection put the replica back on at once,
    # taking new requests while its /health still failed.
    s = FleetState(spec())
    s.record_failure(0, now=0.0)
    s.record_good_response(0)
    s.record_failure(0, now=0.0)
    s.record_failure(0, now=0.0)
    assert s.healthy[0]  # the count started over
    for _ in range(FAILURES_TO_EJECT):
        s.record_failure(1, now=100.0)
    s.record_good_response(1)
    assert not s.healthy[1] and s.failures[1] == FAILURES_TO_EJECT and s.retry_at[1] > 100.0
    s.record_success(1)  # its probe
    assert s.healthy[1] and s.failures[1] == 0


def test_probe_due() -> None:
    s = FleetState(spec())
    np.testing.assert_array_equal(s.probe_due(0.0), [True, True, True])
    for _ in range(FAILURES_TO_EJECT):
        s.record_failure(2, now=50.0)
    np.testing.assert_array_equal(s.probe_due(50.5), [True, True, False])
    np.testing.assert_array_equal(s.probe_due(51.0), [True, True, True])
    assert not s.healthy[2]  # due for a probe, but not routable until one succeeds


def test_every_replica_is_probed_while_the_only_healthy_ones_drain() -> None:
    # Draining replicas take no traffic, so an ejected one's backoff spares them nothing: the
    # first replica back is re-admitted within one probe interval, as with none healthy.
    s = FleetState(spec())
    s.draining[:] = [True, True, False]
    for _ in range(FAILURES_TO_EJECT):
        s.record_failure(2, now=50.0)
    np.testing.assert_array_equal(s.probe_due(50.5), [True, True, True])
    s.draining[1] = False  # one routable again: backoff as usual
    np.testing.assert_array_equal(s.probe_due(50.5), [True, True, False])


def test_set_weights_and_rates() -> None:
    s = FleetState(spec())
    v = s.version
    s.set_weights(Weights({"rtt": 0.5, "queue": 2.0}, version=7), {"c": 8000.0})
    assert s.weights.version == 7
    np.testing.assert_array_equal(s.prefill_rate, [1000.0, 2000.0, 8000.0])
    assert s.version > v
    s.set_weights(Weights())
    np.testing.assert_array_equal(s.prefill_rate, [1000.0, 2000.0, 8000.0])


def test_every_writer_bumps_version() -> None:
    s = FleetState(spec())
    f = prompt("abcdefgh", s)
    writers = [
        lambda: s.record_sent(0, f, 8),
        lambda: s.add_inflight(0, 1, 1),
        lambda: s.release_inflight(0, 1),
        lambda: s.observe_rtt(0, 1.0),
        lambda: s.observe_engine(0, 0.0, 0, 0, 0),
        lambda: s.set_weights(Weights()),
        lambda: s.record_success(0),
        lambda: s.record_failure(0, 0.0),
    ]
    for write in writers:
        before = s.version
        write()
        assert s.version > before


def test_matched_and_uncached_tokens() -> None:
    s = FleetState(spec())
    f = prompt("abcdefghij", s)  # 10 tokens, 2 full blocks
    np.testing.assert_array_equal(s.uncached_tokens(f), [10, 10, 10])
    s.record_sent(1, f, 10)
    np.testing.assert_array_equal(s.matched_blocks(f), [0, 2, 0])
    np.testing.assert_array_equal(s.uncached_tokens(f), [10, 2, 10])
    g = prompt("abcdXXXXXXXX", s)  # shares block 0 only
    np.testing.assert_array_equal(s.uncached_tokens(g), [12, 8, 12])


@pytest.mark.parametrize(("chars", "uncached"), [(16, 4), (15, 3), (17, 1), (4, 4), (1, 1)])
def test_a_prompt_cached_whole_still_prefills_its_last_block(chars: int, uncached: int) -> None:
    # Engines compute at least the last token: of a prompt cached whole they reuse the full
    # blocks before it (16 tokens in blocks of 4: 12 reused, 4 computed, as the engine does).
    s = FleetState(spec())
    f = prompt("a" * chars, s)
    s.record_sent(0, f, chars)
    assert s.uncached_tokens(f)[0] == uncached


def test_an_engine_restart_empties_the_approximate_view_of_its_cache() -> None:
    s = FleetState(spec())
    f = prompt("a" * 40, s)
    s.record_sent(0, f, 40)
    s.observe_engine(0, 0.0, 0, 1, 0.1, generated=5000.0, finished=10.0)
    s.observe_engine(0, 1.0, 0, 1, 0.1, generated=6000.0, finished=12.0)
    assert s.matched_blocks(f)[0] == 10  # counters going up: the same engine
    s.observe_engine(0, 2.0, 0, 0, 0.0, generated=30.0, finished=1.0)  # back near 0: restarted
    assert s.matched_blocks(f)[0] == 0 and s.uncached_tokens(f)[0] == 40


def test_record_sent_caches_prefix_and_counts_inflight() -> None:
    s = FleetState(spec())
    f = prompt("a" * 16, s)
    s.record_sent(0, f, 16)
    assert s.prefix.blocks_held(0) == 4
    assert s.inflight_reqs[0] == 1 and s.inflight_prompt_tokens[0] == 16
    assert s.backlog_tokens[0] == 16


def test_late_failures_of_an_ejected_replica_do_not_extend_its_backoff() -> None:
    from gorgo.core.fleet import parse_fleet as _parse
    from gorgo.core.state import FleetState as _State

    s = _State(_parse({"regions": {"a": None},
                       "replicas": [{"name": "x", "engine": "sim", "region": "a",
                                     "address": "127.0.0.1:1"}]}))
    for _ in range(3):
        s.record_failed_probe(0, now=0.0)
    assert not s.healthy[0]
    retry_at = s.retry_at[0]
    s.now = 0.0
    before = s.penalty()[0]
    s.record_failed_response(0, now=0.0)  # a stream routed before the ejection fails late
    assert s.retry_at[0] == retry_at  # backoff unchanged ...
    assert s.penalty()[0] > before  # ... but the failure is still priced
    s.record_failed_probe(0, now=retry_at)  # a failed re-probe does extend it
    assert s.retry_at[0] > retry_at


def test_the_live_router_bounds_the_index_whatever_the_policy_models() -> None:
    from gorgo.core.router import Router

    paper = dataclasses.replace(spec(), policy="gorgo-paper")
    assert Router(paper).state.prefix.capacity is None  # the simulator: the paper's trie
    assert Router(paper, unbounded_prefix=False).state.prefix.capacity is not None  # live


def test_the_engines_output_counters_teach_the_typical_output() -> None:
    s = FleetState(spec())
    s.observe_engine(2, 0.0, 0, 0, 0.1, generated=5000.0, finished=10.0)  # a baseline only
    assert s.outputs.typical() is None
    s.observe_engine(2, 1.0, 0, 0, 0.1, generated=5000.0 + 120.0 * 30, finished=40.0)
    assert s.outputs.typical() == pytest.approx(120.0)
    # an engine restart (counters back near 0) is a new baseline, never a negative increment
    s.observe_engine(2, 2.0, 0, 0, 0.1, generated=50.0, finished=1.0)
    assert s.outputs.typical() == pytest.approx(120.0)
    s.observe_engine(2, 3.0, 0, 0, 0.1, generated=50.0 + 120.0 * 10, finished=11.0)
    assert s.outputs.typical() == pytest.approx(120.0)
    # an engine that does not report them (NaN) changes nothing, and keeps the baseline
    s.observe_engine(2, 4.0, 0, 0, 0.1)
    assert s.eng_finished[2] == 11.0
    # replicas count apart: another engine's first scrape is its own baseline
    s.observe_engine(1, 4.0, 0, 0, 0.1, generated=1e6, finished=1.0)
    assert s.outputs.typical() == pytest.approx(120.0)
    # a fleet reload keeps what was learned, even when no replica is kept (discovery names
    # replicas by their addresses: a rollout replaces them all)
    assert s.reindexed(spec(), {"a": "a", "b": "b"}).outputs.typical() == pytest.approx(120.0)
    assert s.reindexed(spec(), {}).outputs.typical() == pytest.approx(120.0)


def test_an_increment_no_engine_could_generate_is_skipped() -> None:
    # One page of 9e18 tokens (a counter gone wild, a series listed twice) priced every request
    # at 10^16 tokens for some 23,000 requests.
    s = FleetState(spec())
    s.observe_engine(2, 0.0, 0, 0, 0.1, generated=0.0, finished=0.0)
    s.observe_engine(2, 1.0, 0, 0, 0.1, generated=200.0 * 50, finished=50.0)
    s.observe_engine(2, 2.0, 0, 4, 0.1, generated=9e18, finished=60.0)
    assert s.outputs.typical() == pytest.approx(200.0)
    # ... and the next sane page, lower, is a new baseline: nothing of the spike is learned
    s.observe_engine(2, 3.0, 0, 4, 0.1, generated=200.0 * 70, finished=70.0)
    s.observe_engine(2, 4.0, 0, 4, 0.1, generated=200.0 * 90, finished=90.0)
    assert s.outputs.typical() == pytest.approx(200.0)
    # the bound is the KV pool where it is smaller: replica a holds 40 tokens
    s.observe_engine(0, 5.0, 0, 0, 0.1, generated=0.0, finished=0.0)
    s.observe_engine(0, 6.0, 0, 0, 0.1, generated=41.0 * 10, finished=10.0)
    assert s.outputs.typical() == pytest.approx(200.0)
    # requests still running count: tokens of requests not yet finished are possible
    s.observe_engine(2, 7.0, 0, 3, 0.1, generated=200.0 * 90 + 5000.0, finished=90.0)
    assert s.eng_generated[2] == 200.0 * 90 + 5000.0


def test_routed_bounds_are_counted_once_per_request() -> None:
    s = FleetState(spec())
    f = extract_features("/v1/completions", {},
                         json.dumps({"prompt": "x" * 40, "max_tokens": 64}).encode(), s.tok)
    s.record_sent(0, f, 40)
    s.book(1, f.block_hashes, f.prompt_tokens, 40, arrival=False)  # a retry's move: no new bound
    assert s.outputs.of(0).bound_n == pytest.approx(1.0)
    assert s.outputs.of(0).bound_sum == pytest.approx(64.0)


def test_each_models_replicas_teach_that_models_output_and_a_reload_keeps_it() -> None:
    doc = {
        "regions": {"us-east": {}},
        "replicas": [
            {"name": n, "engine": "sim", "region": "us-east", "address": f"h:{k + 1}",
             "models": [m]}
            for k, (n, m) in enumerate([("a", "long"), ("b", "short"), ("c", "long")])],
    }
    s = FleetState(parse_fleet(doc))
    for i, tokens in ((0, 900.0), (1, 50.0), (2, 1100.0)):
        s.observe_engine(i, 0.0, 0, 0, 0.1, generated=0.0, finished=0.0)
        s.observe_engine(i, 1.0, 0, 0, 0.1, generated=tokens * 40, finished=40.0)
    np.testing.assert_allclose(s.outputs.typical(), [1000.0, 50.0, 1000.0], rtol=0.01)
    # c removed, d of a third model added: "long" keeps what it learned, d starts with nothing
    doc["replicas"][2] = {"name": "d", "engine": "sim", "region": "us-east", "address": "h:9",
                          "models": ["other"]}
    new = s.reindexed(parse_fleet(doc), {"a": "a", "b": "b"})
    typical = new.outputs.typical()
    np.testing.assert_allclose(typical[:2], [1000.0, 50.0], rtol=0.01)
    assert math.isnan(typical[2])
    # b now serves "long" and d "short": each model's estimate follows its name, not the replica
    doc["replicas"][1]["models"], doc["replicas"][2]["models"] = ["long"], ["short"]
    moved = new.reindexed(parse_fleet(doc), {"a": "a", "b": "b", "d": "d"}).outputs.typical()
    np.testing.assert_allclose(moved, [1000.0, 1000.0, 50.0], rtol=0.01)
