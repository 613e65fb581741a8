"""The precise cache view: fleet settings, and what every policy sees through matched_blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gorgo.core.decision import Decision
from gorgo.core.features import extract_features, prompt_text
from gorgo.core.fleet import PRECISE, FleetError, parse_fleet
from gorgo.core.kv_events import CLEARED, REMOVED, STORED, KVEvent
from gorgo.core.precise import CLOSED_HOLD_S
from gorgo.core.router import Router
from gorgo.sim.kv_publish import SimHashing

BT = 64


def fleet(**extra: object) -> dict:
    replicas = [{"name": f"r{i}", "region": "a", "address": f"127.0.0.1:{9000 + i}",
                 "engine": "vllm", "cache": "precise", "tokenizer": "sim", **extra}
                for i in range(2)]
    return {"regions": {"a": None}, "replicas": replicas, "block_tokens": BT}


def replica_error(**fields: object) -> str:
    """The error of the fleet whose first replica has ``fields`` changed (None: removed)."""
    raw = fleet()
    replica = raw["replicas"][0]
    for k, v in fields.items():
        if v is None:
            replica.pop(k)
        else:
            replica[k] = v
    with pytest.raises(FleetError) as err:
        parse_fleet(raw)
    return str(err.value)


def test_fleet_settings() -> None:
    spec = parse_fleet(fleet(hash_seed="", kv_events={"endpoint": "tcp://127.0.0.1:5557",
                                                       "replay_endpoint": "ipc:///tmp/r"}))
    r = spec.replicas[0]
    assert r.cache == PRECISE and r.precise is not None
    assert r.precise.hash_seed == "" and r.precise.kv_events.replay_endpoint == "ipc:///tmp/r"
    plain = parse_fleet({"regions": {"a": None}, "replicas": [
        {"name": "x", "region": "a", "address": "127.0.0.1:1", "engine": "vllm"}]})
    assert plain.replicas[0].cache == "approximate" and plain.replicas[0].precise is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"cache": "exact"}, "replicas[0].cache: must be one of approximate, precise"),
    ({"tokenizer": None}, "replicas[0].tokenizer: required"),
    ({"engine": "sglang"}, "replicas[0].cache: precise needs vLLM's KV events"),
    ({"hash_seed": 5}, "replicas[0].hash_seed: expected a string"),
    ({"kv_events": {"endpoint": "http://x"}}, "replicas[0].kv_events.endpoint: expected a ZMQ"),
    ({"kv_events": {"endpoint": "tcp://h:1", "hwm": 3}}, "replicas[0].kv_events.hwm: unknown"),
    ({"cache": "approximate"}, "replicas[0].tokenizer: only allowed with cache: precise"),
])
def test_fleet_errors(fields: dict, message: str) -> None:
    assert message in replica_error(**fields)


def test_sim_engine_needs_vllm_flavor() -> None:
    assert "sim.flavor: vllm" in replica_error(engine="sim", sim={"flavor": "sglang"})


ROUTER = Router(parse_fleet(fleet()))


def request(text: str):
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    return extract_features("/v1/chat/completions", {}, json.dumps(body).encode(),
                            ROUTER.state.tok), body


def engine_hashes(body: dict) -> list[int]:
    _, hashes = SimHashing(ROUTER.state.tok).blocks(prompt_text("chat", body))
    return [int(h) for h in hashes]


def fresh() -> Router:
    return Router(parse_fleet(fleet()))


def test_live_only_once_synced_and_configured() -> None:
    router = fresh()
    s = router.state
    f, body = request("word " * 2000)
    hashes = engine_hashes(body)
    s.apply_kv_events(1, [KVEvent(STORED, tuple(hashes[:20]), None, (), BT)])
    assert s.matched_blocks(f).tolist() == [0, 0]  # not synced yet: the approximate view
    s.set_kv_synced(1, True)
    assert s.matched_blocks(f).tolist() == [0, 0]  # block size known (the event), algo not yet
    s.observe_cache_config(1, BT, 10_000, "xxhash")
    assert s.matched_blocks(f).tolist() == [0, 0]  # an algorithm it cannot reproduce
    s.observe_cache_config(1, BT, 10_000, "sha256_cbor")
    assert s.matched_blocks(f).tolist() == [0, 20]


def test_removed_and_cleared_are_seen() -> None:
    router = fresh()
    s = router.state
    f, body = request("word " * 2000)
    hashes = engine_hashes(body)
    for i in (0, 1):
        s.observe_cache_config(i, BT, 10_000, "sha256_cbor")
        s.set_kv_synced(i, True)
    s.apply_kv_events(0, [KVEvent(STORED, tuple(hashes), None, (), BT)])
    s.apply_kv_events(1, [KVEvent(STORED, tuple(hashes[:10]), None, (), BT)])
    assert s.matched_blocks(f).tolist() == [len(hashes), 10]
    s.apply_kv_events(0, [KVEvent(REMOVED, (hashes[5],))])  # evicted in the middle
    assert s.matched_blocks(f).tolist() == [5, 10]
    s.apply_kv_events(1, [KVEvent(CLEARED)])
    assert s.matched_blocks(f).tolist() == [5, 0]
    s.set_kv_synced(0, False, clear=True)  # a restart: forgotten, approximate again
    assert s.matched_blocks(f).tolist() == [0, 0]


def routed_live():
    """A router whose two precise replicas are live, a long request and its decision."""
    router = fresh()
    for i in (0, 1):
        router.state.observe_cache_config(i, BT, 10_000, "sha256_cbor")
        router.state.set_kv_synced(i, True)
    f, _ = request("word " * 2000)
    d = router.route(f, 0.0)
    assert isinstance(d, Decision)
    return router, f, d


def test_a_closed_request_stays_pending_until_its_events_can_have_come() -> None:
    router, f, d = routed_live()
    s = router.state
    blocks = len(f.block_hashes)
    seen = [0, 0]
    seen[d.replica] = blocks
    assert s.matched_blocks(f).tolist() == seen  # open: pending, no event yet
    router.complete(d.id)
    for now in (0.25, 0.5, CLOSED_HOLD_S):  # its events are late: still counted
        router.tick(now)
        assert s.matched_blocks(f).tolist() == seen, now
    router.tick(0.25 + CLOSED_HOLD_S)
    assert s.matched_blocks(f).tolist() == [0, 0]
    assert s.precise is not None and s.precise.pending.index.sizes().sum() == 0


def test_a_retry_moves_the_pending_blocks_at_once() -> None:
    router, f, d = routed_live()
    s = router.state
    other = 1 - d.replica
    router.reassign(d.id, other)
    seen = [0, 0]
    seen[other] = len(f.block_hashes)
    assert s.matched_blocks(f).tolist() == seen  # the failed replica prefilled nothing


def test_every_policy_routes_on_the_engine_blocks() -> None:
    f, body = request("word " * 4000)
    hashes = engine_hashes(body)
    for name in ("gorgo", "cache-aware", "prefix-cache", "kv-cost"):
        router = fresh()
        s = router.state
        for i in (0, 1):
            s.observe_cache_config(i, BT, 10_000, "sha256_cbor")
            s.set_kv_synced(i, True)
            s.observe_rtt(i, 1.0)
        s.apply_kv_events(1, [KVEvent(STORED, tuple(hashes), None, (), BT)])
        router.policies[router.default_policy] = router.policies[name]
        d = router.route(f, 0.0)
        assert isinstance(d, Decision) and d.replica == 1, name
        assert d.uncached_tokens < f.prompt_tokens // 10, name


def test_warm_fills_the_memos_off_the_request_path() -> None:
    router = fresh()
    s = router.state
    s.observe_cache_config(0, BT, 10_000, "sha256_cbor")
    s.set_kv_synced(0, True)
    f, _ = request("word " * 2000)
    hasher = s.precise.replicas[0].hasher
    assert hasher is not None and not hasher._memo
    s.precise.warm(f)
    assert len(hasher._memo) == f.n_blocks  # every block's digest, for the next turn


BUDGET = 256


def bounded():
    """A router with ``limits.precise_lookup_tokens`` set, both replicas live, a long prompt
    and the engine's hashes of it."""
    router = Router(parse_fleet({**fleet(), "limits": {"precise_lookup_tokens": BUDGET}}))
    s = router.state
    assert s.precise is not None
    for i in (0, 1):
        s.observe_cache_config(i, BT, 10_000, "sha256_cbor")
        s.set_kv_synced(i, True)
    f, body = request("word " * 4000)
    return s, f, engine_hashes(body)


