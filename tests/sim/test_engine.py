import math
from dataclasses import replace

import numpy as np
import pytest

from gorgo.core.tokens import Tokenization
from gorgo.sim.engine import Engine, EngineRejected, EngineRequest, StepResult, idle_latencies
from gorgo.sim.profiles import PROFILES, EngineProfile, describe, get_profile

TOK = Tokenization(chars_per_token=4.0, block_tokens=16)
BT = TOK.block_tokens
TINY = PROFILES["tiny-test"]


def prof(**changes) -> EngineProfile:
    return replace(TINY, **changes)


def hashes(n_tokens: int, family: int, shared: int | None = None) -> np.ndarray:
    """Block hashes of a prompt; prompts of one family share their first ``shared`` blocks."""
    n = n_tokens // BT
    h = np.arange(n, dtype=np.uint64) + np.uint64(family * 1_000_000)
    if shared is not None:
        h[shared:] += np.uint64(500_000)
    return h


def req(rid, n, family=0, max_tokens=4, arrival=0.0, shared=None) -> EngineRequest:
    return EngineRequest(rid, n, hashes(n, family, shared), max_tokens, arrival)


def run(engine: Engine, t: float = 0.0) -> list[StepResult]:
    out = []
    while engine.has_work():
        res = engine.step(t)
        out.append(res)
        t = res.end
    return out


def ttft_of(results: list[StepResult], rid, start: float = 0.0) -> float:
    for res in results:
        if any(f.rid == rid for f in res.first_tokens):
            return res.first_end - start
    raise AssertionError(f"no first token for {rid}")


def test_profiles_exist_and_validate():
    for name in ("h100-llama3-8b", "2xl40s-qwen3.5-35b-a3b-fp8", "tiny-test"):
        assert get_profile(name).name == name
    with pytest.raises(ValueError, match="unknown engine profile"):
        get_profile("nope")
    with pytest.raises(ValueError):
        replace(TINY, max_running=0)


def test_step_times_follow_the_profile_formula():
    p = prof(prefill_chunk_tokens=1024)
    eng = Engine(p, TOK)
    eng.submit(req("a", 100, max_tokens=3), 0.0)
    results = run(eng)
    assert [r.duration for r in results] == pytest.approx(
        [p.step_time_s(100, 0, 100), p.step_time_s(0, 1, 101), p.step_time_s(0, 1, 102)],
        rel=1e-12,
    )
    assert p.step_time_s(10, 2, 3000) == pytest.approx(
        (p.c0_ms + 10 * p.c_prefill_ms_per_token + 2 * p.c_decode_ms_per_seq
         + 3 * p.c_attn_ms_per_ktoken) / 1000
    )
    assert [r.tokens for r in results] == [1, 1, 1]
    assert results[-1].finished[0].completion_tokens == 3
    assert results[-1].finished[0].reason == "length"


def test_speed_divides_step_time():
    p = prof(prefill_chunk_tokens=1024)
    slow, fast = Engine(p, TOK), Engine(p, TOK, speed=2.0)
    for eng in (slow, fast):
        eng.submit(req("a", 300), 0.0)
    d_slow = [r.duration for r in run(slow)]
    d_fast = [r.duration for r in run(fast)]
    assert d_fast == pytest.approx([d / 2 for d in d_slow])


def test_prefix_hit_lowers_ttft_by_exactly_the_cached_prefill_time():
    p = prof(prefill_chunk_tokens=1024)
    eng = Engine(p, TOK)
    eng.submit(req("cold", 200, family=1), 0.0)
    cold = run(eng)
    t = cold[-1].end
    eng.submit(req("warm", 200, family=1, arrival=t), t)
    warm = run(eng, t)
    first = warm[0].first_tokens[0]
    assert first.cached_tokens == 12 * BT  # 12 full blocks of 200 tokens
    saved = ttft_of(cold, "cold") - ttft_of(warm, "warm", t)
    assert saved == pytest.approx(p.c_prefill_ms_per_token * first.cached_tokens / 1000, rel=1e-9)

    t = warm[-1].end
    eng.submit(req("partial", 200, family=1, shared=5, arrival=t), t)
    partial = run(eng, t)
    assert partial[0].first_tokens[0].cached_tokens == 5 * BT


