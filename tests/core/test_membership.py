"""Models per replica (schema, masks, 404) and membership changes that keep unchanged replicas'
state (gorgo.core.membership, FleetState.reindexed, Router.reload)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from gorgo.core.decision import UNKNOWN_MODEL, Decision, Rejection
from gorgo.core.features import extract_features
from gorgo.core.fleet import FleetError, parse_fleet
from gorgo.core.membership import EnvoyView, diff_fleets
from gorgo.core.router import Router


def _replica(name: str, port: int, models: list[Any] | None = None, **extra: Any) -> dict:
    r = {"name": name, "region": "near", "address": f"10.0.0.1:{port}", "engine": "sglang",
         **extra}
    if models is not None:
        r["models"] = models
    return r


def _doc(*replicas: dict, **extra: Any) -> dict:
    return {"regions": {"near": {}}, "replicas": list(replicas), **extra}


TWO_MODELS = _doc(_replica("a1", 1, ["alpha"]),
                  _replica("a2", 2, [{"name": "alpha", "aliases": ["alpha-latest"]}]),
                  _replica("b1", 3, ["beta"]))


def _features(router: Router, model: str | None, content: str = "hello there") -> Any:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}]}
    if model is not None:
        body["model"] = model
    return extract_features("/v1/chat/completions", {}, json.dumps(body).encode(),
                            router.state.tok, policies=router.policies)


# --- schema ---------------------------------------------------------------------------------


def test_models_and_aliases_parse_and_the_fleet_lists_the_union_in_file_order() -> None:
    spec = parse_fleet(TWO_MODELS)
    assert spec.models == ("alpha", "beta")
    assert spec.replica("a2").model_names == ("alpha", "alpha-latest")
    assert parse_fleet(_doc(_replica("x", 1))).models == ()  # no field: serves whatever is asked


@pytest.mark.parametrize(("replicas", "where"), [
    ([_replica("a", 1, ["m"]), _replica("b", 2)], "replicas[1].models: required"),
    ([_replica("a", 1, [""])], "replicas[0].models[0].name"),
    ([_replica("a", 1, [{"name": "m", "alias": ["x"]}])], "replicas[0].models[0].alias"),
    ([_replica("a", 1, ["m", "m"])], "replicas[0].models: 'm' is listed twice"),
    ([_replica("a", 1, ["m"]), _replica("b", 2, [{"name": "n", "aliases": ["m"]}])],
     "replicas[1].models: alias 'm' of 'n' already names 'm'"),
    ([_replica("a", 1, "m")], "replicas[0].models: expected a list"),
    ([_replica("a", 1, ["m"], drain="yes")], "replicas[0].drain: expected true or false"),
])
def test_bad_models_name_the_field(replicas: list[dict], where: str) -> None:
    with pytest.raises(FleetError, match=f"^fleet.{where}".replace("[", r"\[").replace("]", r"\]")):
        parse_fleet(_doc(*replicas))


# --- models route -----------------------------------------------------------------------------


def test_each_model_routes_only_to_its_replicas_aliases_included() -> None:
    router = Router(parse_fleet(TWO_MODELS))
    seen: dict[str, set[str]] = {"alpha": set(), "alpha-latest": set(), "beta": set()}
    for k in range(30):
        for model in seen:
            d = router.route(_features(router, model, f"prompt {k}"), float(k))
            assert isinstance(d, Decision)
            seen[model].add(router.state.names[d.replica])
    assert seen == {"alpha": {"a1", "a2"}, "alpha-latest": {"a2"}, "beta": {"b1"}}


def test_unknown_or_missing_model_is_a_404_naming_the_known_models() -> None:
    router = Router(parse_fleet(TWO_MODELS))
    for model in ("gamma", None):
        r = router.route(_features(router, model), 0.0)
        assert isinstance(r, Rejection) and (r.status, r.reason) == (404, UNKNOWN_MODEL)
        assert "alpha, beta" in r.message
    assert router.open_requests == 0
    one = Router(parse_fleet(_doc(_replica("a", 1, ["solo"]), _replica("b", 2, ["solo"]))))
    assert isinstance(one.route(_features(one, None), 0.0), Decision)  # the one model it serves


def test_a_model_whose_replicas_are_all_down_is_503_not_another_models_replica() -> None:
    router = Router(parse_fleet(TWO_MODELS))
    router.state.healthy[router.state.index["b1"]] = False
    r = router.route(_features(router, "beta"), 0.0)
    assert isinstance(r, Rejection) and r.status == 503
    assert router.state.candidates is None  # the request's mask never outlives it


def test_a_draining_replica_gets_no_new_request() -> None:
    doc = _doc(_replica("a", 1), _replica("b", 2, drain=True))
    router = Router(parse_fleet(doc))
    names = {router.state.names[router.route(_features(router, None, f"p{k}"), 0.0).replica]
             for k in range(20)}
    assert names == {"a"}


# --- membership -----------------------------------------------------------------------------


def test_diff_keeps_by_name_and_identity() -> None:
    old = parse_fleet(_doc(_replica("a", 1), _replica("b", 2), _replica("c", 3)))
    new = parse_fleet(_doc(_replica("a", 1, prefill_rate=5.0), _replica("c", 9),
                           _replica("d", 4)))
    d = diff_fleets(old, new)
    assert (d.kept, d.added, d.removed) == (("a",), ("c", "d"), ("b", "c"))


def _warm(router: Router) -> list[Decision]:
    """Some traffic and signals on every replica: RTT, scrapes, prefixes, a calibrated rate."""
    s = router.state
    for i in range(s.n):
        s.observe_rtt(i, 10.0 * (i + 1))
        s.observe_engine(i, 0.0, 2.0, 1.0, 0.5)
    s.set_weights(s.weights, {"a": 777.0})
    out = []
    for k in range(12):
        d = router.route(_features(router, None, f"shared prefix {k % 3} " * 40), 1.0)
        assert isinstance(d, Decision)
        out.append(d)
    return out


def test_reload_keeps_unchanged_rows_and_their_prefix_entries_and_open_requests() -> None:
    router = Router(parse_fleet(_doc(_replica("a", 1), _replica("b", 2), _replica("c", 3))))
    decisions = _warm(router)
    old = router.state
    before = {n: (old.rtt_ms[i], old.rtt_samples[i], old.eng_queue_reqs[i],
                  old.inflight_reqs[i], old.prefix.blocks_held(i))
              for n, i in old.index.items()}
    probe = _features(router, None, "shared prefix 1 " * 40)
    matched = dict(zip(old.names, old.prefix.match(probe.block_hashes), strict=True))
    diff = router.reload(parse_fleet(_doc(_replica("d", 4), _replica("c", 3), _replica("a", 1))))
    assert (diff.kept, diff.added, diff.removed) == (("c", "a"), ("d",), ("b",))
    s = router.state
    assert s is not old and s.names == ["d", "c", "a"] and router.generation == 1
    for n in ("a", "c"):
        i = s.index[n]
        assert (s.rtt_ms[i], s.rtt_samples[i], s.eng_queue_reqs[i], s.inflight_reqs[i],
                s.prefix.blocks_held(i)) == before[n]
        assert s.prefix.match(probe.block_hashes)[i] == matched[n]
    assert s.prefill_rate[s.index["a"]] == 777.0  # calibrated: kept
    d = s.index["d"]
    assert np.isnan(s.rtt_ms[d]) and s.prefix.blocks_held(d) == 0
    assert not s.healthy[d]  # routable once its first probe answers
    # Open requests follow their replica's new index; the removed replica's are forgotten.
    for dec in decisions:
        name = old.names[dec.replica]
        j = router.replica_of(dec.id)
        assert (j is None) == (name == "b") and (j is None or s.names[j] == name)
        assert router.complete(dec.id) == (name != "b")
    assert s.inflight_reqs.sum() == 0


def test_a_failed_reload_changes_nothing() -> None:
    router = Router(parse_fleet(_doc(_replica("a", 1), _replica("b", 2))))
    _warm(router)
    state, spec = router.state, router.spec
    bad = parse_fleet(_doc(_replica("a", 1), policy="gorgo", limits={"max_body_bytes": 1 << 30}))
    with pytest.raises(FleetError, match="max_body_bytes: cannot grow"):
        router.reload(bad)
    assert router.state is state and router.spec is spec and router.generation == 0


@pytest.mark.parametrize("extproc", [{"response_headers": "skip"}, {"request_headers": "skip"},
                                     {"response_trailers": "send"}])
def test_a_reload_that_changes_how_envoy_talks_to_the_router_is_refused(
        extproc: dict[str, str]) -> None:
    """Before: taken on, though Envoy's processing mode is rendered from it. With
    `response_headers: skip` the router ended each booking at the request's end while Envoy
    still sent the response headers, and read no replica's errors (the start's check that
    --envoy-admin is given was never made)."""
    router = Router(parse_fleet(_doc(_replica("a", 1), _replica("b", 2))))
    spec = router.spec
    with pytest.raises(FleetError, match="extproc: cannot change on reload"):
        router.reload(parse_fleet(_doc(_replica("a", 1), _replica("b", 2), extproc=extproc)))
    assert router.spec is spec and router.generation == 0
    router.reload(parse_fleet(_doc(_replica("a", 1), _replica("c", 3))))  # the rest reloads
    assert router.state.names == ["a", "c"]


@pytest.mark.parametrize(("extra", "field"), [
    ({"endpoint_picker": True}, "endpoint_picker"), ({"block_tokens": 16}, "block_tokens"),
    ({"chars_per_token": 3.5}, "chars_per_token"), ({"media_tokens": 500}, "media_tokens")])
def test_a_reload_that_changes_the_envoy_mode_or_the_blocks_is_refused(
        extra: dict[str, Any], field: str) -> None:
    """Before: taken on. `endpoint_picker` turned off named a replica added in picker mode by a
    cluster Envoy's bootstrap does not have; new block cuts left every prefix entry unmatched
    (cache affinity lost on every replica, silently)."""
    router = Router(parse_fleet(_doc(_replica("a", 1), _replica("b", 2))))
    _warm(router)  # prompts indexed in the present blocks
    spec = router.spec
    with pytest.raises(FleetError, match=f"{field}: cannot change on reload"):
        router.reload(parse_fleet(_doc(_replica("a", 1), _replica("b", 2), **extra)))
    assert router.spec is spec and router.generation == 0


def test_a_worker_started_from_an_edited_file_takes_its_peers_fleet_back() -> None:
    """Its file said another block size and Envoy mode than its peers run (they refused the
    edit): the refusals kept it apart from them. Nothing is cached yet, and Envoy's mode is the
    rendered fleet's, so both are taken; once prompts are indexed, new block cuts are not."""
    rendered = parse_fleet(_doc(_replica("a", 1), _replica("b", 2)))
    router = Router(parse_fleet(_doc(_replica("a", 1), _replica("b", 2), block_tokens=16,
                                     endpoint_picker=True)))
    router.envoy = EnvoyView(rendered, clusters_file=True)
    router.reload(rendered)
    assert router.spec.block_tokens == 64 and not router.spec.endpoint_picker
    with pytest.raises(FleetError, match="endpoint_picker: cannot change"):
        router.reload(parse_fleet(_doc(_replica("a", 1), _replica("b", 2),
                                       endpoint_picker=True)))
    _warm(router)
    with pytest.raises(FleetError, match="block_tokens: cannot change"):
        router.reload(parse_fleet(_doc(_replica("a", 1), _replica("b", 2), block_tokens=16)))


