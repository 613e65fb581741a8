"""Fleet file validation: defaults, and errors that name the offending field's path."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gorgo.core.fleet import (
    DEFAULT_PROFILE,
    LINK_PRESETS,
    FleetError,
    FleetSpec,
    Limits,
    Signals,
    Timeouts,
    finite_number,
    load_fleet,
    parse_fleet,
    split_address,
)
from gorgo.core.weights import Weights


def doc() -> dict[str, Any]:
    return {
        "regions": {"us-east": {}, "eu-frankfurt": {"sim": {"link": "eu-frankfurt"}}},
        "replicas": [
            {"name": "a", "engine": "sim", "region": "us-east", "address": "10.0.0.1:8000"},
            {"name": "b", "region": "eu-frankfurt", "address": "10.0.0.2:8000",
             "engine": "vllm", "prefill_rate": 5000, "kv_capacity_tokens": 1000},
        ],
    }


def bad(mutate: Any, source: str = "fleet") -> str:
    raw = doc()
    mutate(raw)
    with pytest.raises(FleetError) as info:
        parse_fleet(raw, source=source)
    return str(info.value)


# --- defaults -------------------------------------------------------------------------------


def test_defaults() -> None:
    spec = parse_fleet(doc())
    assert isinstance(spec, FleetSpec)
    assert spec.name == "fleet"
    assert spec.policy == "gorgo"
    assert spec.allow_policy_override is False
    assert spec.weights == Weights({"rtt": 1.0, "queue": 1.0}, 0)
    assert spec.block_tokens == 64 and spec.chars_per_token == 4.0
    assert spec.media_tokens == 1000
    assert spec.proxy_region == "us-east"  # the first region
    assert spec.default_cluster == "a"  # the first replica's cluster
    assert spec.timeouts == Timeouts()
    assert spec.signals == Signals()
    assert spec.limits == Limits()
    assert spec.region_names == ["us-east", "eu-frankfurt"]


def test_replica_defaults() -> None:
    a, b = parse_fleet(doc()).replicas
    assert a.cluster == "a"
    assert a.engine == "sim"
    assert a.health_url == "http://10.0.0.1:8000/health"
    assert a.metrics_url == "http://10.0.0.1:8000/metrics"
    assert a.prefill_rate == 10000.0
    assert a.kv_capacity_tokens == 500_000
    assert a.sim is not None
    assert (a.sim.profile, a.sim.flavor, a.sim.port) == (DEFAULT_PROFILE, "sglang", 0)
    assert (a.host, a.port) == ("10.0.0.1", 8000)
    assert a.metrics_flavor == "sglang"
    assert b.engine == "vllm" and b.sim is None and b.metrics_flavor == "vllm"
    assert b.prefill_rate == 5000.0 and isinstance(b.prefill_rate, float)
    assert b.kv_capacity_tokens == 1000 and isinstance(b.kv_capacity_tokens, int)


def test_region_link_presets_and_overrides() -> None:
    raw = doc()
    raw["regions"] = {
        "us-east": None,
        "eu-frankfurt": {"sim": {"link": "ap-seoul", "rtt_ms": 100}},
        "lab": {},
    }
    raw["replicas"][1]["region"] = "lab"
    regions = {r.name: r for r in parse_fleet(raw).regions}
    assert (regions["us-east"].rtt_ms, regions["us-east"].jitter_ms) == LINK_PRESETS["us-east"]
    assert regions["eu-frankfurt"].rtt_ms == 100.0
    assert regions["eu-frankfurt"].jitter_ms == LINK_PRESETS["ap-seoul"][1]
    assert (regions["lab"].rtt_ms, regions["lab"].jitter_ms) == LINK_PRESETS["local"]


def test_routes_and_control_headers() -> None:
    """Envoy forwards the API and the health path, plus exact extra paths; no client is trusted
    with control headers unless the fleet names its network."""
    spec = parse_fleet(doc())
    assert spec.routes.extra_paths == () and spec.control_headers.trusted_peers == ()
    raw = doc()
    raw["routes"] = {"extra_paths": ["/v1/embeddings", "/v1/rerank"]}
    # a range named twice is one (Envoy refused its filter chain's repeated source range)
    raw["control_headers"] = {"trusted_peers": ["10.20.0.0/24", "fd00::/8", "192.0.2.7",
                                                "192.0.2.7/32"]}
    spec = parse_fleet(raw)
    assert spec.routes.extra_paths == ("/v1/embeddings", "/v1/rerank")
    assert spec.control_headers.trusted_peers == ("10.20.0.0/24", "fd00::/8", "192.0.2.7/32")


def test_explicit_values_are_kept() -> None:
    raw = doc()
    raw.update({
        "name": "prod", "policy": "round-robin", "allow_policy_override": True,
        "weights": {"rtt": 0.5, "queue": 2}, "block_tokens": 16, "chars_per_token": 3.5,
        "media_tokens": 576, "proxy_region": "eu-frankfurt", "default_cluster": "cb",
        "timeouts": {"message_ms": 250, "request_s": 30},
        "signals": {"rtt_ewma_alpha": 0.5}, "limits": {"max_json_depth": 10},
    })
    raw["replicas"][1].update({"cluster": "cb", "health_url": "http://h/ok",
                               "metrics_url": "http://h/m"})
    raw["replicas"][0]["sim"] = {"profile": "tiny", "flavor": "vllm", "port": 9001}
    spec = parse_fleet(raw)
    assert spec.name == "prod" and spec.policy == "round-robin" and spec.allow_policy_override
    assert spec.weights == Weights({"rtt": 0.5, "queue": 2.0}, 0)
    assert (spec.block_tokens, spec.chars_per_token, spec.media_tokens) == (16, 3.5, 576)
    assert spec.proxy_region == "eu-frankfurt" and spec.default_cluster == "cb"
    assert spec.timeouts.message_ms == 250 and isinstance(spec.timeouts.message_ms, int)
    assert spec.timeouts.request_s == 30.0 and isinstance(spec.timeouts.request_s, float)
    assert spec.timeouts.connect_ms == Timeouts().connect_ms
    assert spec.signals.rtt_ewma_alpha == 0.5
    assert spec.limits.max_json_depth == 10
    a, b = spec.replicas
    assert a.sim is not None and (a.sim.profile, a.sim.flavor, a.sim.port) == ("tiny", "vllm", 9001)
    assert a.metrics_flavor == "vllm"
    assert (b.cluster, b.health_url, b.metrics_url) == ("cb", "http://h/ok", "http://h/m")


def test_replica_lookup() -> None:
    spec = parse_fleet(doc())
    assert spec.replica("b").region == "eu-frankfurt"
    with pytest.raises(KeyError):
        spec.replica("zzz")


# --- errors ---------------------------------------------------------------------------------


def _set(path: list, value: Any) -> Any:
    def mutate(raw: dict) -> None:
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return mutate


def _del(path: list) -> Any:
    def mutate(raw: dict) -> None:
        node = raw
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return mutate


@pytest.mark.parametrize(
    ("mutate", "prefix"),
    [
        # unknown fields, at every level
        (_set(["polcy"], "gorgo"), "fleet.polcy: unknown field"),
        (_set(["replicas", 0, "adress"], "x:1"), "fleet.replicas[0].adress: unknown field"),
        (_set(["regions", "us-east"], {"rtt": 5}), "fleet.regions.us-east.rtt: unknown field"),
        (_set(["regions", "us-east"], {"sim": {"rtt": 5}}),
         "fleet.regions.us-east.sim.rtt: unknown field"),
        (_set(["weights"], {"prefill": 1}), "fleet.weights.prefill: unknown field"),
        (_set(["timeouts"], {"message": 1}), "fleet.timeouts.message: unknown field"),
        (_set(["signals"], {"alpha": 1}), "fleet.signals.alpha: unknown field"),
        (_set(["limits"], {"max_body": 1}), "fleet.limits.max_body: unknown field"),
        (_set(["replicas", 0, "sim"], {"flavour": "vllm"}),
         "fleet.replicas[0].sim.flavour: unknown field"),
        # regions
        (_set(["replicas", 1, "region"], "mars"), "fleet.replicas[1].region: unknown region"),
        (_set(["regions", "us-east"], {"sim": {"link": "moon"}}),
         "fleet.regions.us-east.sim.link: unknown preset"),
        # simulator-only fields belong in a sim section
        (_set(["regions", "us-east"], {"link": "us-east"}),
         "fleet.regions.us-east.link: simulator-only: move it under fleet.regions.us-east.sim"),
        (_set(["regions", "us-east"], {"rtt_ms": 5}),
         "fleet.regions.us-east.rtt_ms: simulator-only"),
        (_set(["regions"], {}), "fleet.regions: at least one region"),
        (_del(["regions"]), "fleet.regions: expected a mapping"),
        (_set(["regions", "us-east"], [1]), "fleet.regions.us-east: expected a mapping"),
        (_set(["proxy_region"], "mars"), "fleet.proxy_region: unknown region"),
        # engines
        (_set(["replicas", 1, "engine"], "tgi"), "fleet.replicas[1].engine: must be one of"),
        (_del(["replicas", 0, "engine"]), "fleet.replicas[0].engine: required"),
        (_set(["replicas", 1, "sim"], {"flavor": "vllm"}),
         "fleet.replicas[1].sim: only allowed with engine: sim"),
        (_set(["replicas", 0, "sim"], {"flavor": "tgi"}), "fleet.replicas[0].sim.flavor:"),
        (_set(["replicas", 0, "sim"], "fast"), "fleet.replicas[0].sim: expected a mapping"),
        # duplicates
        (_set(["replicas", 1, "name"], "a"), "fleet.replicas[1].name: duplicate 'a'"),
        (_set(["replicas", 1, "cluster"], "a"), "fleet.replicas[1].cluster: duplicate 'a'"),
        (_set(["replicas", 1, "address"], "10.0.0.1:8000"),
         "fleet.replicas[1].address: duplicate '10.0.0.1:8000'"),
        # addresses
        (_set(["replicas", 0, "address"], "10.0.0.1"), "fleet.replicas[0].address: expected host"),
        (_set(["replicas", 0, "address"], ":8000"), "fleet.replicas[0].address: expected host"),
        (_set(["replicas", 0, "address"], "h:0"), "fleet.replicas[0].address: expected host"),
        (_set(["replicas", 0, "address"], "h:65536"), "fleet.replicas[0].address: expected host"),
        (_set(["replicas", 0, "address"], "h:http"), "fleet.replicas[0].address: expected host"),
        (_del(["replicas", 0, "address"]), "fleet.replicas[0].address: required"),
        (_set(["replicas", 0, "address"], 8000), "fleet.replicas[0].address: expected a non-empty"),
        # a URL was probed at http://http://... for ever, and turned retries off
        (_set(["replicas", 0, "address"], "http://10.0.0.9:8000"),
         "fleet.replicas[0].address: expected host:port (an IPv6 host in brackets, no URL)"),
        (_set(["replicas", 0, "address"], "::1:8000"),
         "fleet.replicas[0].address: an IPv6 address is written in brackets, [::1]:8000"),
        (_set(["replicas", 0, "address"], "h:١٨٠٠"), "fleet.replicas[0].address: expected host"),
        (_set(["replicas", 0, "address"], "a b:80"), "fleet.replicas[0].address: expected host"),
        (_set(["replicas", 0, "address"], "[h]:80"), "fleet.replicas[0].address: '[h]' is"),
        (_set(["replicas", 0, "health_url"], "10.0.0.9:8000/health"),
         "fleet.replicas[0].health_url: expected an http(s) URL"),
        (_set(["replicas", 0, "metrics_url"], "http://10.0.0.9:99999/metrics"),
         "fleet.replicas[0].metrics_url: expected an http(s) URL"),
        (_set(["replicas", 0, "metrics_url"], "http://10.0.0.9:0/metrics"),
         "fleet.replicas[0].metrics_url: expected an http(s) URL"),  # connects nowhere
        (_set(["replicas", 0, "health_url"], "http://[::1/health"),
         "fleet.replicas[0].health_url: expected an http(s) URL"),  # urllib's ValueError
        # names travel in headers and Envoy's cluster names
        (_set(["replicas", 0, "name"], "a\n"), "fleet.replicas[0].name: no control characters"),
        (_set(["replicas", 0, "cluster"], " a"), "fleet.replicas[0].cluster: no control"),
        (_set(["replicas", 0, "name"], "gorgo_fleet"),
         "fleet.replicas[0].cluster: 'gorgo_fleet' is a cluster of GORGO's own Envoy config"),
        (_set(["replicas", 0, "cluster"], "gorgo_extproc"), "fleet.replicas[0].cluster: 'gorgo_"),
        (_set(["limits"], {"max_body_bytes": 2**31}), "fleet.limits.max_body_bytes: must be <="),
        # past Envoy's own ranges: Envoy refused the render naming its field, not the fleet's
        (_set(["timeouts"], {"request_s": 1e12}), "fleet.timeouts.request_s: must be <="),
        (_set(["timeouts"], {"connect_ms": 2**53}), "fleet.timeouts.connect_ms: must be <="),
        (_set(["timeouts"], {"message_ms": 3_600_001}), "fleet.timeouts.message_ms: must be <="),
        (_set(["retries"], {"min_retry_concurrency": 2**40}),
         "fleet.retries.min_retry_concurrency: must be <="),
        # Envoy's range for per_upstream_preconnect_ratio is [1, 3]
        (_set(["upstream"], {"preconnect_ratio": 0.5}),
         "fleet.upstream.preconnect_ratio: must be >= 1.0"),
        (_set(["upstream"], {"preconnect_ratio": 3.5}),
         "fleet.upstream.preconnect_ratio: must be <= 3"),
        (_set(["upstream"], {"preconnect_ratio": float("nan")}),
         "fleet.upstream.preconnect_ratio: expected a finite number"),
        (_set(["upstream"], {"preconnect": 2}), "fleet.upstream.preconnect: unknown field"),
        (_set(["sharing"], {"nats": "nats://127.0.0.1:99999"}), "fleet.sharing.nats: expected"),
        # required strings
        (_del(["replicas", 0, "name"]), "fleet.replicas[0].name: required"),
        (_set(["replicas", 0, "name"], ""), "fleet.replicas[0].name: expected a non-empty"),
        (_set(["policy"], 3), "fleet.policy: expected a non-empty string"),
        (_set(["policy"], "gorgoo"), "fleet.policy: unknown policy 'gorgoo' (known: "),
        # numbers
        (_set(["replicas", 0, "prefill_rate"], "fast"),
         "fleet.replicas[0].prefill_rate: expected a number"),
        (_set(["replicas", 0, "prefill_rate"], 0), "fleet.replicas[0].prefill_rate: must be > 0"),
        (_set(["replicas", 0, "prefill_rate"], True),
         "fleet.replicas[0].prefill_rate: expected a number"),
        (_set(["replicas", 0, "kv_capacity_tokens"], 0),
         "fleet.replicas[0].kv_capacity_tokens: must be >= 1"),
        (_set(["replicas", 0, "kv_capacity_tokens"], 10.5),
         "fleet.replicas[0].kv_capacity_tokens: expected an integer"),
        (_set(["replicas", 0, "sim"], {"port": -1}), "fleet.replicas[0].sim.port: must be >= 0"),
        (_set(["weights"], {"rtt": -1}), "fleet.weights.rtt: must be >= 0.05"),
        (_set(["weights"], {"queue": 0}), "fleet.weights.queue: must be >= 0.05"),
        (_set(["weights"], {"queue": 21}), "fleet.weights.queue: must be <= 20"),
        (_set(["weights"], {"queue": "x"}), "fleet.weights.queue: expected a number"),
        (_set(["block_tokens"], 0), "fleet.block_tokens: must be >= 1"),
        (_set(["block_tokens"], 2.5), "fleet.block_tokens: expected an integer"),
        (_set(["chars_per_token"], 0), "fleet.chars_per_token: must be > 0"),
        (_set(["media_tokens"], -1), "fleet.media_tokens: must be >= 0"),
        (_set(["media_tokens"], 2.5), "fleet.media_tokens: expected an integer"),
        (_set(["media_tokens"], 2**21), "fleet.media_tokens: must be <= 1048576"),
        (_set(["timeouts"], {"message_ms": 1.5}), "fleet.timeouts.message_ms: expected an integer"),
        (_set(["signals"], {"metrics_stale_s": -1}), "fleet.signals.metrics_stale_s: must be > 0"),
        # "0s" is no timeout to Envoy, but the tuner's range, peer bookings and held bookings
        # end at it: the tuner then refused a key its config never set
        (_set(["timeouts"], {"request_s": 0}), "fleet.timeouts.request_s: must be > 0"),
        (_set(["regions", "us-east"], {"sim": {"rtt_ms": "far"}}),
         "fleet.regions.us-east.sim.rtt_ms: expected a number"),
        # YAML's .nan and .inf are numbers: a NaN passes every comparison and would make every
        # cost NaN (a 503 for everyone); an int cast of either raised outside FleetError
        (_set(["replicas", 0, "prefill_rate"], math.nan),
         "fleet.replicas[0].prefill_rate: expected a finite number, got nan"),
        (_set(["replicas", 0, "prefill_rate"], math.inf),
         "fleet.replicas[0].prefill_rate: expected a finite number, got inf"),
        (_set(["replicas", 0, "kv_capacity_tokens"], math.inf),
         "fleet.replicas[0].kv_capacity_tokens: expected a finite number"),
        (_set(["replicas", 0, "kv_capacity_tokens"], 2**64),
         "fleet.replicas[0].kv_capacity_tokens: must be within"),
        # past a float's range: math.isfinite raised OverflowError, an admin call's 500
        (_set(["replicas", 0, "kv_capacity_tokens"], 10**400),
         "fleet.replicas[0].kv_capacity_tokens: must be within"),
        (_set(["replicas", 0, "prefill_rate"], -(10**400)),
         "fleet.replicas[0].prefill_rate: must be within"),
        (_set(["weights"], {"rtt": math.nan}), "fleet.weights.rtt: expected a finite number"),
        (_set(["chars_per_token"], math.nan), "fleet.chars_per_token: expected a finite number"),
        (_set(["penalties"], {"error_ms": math.nan}),
         "fleet.penalties.error_ms: expected a finite number"),
        (_set(["limits"], {"max_body_bytes": math.inf}),
         "fleet.limits.max_body_bytes: expected a finite number"),
        # bounds a zero or an extrapolating average would break
        (_set(["signals"], {"rtt_ewma_alpha": 5}), "fleet.signals.rtt_ewma_alpha: must be <= 1"),
        (_set(["signals"], {"rtt_ewma_alpha": 0}), "fleet.signals.rtt_ewma_alpha: must be > 0"),
        (_set(["signals"], {"probe_interval_s": 0}),
         "fleet.signals.probe_interval_s: must be > 0"),
        (_set(["signals"], {"scrape_interval_s": 0}),
         "fleet.signals.scrape_interval_s: must be > 0"),
        (_set(["penalties"], {"half_life_s": 0}), "fleet.penalties.half_life_s: must be > 0"),
        (_set(["timeouts"], {"probe_ms": 0}), "fleet.timeouts.probe_ms: must be > 0"),
        # others
        (_set(["replicas"], []), "fleet.replicas: expected a non-empty list"),
        (_set(["replicas"], {"a": 1}), "fleet.replicas: expected a non-empty list"),
        (_set(["replicas", 0], "a"), "fleet.replicas[0]: expected a mapping"),
        (_set(["allow_policy_override"], "yes"), "fleet.allow_policy_override: expected true"),
        (_set(["default_cluster"], "zzz"), "fleet.default_cluster: 'zzz' is not a replica"),
        (_set(["weights"], [1]), "fleet.weights: expected a mapping"),
        # what Envoy forwards, and whom it trusts with control headers
        (_set(["routes"], {"extra_paths": "/v1/x"}), "fleet.routes.extra_paths: expected a list"),
        (_set(["routes"], {"extra_paths": ["/v1/../metrics"]}),
         "fleet.routes.extra_paths[0]: expected an exact path"),
        (_set(["routes"], {"extra_paths": ["/v1/x?y=1"]}),
         "fleet.routes.extra_paths[0]: expected an exact path"),
        (_set(["routes"], {"extra_paths": ["v1/x"]}),
         "fleet.routes.extra_paths[0]: expected an exact path"),
        (_set(["routes"], {"extra_paths": ["/v1/%6d"]}),
         "fleet.routes.extra_paths[0]: expected an exact path"),
        (_set(["routes"], {"extra_paths": ["/v1/models"]}),
         "fleet.routes.extra_paths[0]: '/v1/models' is already forwarded"),
        (_set(["routes"], {"extra_paths": ["/v1/x", "/v1/x"]}),
         "fleet.routes.extra_paths[1]: '/v1/x' is already forwarded"),
        (_set(["routes"], {"paths": []}), "fleet.routes.paths: unknown field"),
        (_set(["control_headers"], {"trusted_peers": ["10.0.0.1/8"]}),
         "fleet.control_headers.trusted_peers[0]: expected a CIDR range"),
        (_set(["control_headers"], {"trusted_peers": ["gateway.internal"]}),
         "fleet.control_headers.trusted_peers[0]: expected a CIDR range"),
        (_set(["control_headers"], {"trusted_peers": "10.0.0.0/8"}),
         "fleet.control_headers.trusted_peers: expected a list"),
        # rendered as Envoy's access_log_flush_interval, which Envoy refused below 1 ms
        (_set(["observability"], {"ttft_log_interval_s": 0.0001}),
         "fleet.observability.ttft_log_interval_s: must be 0 (off) or >= 0.001"),
    ],
)
def test_errors_name_the_field(mutate: Any, prefix: str) -> None:
    message = bad(mutate)
    assert message.startswith(prefix), message


def test_unknown_field_lists_allowed_fields() -> None:
    message = bad(_set(["weights"], {"rtt": 1, "prefil": 1}))
    assert re.search(r"allowed: decode, interference, queue, reuse, rtt\)$", message)


def test_source_prefixes_paths() -> None:
    assert bad(_set(["polcy"], 1), source="prod.yaml").startswith("prod.yaml.polcy:")


def test_top_level_must_be_mapping() -> None:
    with pytest.raises(FleetError, match=r"^fleet: expected a mapping, got list"):
        parse_fleet([1, 2])
    with pytest.raises(FleetError, match=r"^fleet: expected a mapping, got NoneType"):
        parse_fleet(None)


def test_unhashable_link_preset_is_a_fleet_error() -> None:
    assert bad(_set(["regions", "us-east"], {"sim": {"link": ["us-east"]}})).startswith(
        "fleet.regions.us-east.sim.link:"
    )


def test_fleet_error_is_value_error() -> None:
    assert issubclass(FleetError, ValueError)


def test_parse_does_not_mutate_input() -> None:
    raw = doc()
    before = copy.deepcopy(raw)
    parse_fleet(raw)
    assert raw == before


# --- files ----------------------------------------------------------------------------------


def test_load_fleet_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc()))
    spec = load_fleet(path)
    assert [r.name for r in spec.replicas] == ["a", "b"]
    assert load_fleet(str(path)) == spec


def test_load_fleet_errors_use_file_name(tmp_path: Path) -> None:
    path = tmp_path / "prod.yaml"
    raw = doc()
    raw["replicas"][0]["engine"] = "tgi"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(FleetError, match=r"^prod\.yaml\.replicas\[0\]\.engine:"):
        load_fleet(path)


def test_load_fleet_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("regions: [unclosed\n")
    with pytest.raises(FleetError, match="not valid YAML"):
        load_fleet(path)


@pytest.mark.parametrize(("address", "canonical"), [
    # Envoy's override-host list matches only its own form: a retry went elsewhere
    ("127.0.0.1:08000", "127.0.0.1:8000"), ("[0:0::1]:8000", "[::1]:8000"),
    ("[::FFFF:10.0.0.1]:80", "[::ffff:a00:1]:80"), ("vllm-0.vllm:8000", "vllm-0.vllm:8000")])
def test_addresses_take_the_one_form_envoy_matches(address: str, canonical: str) -> None:
    raw = doc()
    raw["replicas"][0]["address"] = address
    assert parse_fleet(raw).replicas[0].address == canonical


@pytest.mark.parametrize(("text", "message"), [
    ("limits: {max_messages: 10}\nlimits: {max_messages: 4096}\n", "duplicate key 'limits'"),
    ("a: " + "[" * 600 + "]" * 600 + "\n", "nested too deep"),
])
def test_a_fleet_file_with_a_repeated_key_or_deep_nesting_is_one_line(
        tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(text)
    with pytest.raises(FleetError, match=message) as info:
        load_fleet(path)
    assert "\n" not in str(info.value)


def test_yaml_merge_keys_are_no_duplicates(tmp_path: Path) -> None:
    # `<<: *anchor` was refused as YAML the strict loader could not construct (a regression of
    # the duplicate-key check): explicit keys override the merged ones, as YAML says.
    path = tmp_path / "f.yaml"
    path.write_text(
        "regions: {a: {}}\n"
        "replicas:\n"
        "  - &base {name: r0, region: a, engine: sglang, address: '10.0.0.1:8000'}\n"
        "  - <<: *base\n"
        "    name: r1\n"
        "    address: '10.0.0.2:8000'\n")
    spec = load_fleet(path)
    assert [(r.name, r.address, r.engine) for r in spec.replicas] == [
        ("r0", "10.0.0.1:8000", "sglang"), ("r1", "10.0.0.2:8000", "sglang")]


def test_load_fleet_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(FleetError, match=r"^empty\.yaml: expected a mapping"):
        load_fleet(path)


def test_missing_file_is_a_fleet_error(tmp_path) -> None:
    from gorgo.core.fleet import FleetError, load_fleet

    with pytest.raises(FleetError, match="cannot read fleet file"):
        load_fleet(tmp_path / "absent.yaml")


def test_unknown_keys_of_mixed_types_are_reported() -> None:
    from gorgo.core.fleet import FleetError, parse_fleet

    with pytest.raises(FleetError, match="unknown field"):
        parse_fleet({1: "a", "foo": "b"})


# --- per-model settings (models:) ------------------------------------------------------------


def _with_models(**models: Any) -> dict[str, Any]:
    raw = doc()
    raw["replicas"][0]["models"] = [{"name": "alpha", "aliases": ["a"]}]
    raw["replicas"][1]["models"] = ["beta"]
    raw["weights"] = {"rtt": 2.0}
    raw["models"] = models
    return raw


def test_model_settings_override_the_fleets_key_by_key() -> None:
    spec = parse_fleet(_with_models(alpha={"weights": {"queue": 3.0}, "policy": "least-request"},
                                    beta={"objective": "e2e"}))
    alpha, beta = spec.model_settings
    assert (alpha.policy, alpha.objective) == ("least-request", None)
    assert alpha.weights == Weights({"rtt": 2.0, "queue": 3.0})  # the fleet's rtt, its queue
    assert (beta.policy, beta.objective, beta.weights) == (None, "e2e", Weights({"rtt": 2.0}))
    assert spec.settings_for("a") is alpha and spec.settings_for("gamma") is None
    assert parse_fleet(_with_models(alpha={"policy": "round-robin"})).model_settings[0].weights \
        is None  # a policy alone keeps the live (tuned) weights


@pytest.mark.parametrize(("models", "message"), [
    ({"gamma": {"policy": "gorgo"}},
     r"^fleet\.models\.gamma: no replica serves this model \(served: alpha, beta\)"),
    ({"a": {"policy": "gorgo"}}, r"^fleet\.models\.a: an alias of 'alpha'"),
    ({"alpha": {"policy": "nope"}}, r"^fleet\.models\.alpha\.policy: unknown policy 'nope'"),
    ({"alpha": {"objective": "speed"}}, r"^fleet\.models\.alpha\.objective: must be one of"),
    ({"alpha": {"weights": {"rtt": 1e9}}}, r"^fleet\.models\.alpha\.weights\.rtt: must be <="),
    ({"alpha": {"weights": {"typo": 1}}}, r"^fleet\.models\.alpha\.weights\.typo: unknown"),
    ({"alpha": {"prefix": True}}, r"^fleet\.models\.alpha\.prefix: unknown field"),
    ({"alpha": {}}, r"^fleet\.models\.alpha: set at least one of objective, policy, weights"),
    ({"alpha": "gorgo"}, r"^fleet\.models\.alpha: expected a mapping"),
])
def test_model_settings_errors_name_the_field(models: dict[str, Any], message: str) -> None:
    with pytest.raises(FleetError, match=message):
        parse_fleet(_with_models(**models))


def test_model_settings_need_replicas_that_list_their_models() -> None:
    assert re.match(r"fleet\.models\.alpha: no replica serves this model \(served: none",
                    bad(lambda r: r.update(models={"alpha": {"policy": "gorgo"}})))


@pytest.mark.parametrize(("text", "parsed"), [
    ("127.0.0.1:4317", ("127.0.0.1", 4317)), ("[0:0::1]:80", ("::1", 80)),
    ("otel-collector:4317", ("otel-collector", 4317))])
def test_split_address_reads_a_host_port(text: str, parsed: tuple[str, int]) -> None:
    assert split_address(text) == parsed


@pytest.mark.parametrize("text", ["h:" + "9" * 5000, "h:²", "h:00000065536", "h:-1", "h:"])
def test_split_address_refuses_a_port_that_is_no_plain_number(text: str) -> None:
    """A port of 5,000 digits ended in int's own error ("Exceeds the limit (4300 digits)"), not
    in the one line that names host:port; '²' and a zero-padded 65536 stay refused."""
    with pytest.raises(ValueError, match="expected host:port"):
        split_address(text)



@pytest.mark.parametrize(("value", "expected"), [
    (2, 2.0), (0.5, 0.5), (-3, -3.0), (True, None), ("1", None), (None, None),
    (float("nan"), None), (float("inf"), None), (10**400, None)])
def test_finite_number_is_a_float_or_none_never_an_overflow(value: object,
                                                           expected: float | None) -> None:
    assert finite_number(value) == expected