def test_fully_cached_prompt_recomputes_its_last_block():
    eng = Engine(prof(prefill_chunk_tokens=1024), TOK)
    eng.submit(req("a", 4 * BT, family=2), 0.0)
    t = run(eng)[-1].end
    eng.submit(req("b", 4 * BT, family=2), t)
    res = eng.step(t)
    assert res.first_tokens[0].cached_tokens == 3 * BT
    assert res.prefill_tokens == BT


def test_chunked_prefill_splits_a_long_prompt():
    p = prof(prefill_chunk_tokens=256)
    eng = Engine(p, TOK)
    eng.submit(req("long", 1000, max_tokens=1), 0.0)
    results = run(eng)
    assert [r.prefill_tokens for r in results] == [256, 256, 256, 232]
    assert [len(r.first_tokens) for r in results] == [0, 0, 0, 1]
    assert [r.duration for r in results] == pytest.approx(
        [p.step_time_s(n, 0, done) for n, done in ((256, 256), (256, 512), (256, 768),
                                                    (232, 1000))]
    )
    assert results[-1].finished[0].rid == "long"


def test_chunk_budget_is_shared_first_come_first_served():
    eng = Engine(prof(prefill_chunk_tokens=256), TOK)
    eng.submit(req("a", 200, family=1), 0.0)
    eng.submit(req("b", 200, family=2), 0.0)
    s1 = eng.step(0.0)
    assert s1.prefill_tokens == 256 and [f.rid for f in s1.first_tokens] == ["a"]
    s2 = eng.step(s1.end)
    assert s2.prefill_tokens == 144
    assert [f.rid for f in s2.first_tokens] == ["b"]
    assert s2.decoded == ["a", "b"]  # a decodes while b's prefill finishes


def test_itl_grows_with_running_requests():
    p = prof(prefill_chunk_tokens=1024, max_running=4)

    def decode_step(n: int) -> float:
        eng = Engine(p, TOK)
        for i in range(n):
            eng.submit(req(i, 100, family=i, max_tokens=8), 0.0)
        first = eng.step(0.0)
        assert len(first.first_tokens) == n
        return eng.step(first.end).duration

    alone, four = decode_step(1), decode_step(4)
    assert four > alone
    extra = 3 * p.c_decode_ms_per_seq + p.c_attn_ms_per_ktoken * 3 * 101 / 1000
    assert four - alone == pytest.approx(extra / 1000)


@pytest.mark.parametrize("fold", [1, 10_000])
def test_inter_token_latency_counts_every_gap_after_a_first_token(fold: int):
    """The engine's ITL histogram (sum, count) is what its requests' token gaps add up to,
    stepped one at a time or folded."""
    eng = Engine(prof(prefill_chunk_tokens=1024, max_running=4), TOK)
    for i, mt in enumerate((6, 9, 9)):
        eng.submit(req(i, 100, family=i, max_tokens=mt), 0.0)
    t, first, done = 0.0, {}, {}
    while eng.has_work():
        res = eng.step(t, max_decode_steps=fold)
        first.update({f.rid: res.first_end for f in res.first_tokens})
        done.update({f.rid: res.end for f in res.finished})
        t = res.end
    m = eng.metrics()
    assert m.itl_count == (6 - 1) + (9 - 1) + (9 - 1)
    assert m.itl_sum_s == pytest.approx(sum(done[r] - first[r] for r in done))


def test_max_running_limits_admission():
    eng = Engine(prof(prefill_chunk_tokens=1024, max_running=2), TOK)
    for i, mt in enumerate((2, 5, 5)):
        eng.submit(req(i, 50, family=i, max_tokens=mt), 0.0)
    s1 = eng.step(0.0)
    assert [f.rid for f in s1.first_tokens] == [0, 1]
    m = eng.metrics()
    assert (m.num_running, m.num_waiting, m.waiting_prompt_tokens) == (2, 1, 50)
    s2 = eng.step(s1.end)
    assert [f.rid for f in s2.finished] == [0]
    s3 = eng.step(s2.end)
    assert [f.rid for f in s3.first_tokens] == [2]


def test_request_larger_than_kv_capacity_is_rejected_and_engine_stays_usable():
    eng = Engine(TINY, TOK)
    with pytest.raises(EngineRejected) as err:
        eng.submit(req("huge", TINY.kv_capacity_tokens - 10, max_tokens=11), 0.0)
    assert err.value.status == 400
    assert "KV cache" in err.value.reason
    with pytest.raises(EngineRejected) as err:
        eng.submit(req("empty", 0), 0.0)
    assert err.value.status == 400
    assert not eng.has_work()
    eng.submit(req("ok", 100, max_tokens=2), 0.0)
    results = run(eng)
    assert results[-1].finished[0].rid == "ok"
    assert eng.metrics().requests_rejected == 2
    with pytest.raises(ValueError, match="duplicate"):
        eng.submit(req("x", 10), 0.0)
        eng.submit(req("x", 10), 0.0)


