"""The rendered bootstrap is what Envoy accepts, in every mode we ship."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from gorgo.core.contract import (
    API_PATHS,
    ATTEMPTS_ATTR,
    CLUSTER_HEADER,
    CONTROL_HEADERS,
    DECISION_FIELDS,
    DECISION_HEADER,
    ENDPOINTS_HEADER,
    HEALTH_PATH,
    PICKER_HEADER,
    PROXY_REGION_ATTR,
    REPLICA_HEADER,
    ROUTER_READS,
    STREAM_HEADER,
)
from gorgo.core.contract import TTFT_ATTR as TTFT_TAG
from gorgo.core.fleet import FleetError, load_fleet, parse_fleet
from gorgo.envoy_config import (
    EXTPROC_CLUSTER,
    FLEET_CLUSTER,
    PICKER_CLUSTER,
    TTFT_FORMAT,
    _duration,
    forwarded_paths,
    render_bootstrap,
    render_yaml,
)
from gorgo.errors import UserError
from gorgo.harness.envoy_proc import envoy_binary

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "envoy" / "fleet.example.yaml"


def _validate(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "envoy.yaml"
    cfg.write_text(text)
    out = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(cfg), "--base-id", "4242"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "deprecated" not in (out.stdout + out.stderr).lower()


# Runs `envoy --mode validate`.
@pytest.mark.envoy
@pytest.mark.parametrize("kwargs", [
    {},
    {"otlp": "127.0.0.1:4317"},
    {"otlp": "collector.example:4317", "picker": True, "extproc": "gorgo:50051"},
])
def test_rendered_bootstrap_passes_envoy_validate(tmp_path: Path, kwargs: dict) -> None:
    _validate(tmp_path, render_yaml(load_fleet(EXAMPLE), **kwargs))


@pytest.mark.slow  # a second or more: out of test-fast
def test_committed_example_is_fresh() -> None:
    committed = (REPO / "envoy" / "envoy.example.yaml").read_text()
    assert committed == render_yaml(load_fleet(EXAMPLE), otlp="127.0.0.1:4317")


def test_bootstrap_shape() -> None:
    spec = load_fleet(EXAMPLE)
    boot = render_bootstrap(spec, otlp="127.0.0.1:4317", picker=True)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    for r in spec.replicas:
        assert r.cluster in clusters
    assert clusters[PICKER_CLUSTER]["type"] == "ORIGINAL_DST"
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.buffer",
                     "envoy.filters.http.router"]
    # Routing headers are never a client's; control headers only a trusted peer's (none here).
    removed = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    assert [m["remove"] for m in removed] == [CLUSTER_HEADER, PICKER_HEADER, ENDPOINTS_HEADER,
                                              STREAM_HEADER]
    assert hcm["route_config"]["internal_only_headers"] == list(CONTROL_HEADERS)
    assert "internal_address_config" not in hcm  # none: loopback and RFC 1918 would be internal
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is True
    assert ext["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert [p["exact"] for p in ext["forward_rules"]["allowed_headers"]["patterns"]] == list(
        ROUTER_READS)
    routes = [r["route"] for r in _routes(hcm)[1:-1]]
    # picker (ORIGINAL_DST) -> endpoint list with one retry -> single cluster -> default, each
    # routed one first for a non-streamed answer, which waits as long as the whole request.
    assert [r.get("cluster", r.get("cluster_header")) for r in routes] == [
        PICKER_CLUSTER, PICKER_CLUSTER, FLEET_CLUSTER, FLEET_CLUSTER, CLUSTER_HEADER,
        CLUSTER_HEADER, spec.default_cluster]
    # First, another method than POST on an inference path: to the fail-open replica, the router
    # not asked (a browser's CORS preflight was a 400 "Request body is empty").
    first = _routes(hcm)[0]
    assert first["match"]["headers"] == [
        {"name": ":method", "string_match": {"exact": "POST"}, "invert_match": True}]
    assert re.compile(first["match"]["safe_regex"]["regex"]).fullmatch("/v1/responses")
    assert not re.compile(first["match"]["safe_regex"]["regex"]).fullmatch("/v1/models")
    assert first["route"]["cluster"] == spec.default_cluster
    assert first["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True
    # HTTP/1.0 (nginx's default upstream protocol), Host-less too (HAProxy's health checks)
    assert hcm["http_protocol_options"] == {"accept_http_10": True,
                                            "default_host_for_http_10": "gorgo"}
    unstreamed = {"name": STREAM_HEADER, "string_match": {"exact": "false"}}
    for k, r in enumerate(_routes(hcm)[1:-2]):
        whole = k % 2 == 0
        assert (unstreamed in r["match"]["headers"]) is whole
        assert r["route"]["idle_timeout"] == (f"{spec.timeouts.request_s:g}s" if whole
                                              else f"{spec.timeouts.idle_s:g}s")
        assert r["route"]["timeout"] == f"{spec.timeouts.request_s:g}s"
    assert routes[2]["retry_policy"] == routes[3]["retry_policy"]
    retry = routes[3]["retry_policy"]
    assert retry["num_retries"] == 1 and retry["retriable_status_codes"] == [503]
    assert "per_try_timeout" not in retry  # a per-try timeout would cut a stream
    fleet = clusters[FLEET_CLUSTER]
    assert len(fleet["load_assignment"]["endpoints"][0]["lb_endpoints"]) == len(spec.replicas)
    assert fleet["circuit_breakers"]["thresholds"][0]["retry_budget"] == {
        "budget_percent": {"value": spec.retries.budget_percent},
        "min_retry_concurrency": spec.retries.min_retry_concurrency}
    tags = {t["tag"]: t.get("value", t.get("literal")) for t in hcm["tracing"]["custom_tags"]}
    assert tags[TTFT_TAG] == TTFT_FORMAT
    assert tags[PROXY_REGION_ATTR] == {"value": spec.proxy_region}  # which proxy, in Jaeger
    assert tags[ATTEMPTS_ATTR] == "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"  # served by a retry
    for key in DECISION_FIELDS:
        assert tags[f"gorgo.{key}"] == f"%DYNAMIC_METADATA(gorgo:{key})%"


def test_the_routers_cluster_takes_a_full_duplex_bodys_frames_and_upe_is_json() -> None:
    # One client's 60 KB body in 1-byte h2 frames (one ext_proc message each in full-duplex)
    # passed Envoy's default 10,000 queued frames towards the router: Envoy closed that
    # connection as a flood and every request on it failed. And Envoy's 502 for an answer it
    # could not parse (UPE) was text/plain.
    boot = render_bootstrap(load_fleet(EXAMPLE), body_mode="full-duplex")
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    options = clusters["gorgo_extproc"]["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    assert options["http2_protocol_options"]["max_outbound_frames"] >= 1_000_000
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    flags = [m["filter"]["response_flag_filter"]["flags"]
             for m in hcm["local_reply_config"]["mappers"] if "response_flag_filter" in m["filter"]]
    assert any("UPE" in f and "UF" in f for f in flags)


def test_retries_off_keeps_single_cluster_routing() -> None:
    spec = load_fleet(EXAMPLE)
    spec = replace(spec, retries=replace(spec.retries, enabled=False))
    boot = render_bootstrap(spec)
    names = [c["name"] for c in boot["static_resources"]["clusters"]]
    assert FLEET_CLUSTER not in names
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    routes = [r["route"] for r in _routes(hcm)[1:-1]]
    assert [r.get("cluster", r.get("cluster_header")) for r in routes] == [
        CLUSTER_HEADER, CLUSTER_HEADER, spec.default_cluster]


@pytest.mark.parametrize("ratio", [1.0, 2.0, 3.0])
def test_replica_clusters_open_connections_ahead_as_the_fleet_says(ratio: float) -> None:
    """Every cluster a request can reach a replica through keeps ``ratio`` connections per open
    stream (one stream per HTTP/1.1 connection: a request that finds none idle waits a handshake,
    a round trip to a far region); 1 renders Envoy's default, nothing; the router's own HTTP/2
    cluster never preconnects."""
    spec = load_fleet(EXAMPLE)
    spec = replace(spec, upstream=replace(spec.upstream, preconnect_ratio=ratio))
    boot = render_bootstrap(spec, picker=True)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    upstream = [*(r.cluster for r in spec.replicas), FLEET_CLUSTER, PICKER_CLUSTER]
    want = {"per_upstream_preconnect_ratio": ratio} if ratio > 1 else None
    assert {n: clusters[n].get("preconnect_policy") for n in upstream} == dict.fromkeys(
        upstream, want)
    assert "preconnect_policy" not in clusters[EXTPROC_CLUSTER]


@pytest.mark.envoy
def test_the_largest_preconnect_ratio_passes_envoy_validate(tmp_path: Path) -> None:
    spec = load_fleet(EXAMPLE)
    spec = replace(spec, upstream=replace(spec.upstream, preconnect_ratio=3.0))
    _validate(tmp_path, render_yaml(spec, picker=True))


def _routes(hcm: dict) -> list[dict]:
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def _hcm(boot: dict) -> dict:
    return boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]


def test_only_the_api_and_the_health_path_are_forwarded() -> None:
    """Every forwarding route matches the same exact paths; the last one answers the rest with
    Envoy's 404, without asking the router (issue 12, finding 1)."""
    spec = load_fleet(EXAMPLE)
    spec = replace(spec, routes=replace(spec.routes, extra_paths=("/v1/embeddings",)))
    assert forwarded_paths(spec) == (*API_PATHS, HEALTH_PATH, "/v1/embeddings")
    _, *forwarding, last = _routes(_hcm(render_bootstrap(spec, picker=True)))  # 1st: not POST
    for r in forwarding:
        regex = re.compile(r["match"]["safe_regex"]["regex"])
        assert [p for p in (*forwarded_paths(spec), "/metrics", "/flush_cache", "/v1/models/x",
                            "/v1/chat/completions/", "/v1/chat/completions/../../metrics",
                            "/v1/modelsX", "/health_generate")
                if regex.fullmatch(p)] == list(forwarded_paths(spec))
    assert last["match"] == {"prefix": "/"} and last["direct_response"]["status"] == 404
    body = json.loads(last["direct_response"]["body"]["inline_string"])
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert last["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True


def test_trusted_peers_keep_control_headers_and_never_routing_headers() -> None:
    spec = load_fleet(EXAMPLE)
    spec = replace(spec, control_headers=replace(
        spec.control_headers, trusted_peers=("10.1.0.0/16", "fd00::/8")))
    boot = render_bootstrap(spec)
    hcm = _hcm(boot)
    # Every client's chain strips them; the trusted peers' own chain (by source address, not
    # Envoy's internal rule, which counts a request with X-Forwarded-For as external) keeps them.
    assert "internal_address_config" not in hcm
    assert hcm["route_config"]["internal_only_headers"] == list(CONTROL_HEADERS)
    every, trusted = boot["static_resources"]["listeners"][0]["filter_chains"]
    assert "filter_chain_match" not in every
    assert trusted["filter_chain_match"] == {"source_prefix_ranges": [
        {"address_prefix": "10.1.0.0", "prefix_len": 16},
        {"address_prefix": "fd00::", "prefix_len": 8}]}
    peer = trusted["filters"][0]["typed_config"]
    assert "internal_only_headers" not in peer["route_config"]
    assert {**peer, "route_config": {}} == {**hcm, "route_config": {}}
    assert {**peer["route_config"], "internal_only_headers": list(CONTROL_HEADERS)} == hcm[
        "route_config"]
    for config in (hcm, peer):  # routing headers from no one
        assert len(config["early_header_mutation_extensions"][0]["typed_config"][
            "mutations"]) == 4


# Runs `envoy --mode validate`.
@pytest.mark.envoy
def test_routes_and_trusted_peers_pass_envoy_validate(tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["routes"] = {"extra_paths": ["/v1/embeddings", "/v1/rerank"]}
    # overlapping ranges, and one named twice (Envoy refused the repeat)
    doc["control_headers"] = {"trusted_peers": ["10.1.0.0/16", "10.0.0.0/8", "::1/128",
                                                "::1"]}
    _validate(tmp_path, render_yaml(parse_fleet(doc), picker=True))


def test_cli_writes_yaml(tmp_path: Path) -> None:
    from gorgo.cli import main

    out = tmp_path / "b.yaml"
    assert main(["envoy-config", str(EXAMPLE), "-o", str(out), "--listen", "127.0.0.1:1"]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["static_resources"]["listeners"][0]["address"]["socket_address"][
        "port_value"] == 1


@pytest.mark.envoy
def test_the_otlp_token_rides_as_grpc_initial_metadata(tmp_path: Path) -> None:
    """The tuner counts no span without its token (issue 12, finding 5): Envoy sends it with every
    export, and the rendered file that holds it is written owner-only."""
    from gorgo.cli import main

    (tmp_path / "otlp-token").write_text("s3cret-token\n")
    out = tmp_path / "envoy.yaml"
    assert main(["envoy-config", str(EXAMPLE), "--otlp", "127.0.0.1:4317", "--otlp-token-file",
                 str(tmp_path / "otlp-token"), "-o", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o600
    doc = yaml.safe_load(out.read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    grpc = hcm["typed_config"]["tracing"]["provider"]["typed_config"]["grpc_service"]
    assert grpc["initial_metadata"] == [{"key": "authorization", "value": "Bearer s3cret-token"}]
    _validate(tmp_path, out.read_text())
    assert "initial_metadata" not in render_yaml(load_fleet(EXAMPLE), otlp="127.0.0.1:4317")


def test_otlp_token_file_errors_are_one_line(tmp_path: Path, capsys) -> None:
    from gorgo.cli import main

    assert main(["envoy-config", str(EXAMPLE), "--otlp-token-file", str(tmp_path / "t")]) == 2
    assert "needs --otlp" in capsys.readouterr().err
    assert main(["envoy-config", str(EXAMPLE), "--otlp", "127.0.0.1:4317",
                 "--otlp-token-file", str(tmp_path / "missing")]) == 2
    assert "cannot read the OTLP token" in capsys.readouterr().err
    (tmp_path / "spaced").write_text("s3cret token\n")  # the tuner refuses it too
    assert main(["envoy-config", str(EXAMPLE), "--otlp", "127.0.0.1:4317",
                 "--otlp-token-file", str(tmp_path / "spaced")]) == 2
    assert "printable ASCII without spaces" in capsys.readouterr().err


def _skip_spec():
    doc = yaml.safe_load(EXAMPLE.read_text())
    return parse_fleet({**doc, "extproc": {"response_headers": "skip"}})


def test_skip_mode_renders_skip_outlier_detection_and_metadata_tags() -> None:
    boot = render_bootstrap(_skip_spec())
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    mode = hcm["http_filters"][0]["typed_config"]["processing_mode"]
    assert mode["response_header_mode"] == "SKIP"
    tags = {h["header"]["key"]: h["header"]["value"]
            for h in hcm["route_config"]["virtual_hosts"][0]["response_headers_to_add"]}
    assert tags == {REPLICA_HEADER: "%DYNAMIC_METADATA(gorgo:replica)%",
                    DECISION_HEADER: "%DYNAMIC_METADATA(gorgo:decision_id)%"}
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    spec = _skip_spec()
    for name in [r.cluster for r in spec.replicas] + [FLEET_CLUSTER]:
        assert clusters[name]["outlier_detection"]["consecutive_5xx"] > 0, name
    assert "outlier_detection" not in clusters[EXTPROC_CLUSTER]
    # The default keeps the round trip: the router reads the status and tags the response.
    default = render_bootstrap(load_fleet(EXAMPLE))
    assert '"response_header_mode": "SEND"' in json.dumps(default["static_resources"])
    assert "outlier_detection" not in json.dumps(default["static_resources"]["clusters"])


def test_several_extproc_workers_are_endpoints_with_health_checks() -> None:
    boot = render_bootstrap(load_fleet(EXAMPLE), extproc="127.0.0.1:50051, 127.0.0.1:50052")
    c = {c["name"]: c for c in boot["static_resources"]["clusters"]}[EXTPROC_CLUSTER]
    eps = [e["endpoint"]["address"]["socket_address"]
           for e in c["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert [(a["address"], a["port_value"]) for a in eps] == [("127.0.0.1", 50051),
                                                              ("127.0.0.1", 50052)]
    assert c["lb_policy"] == "ROUND_ROBIN" and c["health_checks"]


def test_unknown_response_header_mode_names_the_field() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    with pytest.raises(ValueError, match=r"extproc\.response_headers"):
        parse_fleet({**doc, "extproc": {"response_headers": "drop"}})


# Runs `envoy --mode validate`.
@pytest.mark.envoy
def test_skip_mode_with_workers_passes_envoy_validate(tmp_path: Path) -> None:
    _validate(tmp_path, render_yaml(_skip_spec(), extproc="127.0.0.1:50051,127.0.0.1:50052"))


# Runs `envoy --mode validate`: the one-message mode with every routing header it can set.
@pytest.mark.envoy
def test_skipped_request_headers_with_picker_and_retries_pass_envoy_validate(
        tmp_path: Path) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = parse_fleet({**doc, "retries": {"enabled": True},
                        "extproc": {"request_headers": "skip", "response_headers": "skip"}})
    _validate(tmp_path, render_yaml(spec, picker=True, otlp="127.0.0.1:4317"))


@pytest.mark.parametrize("request_headers", ["send", "skip"])
def test_the_picker_endpoint_reaches_envoy_in_every_mode(request_headers: str) -> None:
    # With the request headers skipped Envoy sets the picker header from the body answer's
    # metadata, kept only from the namespaces it receives: it served the cluster's choice.
    from gorgo.core.contract import PICKER_NAMESPACE

    doc = yaml.safe_load(EXAMPLE.read_text())
    spec = parse_fleet({**doc, "extproc": {"request_headers": request_headers,
                                           "response_headers": "skip"}})
    hcm = _hcm(render_bootstrap(spec, picker=True))
    ext = hcm["http_filters"][0]["typed_config"]
    received = ext["metadata_options"]["receiving_namespaces"]["untyped"]
    assert (PICKER_NAMESPACE in received) is (request_headers == "skip")


def test_the_picker_cluster_has_the_replica_clusters_thresholds() -> None:
    # Envoy's defaults (1,024 requests) queued the 1,025th concurrent stream of the fleet.
    boot = render_bootstrap(load_fleet(EXAMPLE), picker=True)
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    (limits,) = clusters[PICKER_CLUSTER]["circuit_breakers"]["thresholds"]
    assert limits["max_requests"] == limits["max_pending_requests"] == 100000


# Runs `envoy --mode validate`.
@pytest.mark.envoy
def test_the_ttft_log_goes_to_the_tuner_with_the_token(tmp_path: Path) -> None:
    """Issue 18: with a tuner, open streams' first-token times go over OTLP logs, authenticated
    like the spans, flushed at the fleet's interval; the file access log keeps one line a
    request; interval 0 turns the TTFT log off."""
    from gorgo.core.contract import LOG_TYPE_ATTR, TTFT_ATTR, TTFT_LOG_NAME

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["observability"] = {"access_log": True, "ttft_log_interval_s": 0.25}
    spec = parse_fleet(doc)
    hcm = _hcm(render_bootstrap(spec, otlp="127.0.0.1:4317", otlp_token="s3cret"))
    assert hcm["access_log_options"] == {"access_log_flush_interval": "0.25s"}
    file_log, ttft_log = hcm["access_log"]
    assert file_log["filter"]["log_type_filter"]["exclude"] is True
    cfg = ttft_log["typed_config"]
    assert cfg["log_name"] == TTFT_LOG_NAME
    assert cfg["grpc_service"] == hcm["tracing"]["provider"]["typed_config"]["grpc_service"]
    assert {"key": "authorization", "value": "Bearer s3cret"} in (
        cfg["grpc_service"]["initial_metadata"])
    keys = {a["key"] for a in cfg["attributes"]["values"]}
    assert {TTFT_ATTR, LOG_TYPE_ATTR, "gorgo.decision_id", "gorgo.weights_version",
            "gorgo.replica", "gorgo.policy"} <= keys
    _validate(tmp_path, render_yaml(spec, otlp="127.0.0.1:4317", otlp_token="s3cret"))
    doc["observability"] = {"ttft_log_interval_s": 0}
    off = _hcm(render_bootstrap(parse_fleet(doc), otlp="127.0.0.1:4317"))
    assert "access_log" not in off and "access_log_options" not in off
    assert len(_hcm(render_bootstrap(spec))["access_log"]) == 1  # no tuner, no TTFT log


def test_envoys_own_timeouts_and_the_fail_open_body_limit_answer_as_the_api_does() -> None:
    """A 504 of Envoy's timeouts carries the OpenAI-style error the router's answers carry, and
    the body limit holds while the router is down (buffered mode; full duplex must not hold)."""
    spec = load_fleet(EXAMPLE)
    hcm = render_bootstrap(spec)["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"][0]["typed_config"]
    mappers = hcm["local_reply_config"]["mappers"]
    timeout = [m for m in mappers
               if m["filter"].get("response_flag_filter", {}).get("flags") == ["UT", "SI"]]
    assert len(timeout) == 1
    body = timeout[0]["body_format_override"]["text_format_source"]["inline_string"]
    assert json.loads(body)["error"]["code"] == "timeout"
    buffer = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.buffer")
    assert buffer["typed_config"]["max_request_bytes"] == spec.limits.max_body_bytes
    duplex = render_bootstrap(spec, body_mode="full-duplex")["static_resources"]["listeners"][0][
        "filter_chains"][0]["filters"][0]["typed_config"]
    assert "envoy.filters.http.buffer" not in [f["name"] for f in duplex["http_filters"]]


@pytest.mark.parametrize(("trailers", "duplex_mode"), [(None, "SKIP"), ("skip", "SKIP"),
                                                       ("send", "SEND")])
def test_the_response_trailers_are_the_operators_choice(trailers: str | None,
                                                         duplex_mode: str) -> None:
    """Sent, a full-duplex answer depends on the router until it ends (a dead router cut every
    answer streaming through it); skipped, the booking ends at the response headers."""
    raw = yaml.safe_load(EXAMPLE.read_text())
    if trailers is not None:
        raw["extproc"] = {"response_trailers": trailers}
    spec = parse_fleet(raw)

    def mode(body_mode: str) -> dict:
        hcm = render_bootstrap(spec, body_mode=body_mode)["static_resources"]["listeners"][0][
            "filter_chains"][0]["filters"][0]["typed_config"]
        ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        return ext["typed_config"]["processing_mode"]
    assert mode("full-duplex")["response_trailer_mode"] == duplex_mode
    assert mode("buffered")["response_trailer_mode"] == "SKIP"
    with pytest.raises(FleetError, match=r"extproc\.response_trailers: must be one of"):
        parse_fleet({**raw, "extproc": {"response_trailers": "always"}})


def test_ipv6_hosts_reach_envoy_without_their_brackets() -> None:
    # Kept, Envoy refused the file ("malformed IP address: [::1]"), or took the replica for a
    # DNS name: every request a 503; `--extproc '[::1]:P'` skipped the router for every request.
    spec = parse_fleet({"regions": {"a": {}}, "replicas": [
        {"name": "r0", "region": "a", "engine": "sglang", "address": "[::1]:8000"},
        {"name": "r1", "region": "a", "engine": "sglang", "address": "[::1]:8001"}]})
    boot = render_bootstrap(spec, listen="[::1]:10000", extproc="[::1]:50051",
                            admin="[::1]:9901", otlp="[::1]:4317")
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    for name, port in (("r0", 8000), ("gorgo_extproc", 50051), ("otel_collector", 4317)):
        c = clusters[name]
        assert c["type"] == "STATIC", name
        (endpoint,) = c["load_assignment"]["endpoints"][0]["lb_endpoints"]
        assert endpoint["endpoint"]["address"]["socket_address"] == {
            "address": "::1", "port_value": port}
    listener = boot["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["address"] == "::1"
    assert boot["admin"]["address"]["socket_address"]["address"] == "::1"
    with pytest.raises(UserError, match="brackets"):
        render_bootstrap(spec, listen="[::1:10000", extproc="127.0.0.1:1", admin="127.0.0.1:2")


@pytest.mark.parametrize(("seconds", "text"), [
    (600.0, "600s"), (0.25, "0.25s"), (0, "0s"), (1_000_000, "1000000s"), (1234567, "1234567s"),
    (1e-7, "0.0000001s"), (86400.5, "86400.5s")])
def test_durations_are_written_in_fixed_point(seconds: float, text: str) -> None:
    # {:g} wrote 1e+06s and 1.23457e+06s (rounded), which Envoy refused or misread
    assert _duration(seconds) == text