WALKED = -(-BUDGET // BT)  # fresh blocks hashed before the budget is spent


def test_a_cut_match_follows_the_engines_chain_of_blocks() -> None:
    """First sight of a long cached prefix (another router sent it) with the bound: the walk
    stops after WALKED blocks, and the engine's own chain (each stored block's parent) carries
    the match on, up to the prompt's length; a replica holding only part of the chain gets that
    part."""
    s, f, hashes = bounded()
    assert 3 < 3 * WALKED < len(hashes)
    s.apply_kv_events(0, [KVEvent(STORED, tuple(hashes[:10]), None, (), BT),
                          KVEvent(STORED, tuple(hashes[10:]), hashes[9], (), BT)])  # 2 turns
    s.apply_kv_events(1, [KVEvent(STORED, tuple(hashes[:2 * WALKED]), None, (), BT)])
    live, tokens, short = s.precise.cached_tokens(f, BUDGET)
    assert (live, short) == (0b11, 0b11)
    assert tokens.tolist() == [len(hashes) * BT, 2 * WALKED * BT]
    s.apply_kv_events(0, [KVEvent(REMOVED, (hashes[20],))])  # evicted: the chain ends there
    assert s.precise.cached_tokens(f, BUDGET)[1][0] == 20 * BT


def test_a_branch_ends_the_chain_and_the_guess_and_the_warm_memos_take_over() -> None:
    s, f, hashes = bounded()
    s.apply_kv_events(0, [KVEvent(STORED, tuple(hashes), None, (), BT),
                          KVEvent(STORED, (12345,), hashes[WALKED - 1], (), BT)])  # a 2nd child
    s.apply_kv_events(1, [KVEvent(STORED, tuple(hashes[:3]), None, (), BT)])
    guess = np.array([WALKED + 5] * 2)  # the approximate view knows more of both
    # 0: cut after WALKED blocks, at the branch: the guess; 1: a miss, exact (its engine evicted)
    assert s.precise.overlay(f, guess, BUDGET).tolist() == [WALKED + 5, 3]
    s.precise.warm(f)  # what the driver does after the decision
    assert s.precise.cached_tokens(f, BUDGET)[2] == 0
    assert s.precise.overlay(f, guess, BUDGET).tolist() == [len(hashes), 3]
    s.apply_kv_events(0, [KVEvent(CLEARED)])
    assert set(s.precise._child) <= set(hashes[:3])  # links kept only where 1 holds the parent


def test_the_budget_counts_fresh_tokenizing_and_hashing() -> None:
    from gorgo.core.precise import _Walk

    walk = _Walk()
    chunks = walk.chunks(iter([([1, 2, 3], 12, 3), ([4, 5], 8, 0)]))
    assert [list(c) for c in chunks] == [[1, 2, 3], [4, 5]]
    assert (walk.chars, walk.tokens, walk.spent[0]) == (20, 5, 3)
    out = list(walk.hashes(iter([7, 8, 9]), budget=3))
    assert out == [7] and walk.cut and walk.blocks == 1  # spent before the second was wanted
    ended = _Walk()
    assert list(ended.hashes(iter([7, 8]), budget=10)) == [7, 8] and not ended.cut


def test_demo_fleet_can_be_precise() -> None:
    from gorgo.sim.presets import fleet_document

    spec = parse_fleet(fleet_document({"us-east": 2}, cache="precise"))
    assert all(r.cache == PRECISE and r.sim.flavor == "vllm" for r in spec.replicas)


def hf_router(model_dir, block: int = 16) -> Router:
    """One live precise replica with the served model's tokenizer (`model_dir`)."""
    router = Router(parse_fleet({"regions": {"a": None}, "block_tokens": block, "replicas": [
        {"name": "r0", "region": "a", "address": "127.0.0.1:9000", "engine": "vllm",
         "cache": "precise", "tokenizer": str(model_dir)}]}))
    router.state.observe_cache_config(0, block, 100_000, "sha256_cbor")
    router.state.set_kv_synced(0, True)
    return router


def test_a_conversation_of_short_turns_is_not_cached_past_its_end(model_dir) -> None:
    """The engine caches turn N's blocks; turn N+1 adds a message it must prefill. Engine
    tokens converted at the rendered text's characters (markup included) made the cached part
    larger than the prompt, and the new message looked cached."""
    from gorgo.core.block_hashes import BlockHasher
    from tests.support.tokenizer import words

    router = hf_router(model_dir)
    s = router.state
    hf = s.precise.replicas[0].tokenizer

    def chat(turns: list[dict]):
        body = {"model": "m", "messages": turns, "max_tokens": 4}
        return extract_features("/v1/chat/completions", {}, json.dumps(body).encode(), s.tok)

    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": "route the cache"}
             for k in range(40)]
    before = [t for chunk, _, _ in hf.token_chunks(chat(turns)) for t in chunk]
    s.apply_kv_events(0, [KVEvent(STORED, tuple(BlockHasher("sha256_cbor", 16).hashes(before)),
                                  None, (), 16)])
    f = chat([*turns, {"role": "user", "content": words(60, 7)}])
    after = [t for chunk, _, _ in hf.token_chunks(f) for t in chunk]
    new_share = (len(after) - len(before) // 16 * 16) / len(after)  # what the engine prefills
    assert s.matched_blocks(f)[0] <= f.n_blocks
    # (at the rendered text's characters: 16 of 224 tokens, the new message about 27; now 48,
    # as the markup is spread evenly over the prompt, where the early short turns hold most)
    assert s.uncached_tokens(f)[0] >= 0.8 * new_share * f.prompt_tokens


def test_a_prompt_of_token_ids_is_cached_at_most_its_length(model_dir) -> None:
    """The engine's chain of blocks runs on past the prompt (a longer conversation that begins
    with it): followed past the walk's budget, the match stops at the prompt's end."""
    from gorgo.core.block_hashes import BlockHasher

    router = hf_router(model_dir)
    s = router.state
    ids = list(range(10, 4010))
    hashes = BlockHasher("sha256_cbor", 16).hashes(ids)
    s.apply_kv_events(0, [KVEvent(STORED, tuple(hashes[:10]), None, (), 16),
                          KVEvent(STORED, tuple(hashes[10:]), hashes[9], (), 16)])
    body = {"model": "m", "prompt": ids[:800], "max_tokens": 4}
    f = extract_features("/v1/completions", {}, json.dumps(body).encode(), s.tok)
    _, tokens, short = s.precise.cached_tokens(f, 256)
    assert short == 1 and tokens[0] == 800  # followed on, up to the prompt's 800 tokens
    assert s.matched_blocks(f)[0] == f.n_blocks