def test_full_waiting_queue_is_refused_with_503():
    eng = Engine(TINY, TOK)
    for i in range(TINY.max_queue):
        eng.submit(req(i, 30, family=i), 0.0)
    with pytest.raises(EngineRejected) as err:
        eng.submit(req("one-too-many", 30), 0.0)
    assert err.value.status == 503
    eng.step(0.0)  # admission drains the queue
    eng.submit(req("later", 30, family=9), 0.0)
    run(eng)
    assert eng.metrics().requests_finished == TINY.max_queue + 1


def test_eviction_under_pressure_is_lru_over_unreferenced_blocks():
    eng = Engine(prof(kv_capacity_tokens=1024, prefill_chunk_tokens=1024), TOK)
    t = 0.0
    for rid, fam in (("a", 1), ("b", 2)):
        eng.submit(req(rid, 400, family=fam, max_tokens=1), t)
        t = run(eng, t)[-1].end
    assert eng.cache.match(hashes(400, 1).tolist()) == 25
    # c needs 300 + 8 tokens; 224 are free, so 6 of a's blocks (least recently used) must go.
    eng.submit(req("c", 300, family=3, max_tokens=8), t)
    t = run(eng, t)[-1].end
    assert eng.cache.match(hashes(400, 1).tolist()) < 25
    assert eng.cache.match(hashes(400, 2).tolist()) == 25
    assert eng.cache.evicted_blocks == 6


def test_blocks_of_running_requests_are_never_evicted():
    eng = Engine(prof(kv_capacity_tokens=1024, prefill_chunk_tokens=1024), TOK)
    eng.submit(req("holder", 600, family=1, max_tokens=20), 0.0)
    s = eng.step(0.0)
    eng.submit(req("big", 500, family=2, max_tokens=4), s.end)
    t = s.end
    while eng.has_work():
        res = eng.step(t)
        if "holder" in eng:
            assert eng.cache.match(hashes(600, 1).tolist()) == 37
            assert not res.first_tokens  # big waits: it cannot fit next to holder
        t = res.end
        if any(f.rid == "holder" for f in res.finished):
            nxt = eng.step(t)
            assert [f.rid for f in nxt.first_tokens] == ["big"]
            t = nxt.end
    assert eng.metrics().requests_finished == 2


def test_cancel_frees_what_the_request_holds():
    eng = Engine(prof(prefill_chunk_tokens=64), TOK)
    eng.submit(req("a", 300, family=1, max_tokens=10), 0.0)
    eng.submit(req("b", 100, family=2), 0.0)
    res = eng.step(0.0)  # a is half prefilled, b still waits (chunk budget used up)
    assert eng.metrics().pending_prefill_tokens == 300 - 64
    assert eng.cancel("a") and eng.cancel("b")
    assert not eng.cancel("a")
    assert not eng.has_work()
    m = eng.metrics()
    assert (m.num_running, m.num_waiting, m.kv_usage, m.pending_prefill_tokens) == (0, 0, 0, 0)
    assert eng.cache.pinned_tokens == 0
    assert eng.cache.match(hashes(300, 1).tolist()) == 4  # the computed chunk stays cached
    assert m.requests_cancelled == 2
    eng.submit(req("c", 100, family=3, max_tokens=3), res.end)
    eng.step(res.end)
    eng.cancel("c")  # a decoding request
    assert eng.metrics().kv_usage == 0 and not eng.has_work()


def test_identical_prompts_running_together_share_their_blocks():
    eng = Engine(prof(prefill_chunk_tokens=1024), TOK)
    eng.submit(req("x", 320, family=4, max_tokens=2), 0.0)
    eng.submit(req("y", 320, family=4, max_tokens=2), 0.0)
    run(eng)
    assert eng.cache.used_tokens == 320  # 20 blocks, not 40
    assert eng.cache.pinned_tokens == 0