_AB = (_replica("a", 1), _replica("b", 2))


@pytest.mark.parametrize(("clusters_file", "replicas", "extra", "refused"), [
    # Envoy fails open to the rendered fleet's default cluster (a's): the file must keep it,
    # whatever default a reload names.
    (True, (_replica("b", 2),), {}, "'a' is the cluster Envoy's routes send"),
    (True, (_replica("b", 2),), {"default_cluster": "b"}, "'a' is the cluster"),
    (True, (*_AB, _replica("c", 3)), {}, None),  # the file gives Envoy c's cluster
    (True, (_replica("a", 1),), {}, None),
    # Without a clusters file Envoy has the bootstrap's clusters and no other.
    (False, (*_AB, _replica("c", 3)), {}, r"'c' \(c, 10.0.0.1:3\) is not a cluster"),
    (False, (_replica("a", 1), _replica("b", 9)), {}, "'b' .* is not a cluster of Envoy's"),
    (False, (_replica("a", 1),), {}, None),  # a removed replica: nothing routes there
])
def test_a_reload_keeps_to_the_clusters_envoy_has(
        clusters_file: bool, replicas: tuple[dict, ...], extra: dict[str, Any],
        refused: str | None) -> None:
    router = Router(parse_fleet(_doc(*_AB)))
    router.envoy = EnvoyView(router.spec, clusters_file=clusters_file)
    new = parse_fleet(_doc(*replicas, **extra))
    if refused is None:
        router.reload(new)
        assert router.spec is new
    else:
        with pytest.raises(FleetError, match=refused):
            router.reload(new)
        assert router.generation == 0


