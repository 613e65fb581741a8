"""Booked work follows reality (issue 12, finding 3).

A routed request's uncached prompt is booked as queued prefill on its replica. Booking used to
drain only at the prefill rate whatever happened to the request, so prompts an engine refused at
once (too long for its KV cache, an absurd ``max_tokens``) left tens of seconds of phantom queue.
Now booked work never exceeds the prompts of the requests still open, an idle engine's scrape cuts
it, and a request no replica can hold is refused before anything is booked.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from gorgo.core.decision import TOO_LARGE, Decision, Rejection
from gorgo.core.features import RequestFeatures, extract_features
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.router import Router


def spec(**extra: object) -> FleetSpec:
    return parse_fleet({
        "regions": {"local": {}},
        "block_tokens": 4,
        "chars_per_token": 1.0,
        "replicas": [
            {"name": f"r{i}", "engine": "sim", "region": "local", "address": f"h:{i + 1}",
             "prefill_rate": 1000, "kv_capacity_tokens": 100_000}
            for i in range(3)
        ],
        **extra,
    })


def req(r: Router, tokens: int, seed: str = "a", **body: object) -> RequestFeatures:
    raw = json.dumps({"prompt": (seed * tokens)[:tokens], **body}).encode()
    return extract_features("/v1/completions", {}, raw, r.state.tok)


def route(r: Router, f: RequestFeatures, now: float = 0.0) -> Decision:
    d = r.route(f, now)
    assert isinstance(d, Decision), d
    return d


def test_a_closed_request_leaves_no_queue_behind() -> None:
    """The engine refused a 50k-token prompt in a moment: 50 s of queue at 1000 tokens/s, gone
    when its stream closes instead of draining for 50 s."""
    r = Router(spec())
    big = route(r, req(r, 50_000, "b"))
    s = r.state
    s.now = 0.4
    assert s.waiting_tokens()[big.replica] == pytest.approx(50_000 - 400)
    r.complete(big.id)
    assert s.waiting_tokens()[big.replica] == 0
    assert s.inflight_uncached.sum() == 0
    # The next request is priced on what is really queued: the refused prompt counts for nothing.
    d = route(r, req(r, 100, "c"), now=0.4)
    assert d.terms["queue"] == 0


def test_only_the_closed_requests_share_is_released() -> None:
    r = Router(spec(replicas=[{"name": "x", "engine": "sim", "region": "local",
                               "address": "h:1", "prefill_rate": 1000}]))
    a = route(r, req(r, 2000, "a"))
    b = route(r, req(r, 3000, "b"))
    s = r.state
    assert s.waiting_tokens()[0] == pytest.approx(5000)
    r.complete(b.id)  # refused: its 3000 tokens wait for nothing
    assert s.waiting_tokens()[0] == pytest.approx(2000)
    s.now = 1.0
    assert s.waiting_tokens()[0] == pytest.approx(1000)  # the rest drains as before
    r.complete(a.id)
    assert s.waiting_tokens()[0] == 0


def test_a_retry_moves_the_booking_with_the_request() -> None:
    r = Router(spec())
    d = route(r, req(r, 1000))
    other = (d.replica + 1) % 3
    assert r.reassign(d.id, other)
    s = r.state
    assert s.waiting_tokens()[d.replica] == 0
    assert s.waiting_tokens()[other] == pytest.approx(1000)
    r.complete(d.id)
    assert s.inflight_uncached.sum() == 0 and s.waiting_tokens().sum() == 0


def test_an_idle_engine_owes_only_what_was_sent_after_it_was_read() -> None:
    r = Router(spec())
    s = r.state
    s.add_inflight(0, 40_000, 40_000)  # a stream the engine dropped but that is still open
    s.observe_engine(0, 0.0, queue_reqs=0, running_reqs=0, kv_usage=0.0)
    assert s.waiting_tokens()[0] == pytest.approx(40_000)  # sent since the previous scrape
    s.observe_engine(0, 1.0, queue_reqs=0, running_reqs=0, kv_usage=0.0)
    assert s.waiting_tokens()[0] == 0  # idle twice: nothing is waiting
    s.add_inflight(0, 300, 300)  # sent after that scrape: booked again
    assert s.waiting_tokens()[0] == pytest.approx(300)


def test_a_busy_engine_keeps_the_booking() -> None:
    r = Router(spec())
    s = r.state
    s.add_inflight(0, 40_000, 40_000)
    for t in (0.0, 1.0):
        s.observe_engine(0, t, queue_reqs=0, running_reqs=1, kv_usage=0.5)  # prefilling it
    assert s.waiting_tokens()[0] == pytest.approx(40_000)


def test_a_request_no_replica_can_hold_is_400_and_books_nothing() -> None:
    r = Router(spec())
    before = r.state.version
    for f in (req(r, 100_001, "p"), req(r, 90_000, "q", max_tokens=10_001)):
        d = r.route(f, 0.0)
        assert isinstance(d, Rejection)
        assert (d.status, d.reason) == (400, TOO_LARGE)
        assert "the largest replica holds 100000" in d.message
    s = r.state
    assert r.open_requests == 0 and s.inflight_reqs.sum() == 0 and s.waiting_tokens().sum() == 0
    assert s.prefix.sizes().sum() == 0 and s.version == before  # no state was touched
    d = route(r, req(r, 90_000, "q", max_tokens=10_000))  # exactly what a replica holds
    assert d.prompt_tokens == 90_000


def test_capacity_is_the_largest_replicas() -> None:
    doc_replicas = [
        {"name": "small", "engine": "sim", "region": "local", "address": "h:1",
         "kv_capacity_tokens": 1000},
        {"name": "large", "engine": "sim", "region": "local", "address": "h:2",
         "kv_capacity_tokens": 5000},
    ]
    r = Router(spec(replicas=doc_replicas))
    assert r.max_request_tokens == 5000
    assert isinstance(r.route(req(r, 5001), 0.0), Rejection)
    # A request goes only where it fits, under every policy: a replica too small for it was
    # chosen whenever a larger one existed, and its engine refused it.
    r = Router(spec(replicas=doc_replicas, allow_policy_override=True))
    for policy in r.policies:
        for k in range(4):
            f = dataclasses.replace(req(r, 4000, f"{policy}-{k}"), policy=policy)
            d = r.route(f, 0.0)
            assert isinstance(d, Decision) and r.state.names[d.replica] == "large", policy
            r.complete(d.id)


def test_a_sequence_not_the_whole_request_must_fit_a_kv_pool() -> None:
    """An engine schedules a request's `n` sequences (and a completions batch's prompts) as its
    pool frees: one of them must fit, not all at once (RL rollouts ask n = 16 x 16k tokens of a
    200k-token pool), and a batch is judged by its longest prompt, not by their sum."""
    doc_replicas = [
        {"name": "small", "engine": "sim", "region": "local", "address": "h:1",
         "kv_capacity_tokens": 1000},
        {"name": "large", "engine": "sim", "region": "local", "address": "h:2",
         "kv_capacity_tokens": 5000},
    ]
    r = Router(spec(replicas=doc_replicas, policy="round-robin"))
    served = set()
    for k in range(4):  # 200 + 250 tokens a sequence: both replicas hold one
        f = req(r, 200, f"n{k}", max_tokens=250, n=16)
        assert f.choices == 16 and f.sequence_prompt_tokens == 200
        d = route(r, f)
        served.add(r.state.names[d.replica])
        r.complete(d.id)
    assert served == {"small", "large"}
    batch = extract_features("/v1/completions", {}, json.dumps(
        {"prompt": ["a" * 900, "b" * 3000, "c" * 900], "max_tokens": 100, "n": 2}).encode(),
        r.state.tok)
    assert (batch.prompt_tokens, batch.sequence_prompt_tokens, batch.choices) == (4800, 3000, 6)
    assert r.state.names[route(r, batch).replica] == "large"  # 3100: only large holds it
    d = r.route(dataclasses.replace(batch, max_tokens=2001), 0.0)
    assert isinstance(d, Rejection) and d.status == 400
    assert "needs 5001 tokens (3000 in its longest prompt, 2001 for the completion)" in d.message


def test_every_sequence_is_booked_in_flight_until_the_request_ends() -> None:
    """The engines count each of `n` sequences as a running request: booked as one, the other
    63 of an n = 64 request were invisible until the next scrape."""
    r = Router(spec())
    d = route(r, req(r, 100, "n", max_tokens=10, n=64))
    s = r.state
    i = d.replica
    # the decode batch and its context: 64 sequences over the prompt each; the request counts
    # once for the policies that imitate routers which count requests
    assert (s.inflight_seqs[i], s.inflight_context[i]) == (64, 6400)
    assert (s.inflight_reqs[i], s.inflight_prompt_tokens[i]) == (1, 100)
    other = (i + 1) % 3
    assert r.reassign(d.id, other)  # a retry moves all of it
    assert s.inflight_seqs[i] == 0 and s.inflight_seqs[other] == 64
    r.complete(d.id)
    for booked in (s.inflight_reqs, s.inflight_prompt_tokens, s.inflight_seqs,
                   s.inflight_context):
        assert booked.sum() == 0


def test_many_refused_prompts_do_not_accumulate() -> None:
    """Forty 28k-token prompts the engines refused (finding 3: about 10 s of phantom queue
    each): once their streams close, the fleet is priced as idle."""
    r = Router(spec())
    for k in range(40):
        d = route(r, req(r, 28_000, chr(65 + k % 26) + str(k)), now=0.01 * k)
        r.complete(d.id)
    np.testing.assert_array_equal(r.state.waiting_tokens(), [0, 0, 0])