def test_space_freed_by_sharing_a_block_admits_the_waiting_head():
    """Two requests computing the same prompt hold two private copies until their blocks land;
    the second copy is then freed, and the head that did not fit is admitted in the next step
    (it used to wait for a release: here until x and y finished)."""
    eng = Engine(prof(kv_capacity_tokens=1024, prefill_chunk_tokens=1024), TOK)
    eng.submit(req("x", 320, family=4, max_tokens=20), 0.0)
    eng.submit(req("y", 320, family=4, max_tokens=20), 0.0)
    eng.submit(req("z", 400, family=5, max_tokens=4), 0.0)  # 404 > 1024 - 2 * 340: waits
    first = eng.step(0.0)
    assert [f.rid for f in first.first_tokens] == ["x", "y"]
    assert eng.metrics().num_waiting == 1
    second = eng.step(first.end)  # 320 + 2 * 20 tokens held now: z fits
    assert [f.rid for f in second.first_tokens] == ["z"]


def simulate(engine: Engine, reqs: list[EngineRequest], ff: int) -> tuple[dict, int]:
    """Per request [first token time, cached tokens, finish time, tokens]; and step() calls."""
    out: dict = {}
    t, i, calls = 0.0, 0, 0
    while i < len(reqs) or engine.has_work():
        if not engine.has_work():
            t = max(t, reqs[i].arrival)
        while i < len(reqs) and reqs[i].arrival <= t:
            engine.submit(reqs[i], t)
            i += 1
        horizon = reqs[i].arrival if i < len(reqs) else math.inf
        res = engine.step(t, max_decode_steps=ff, horizon=horizon)
        calls += 1
        assert res.steps >= 1
        for f in res.first_tokens:
            out[f.rid] = [res.first_end, f.cached_tokens, None, 0]
        for rid in res.decoded:
            out[rid][3] += res.steps
        for f in res.finished:
            out[f.rid][2] = res.end
            assert f.completion_tokens == out[f.rid][3]
        assert engine.cache.used_tokens <= engine.cache.capacity_tokens
        t = res.end
    return out, calls


def workload(seed: int, n: int = 120) -> list[EngineRequest]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(0.004, n))
    reqs = []
    for i in range(n):
        size = int(rng.integers(20, 700))
        fam = int(rng.integers(0, 6))
        reqs.append(req(i, size, family=fam, shared=int(rng.integers(0, 40)),
                        max_tokens=int(rng.integers(1, 60)), arrival=float(arrivals[i])))
    return reqs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fast_forward_gives_the_same_results_as_single_steps(seed):
    p = prof(kv_capacity_tokens=4096, max_running=8, max_queue=1000)
    single, folded = Engine(p, TOK), Engine(p, TOK)
    a, calls_a = simulate(single, workload(seed), ff=1)
    b, calls_b = simulate(folded, workload(seed), ff=10_000)
    assert a == b
    assert calls_b < calls_a / 2
    ma, mb = single.metrics(), folded.metrics()
    assert mb.steps_total == ma.steps_total
    assert mb.busy_time_s == pytest.approx(ma.busy_time_s)
    assert (mb.generated_tokens_total, mb.cached_tokens_total) == (
        ma.generated_tokens_total, ma.cached_tokens_total)


def test_totals_and_an_idle_engine_holds_nothing():
    p = prof(kv_capacity_tokens=4096, max_running=8, max_queue=1000)
    eng = Engine(p, TOK)
    reqs = workload(7)
    out, _ = simulate(eng, reqs, ff=50)
    m = eng.metrics()
    assert m.requests_finished == len(reqs)
    assert m.generated_tokens_total == sum(r.max_tokens for r in reqs)
    assert m.prompt_tokens_total == sum(r.prompt_tokens for r in reqs)
    assert m.cached_tokens_total == sum(v[1] for v in out.values()) > 0
    assert (m.num_running, m.num_waiting, m.pending_prefill_tokens) == (0, 0, 0)
    assert m.kv_usage == 0 and eng.cache.pinned_tokens == 0
    assert all(v[2] >= v[0] for v in out.values())