def test_offline_and_in_picker_mode_a_reload_adds_replicas_envoy_was_not_rendered_with() -> None:
    """No Envoy in front (the simulator), or Envoy's picker routes to whatever address the
    router names: an added replica is taken on."""
    offline = Router(parse_fleet(_doc(*_AB)))
    offline.reload(parse_fleet(_doc(*_AB, _replica("c", 3))))
    picker = Router(parse_fleet(_doc(*_AB, endpoint_picker=True)))
    picker.envoy = EnvoyView(picker.spec, clusters_file=False)
    picker.reload(parse_fleet(_doc(*_AB, _replica("c", 3), endpoint_picker=True)))
    assert offline.state.names == picker.state.names == ["a", "b", "c"]


def test_reload_takes_on_the_new_models_and_drains() -> None:
    router = Router(parse_fleet(TWO_MODELS))
    router.reload(parse_fleet(_doc(_replica("a1", 1, ["alpha"], drain=True),
                                   _replica("a2", 2, ["alpha"]), _replica("b1", 3, ["gamma"]))))
    assert router.spec.models == ("alpha", "gamma")
    d = router.route(_features(router, "alpha"), 0.0)
    assert isinstance(d, Decision) and router.state.names[d.replica] == "a2"
    r = router.route(_features(router, "beta"), 0.0)
    assert isinstance(r, Rejection) and r.status == 404


def test_a_kv_capacity_edited_in_the_file_reaches_the_prefix_index_of_a_kept_replica() -> None:
    """SGLang reports no pool size: the file's is the index's bound, and an edit must apply
    (it reached the size check but the index kept the old bound until a restart). A bound the
    engine reported stays."""
    router = Router(parse_fleet(_doc(_replica("a", 1, kv_capacity_tokens=100_000),
                                     _replica("b", 2, kv_capacity_tokens=100_000))))
    router.state.prefix.insert(0, np.arange(1, 101, dtype=np.uint64))  # 100 blocks cached
    router.state.prefix.set_capacity(1, 5_000)  # b's engine said
    router.reload(parse_fleet(_doc(_replica("a", 1, kv_capacity_tokens=400),
                                   _replica("b", 2, kv_capacity_tokens=400))))
    prefix = router.state.prefix
    assert prefix.capacity is not None
    assert (prefix.capacity[0], prefix.blocks_held(0)) == (6, 6)  # 400 tokens, 64 a block
    assert prefix.capacity[1] == 5_000


@pytest.mark.parametrize("policy", ["round-robin", "random", "least-request"])
def test_a_reload_does_not_restart_a_policys_turn_or_sequence(policy: str) -> None:
    """Reloads come often (an admin drain, each DNS change, SIGHUP): round robin's turn, the
    tie-break's rotation and the generators go on (reloads every 2 requests sent round robin's
    traffic to 2 of 4 replicas)."""
    doc = _doc(*(_replica(f"r{k}", k + 1) for k in range(4)), policy=policy)

    def names(reload_every: int | None) -> list[str]:
        router = Router(parse_fleet(doc))
        router.state.healthy[:] = True
        out = []
        for k in range(40):
            if reload_every and k % reload_every == 0:
                router.reload(parse_fleet(doc))
                router.state.healthy[:] = True
            d = router.route(_features(router, None, f"q{k}"), 1.0)
            assert isinstance(d, Decision)
            out.append(router.state.names[d.replica])
            router.complete(d.id)
        return out

    assert names(2) == names(None)