def test_describe_reports_the_model_it_drives():
    p = PROFILES["h100-llama3-8b"]
    rows = {r.prompt_tokens: r for r in describe(p, tokenization=Tokenization())}
    assert set(rows) == {1024, 8192, 32768}
    assert rows[1024].ttft_ms == pytest.approx(p.step_time_s(1024, 0, 1024) * 1000)
    assert rows[1024].itl_ms == pytest.approx(p.step_time_s(0, 1, 1025) * 1000)
    assert rows[8192].ttft_half_cached_ms == pytest.approx(
        rows[8192].ttft_ms - p.c_prefill_ms_per_token * 4096)
    assert rows[32768].ttft_ms > 4 * rows[8192].ttft_ms * 0.99
    assert rows[8192].itl_batch_ms > rows[8192].itl_ms
    # Larger than the tiny profile's KV cache: left out rather than made up.
    assert [r.prompt_tokens for r in describe(TINY)] == [1024]
    ttft, itl = idle_latencies(TINY, TOK, 100)
    assert ttft == pytest.approx(TINY.step_time_s(100, 0, 100))
    assert itl == pytest.approx(TINY.step_time_s(0, 1, 101))


def test_cached_prefix_tokens_previews_admission():
    eng = Engine(prof(prefill_chunk_tokens=1024), TOK)
    h = hashes(4 * BT, family=5)
    assert eng.cached_prefix_tokens(h) == 0
    eng.submit(EngineRequest("a", 4 * BT, h, 1, 0.0), 0.0)
    run(eng)
    assert eng.cached_prefix_tokens(h) == 4 * BT
    assert eng.cached_prefix_tokens(h, prompt_tokens=4 * BT) == 3 * BT
    assert eng.cached_prefix_tokens(list(h[:2])) == 2 * BT


def test_clone_evolves_alone_and_exactly_as_the_original():
    # A lookahead rolls a clone forward and throws it away (sim.lookahead): the original must not
    # move, and the clone must step exactly as the original would.
    eng = Engine(prof(max_running=4, max_queue=16, kv_capacity_tokens=40 * BT), TOK,
                 kv_events=True)
    for k in range(6):
        eng.submit(req(k, 5 * BT, family=k % 2, shared=2, max_tokens=6), 0.0)
    t = eng.step(0.0).end
    before = eng.metrics()
    events = eng.take_kv_events()
    twin = eng.clone()
    assert twin.metrics() == before
    twin.submit(req("extra", 8 * BT, family=3), t)
    rolled = run(twin, t)
    assert eng.metrics() == before and eng.take_kv_events() == [] and twin.take_kv_events() == []
    assert not twin.has_work() and eng.has_work() and "extra" not in eng
    fresh = eng.clone()
    eng.submit(req("extra", 8 * BT, family=3), t)
    assert [astuple_step(r) for r in run(eng, t)] == [astuple_step(r) for r in rolled]
    assert eng.metrics() == twin.metrics() and fresh.metrics() == before
    assert events  # the original logs KV events; clones never do


def astuple_step(r: StepResult) -> tuple:
    return (r.start, r.end, r.first_end, r.steps, r.prefill_tokens, r.first_tokens, r.decoded,
            r.finished)


def test_a_waiting_head_whose_prompt_gets_cached_is_admitted_at_once() -> None:
    # B waits for KV space behind A, which prefills the same prompt: once A's blocks are cached
    # B needs its last block and its output only, which fit; it waited for A's end (243 ms).
    tok = Tokenization(chars_per_token=4.0, block_tokens=16)
    profile = replace(PROFILES["tiny-test"], kv_capacity_tokens=1024, prefill_chunk_tokens=512)
    hashes = np.arange(40, dtype=np.uint64) + np.uint64(7)  # a 640-token prompt
    eng = Engine(profile, tok)
    eng.submit(EngineRequest("A", 640, hashes, 200, 0.0), 0.0)
    eng.submit(EngineRequest("B", 640, hashes, 100, 0.0), 0.0)
    first: dict[str, float] = {}
    t = 0.0
    while eng.has_work():
        res = eng.step(t)
        first.update((f.rid, res.first_end) for f in res.first_tokens)
        t = res.end
    assert first["B"] < 0.05 < first["A"] + 0.1 < t


def test_kv_usage_counts_the_prompt_as_it_is_prefilled() -> None:
    # The engines allocate KV a chunk at a time: a 32k prompt after one 8k chunk holds 8k.
    profile, tok = PROFILES["h100-llama3-8b"], Tokenization()
    n = 32768
    eng = Engine(profile, tok)
    eng.submit(EngineRequest("a", n, np.arange(1, n // tok.block_tokens + 1, dtype=np.uint64),
                             100, 0.0), 0.0)
    eng.step(0.0)
    m = eng.metrics()
    computed = n - m.pending_prefill_tokens
    assert 0 < computed < n
    assert m.kv_usage * profile.kv_capacity_tokens == pytest.approx(computed)
