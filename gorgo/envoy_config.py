"""`gorgo envoy-config`: render a complete Envoy bootstrap for a fleet file.

The bootstrap is plain data built from the fleet spec; `render_yaml` converts it through
envoy-data-plane's typed classes (gorgo/envoy_typed.py), so a wrong field or type fails here with
its path, and the tests still run `envoy --mode validate` on every rendered shape. Request path:
listener (a client's routing headers are removed, so it cannot pick a cluster, and its control
headers too unless the fleet trusts its address) -> ext_proc (gets only the headers the router
reads; sets x-gorgo-cluster, clears the route cache, publishes the decision as dynamic metadata) ->
router. Only the inference API, the health path and the fleet's extra paths are routed; any other
path is Envoy's 404. If the ext_proc server is down or slow, the filter fails open and the fallback
route sends the request to the default cluster. With retries on, ext_proc also names the chosen and
the next-best replica in x-gorgo-endpoints; that route goes to one cluster of every replica whose
override-host policy sends the first attempt to the first address and the one retry to the second
(see docs/reliability.md). Span path: Envoy's OpenTelemetry tracer puts the first byte's time and
every gorgo.* decision and request field on the request's span (docs/observability.md); the fleet's
observability.access_log adds one JSON access-log line per request. With ``--body-mode
full-duplex`` the body streams to the router; Envoy then applies no per-message timeout, and fails
open only once a health check has marked the router down (see EXTPROC_HEALTH_INTERVAL).
"""

from __future__ import annotations

import argparse
import copy
import ipaddress
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from gorgo.core.contract import (
    API_PATHS,
    ATTEMPTS_ATTR,
    ATTEMPTS_FORMAT,
    BODY_PATHS,
    CLUSTER_FIELD,
    CLUSTER_HEADER,
    CONTROL_HEADERS,
    DECISION_FIELDS,
    DECISION_HEADER,
    ENDPOINTS_FIELD,
    ENDPOINTS_HEADER,
    EXTPROC_CLUSTER,
    FLEET_CLUSTER,
    HEALTH_PATH,
    LIVE_SERVICE,
    LOG_END,
    LOG_PERIODIC,
    LOG_TYPE_ATTR,
    METADATA_NAMESPACE,
    OTLP_CLUSTER,
    PICKER_CLUSTER,
    PICKER_HEADER,
    PICKER_NAMESPACE,
    PROXY_REGION_ATTR,
    REPLICA_HEADER,
    REQUEST_ATTRIBUTES,
    REQUEST_FIELDS,
    ROUTER_READS,
    SPAN_PREFIX,
    STATUS_ATTR,
    STREAM_FIELD,
    STREAM_HEADER,
    TTFT_ATTR,
    TTFT_LOG_NAME,
    UPLOAD_ATTR,
    UPLOAD_FORMAT,
)
from gorgo.core.discovery import dns_sources, refuse_clusters_file
from gorgo.core.fleet import FleetSpec, load_fleet, read_fleet, split_address, unbracketed
from gorgo.envoy_typed import check_bootstrap
from gorgo.errors import UserError, header_token

_T = "type.googleapis.com/"
# Only failures before any response byte: Envoy never retries once headers went downstream.
RETRY_ON = "connect-failure,reset,refused-stream,retriable-status-codes"
RETRY_STATUS_CODES = (503,)
TTFT_FORMAT = "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%"
# The access log's line (fleet observability.access_log): where the request went and how it went,
# keyed by the decision id the client got in x-gorgo-decision-id; never the prompt or the query.
ACCESS_LOG_FORMAT = {
    "start_time": "%START_TIME%",
    **{k: f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{k})%"
       for k in ("decision_id", "replica", "region", "policy", "model", "stream")},
    "method": "%REQ(:METHOD)%",
    "path": "%REQ_WITHOUT_QUERY(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "first_byte_us": TTFT_FORMAT,
    "duration_ms": "%DURATION%",
    "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
    "upstream_host": "%UPSTREAM_HOST%",
    "trace_id": "%TRACE_ID%",
    "request_id": "%REQ(X-REQUEST-ID)%",
}
TOO_LARGE_BODY = (
    '{"error":{"message":"Request body too large.","type":"invalid_request_error",'
    '"param":null,"code":"request_too_large"}}'
)
TIMEOUT_BODY = (
    '{"error":{"message":"The request timed out at the proxy (timeouts.request_s, or no byte '
    'either way for timeouts.idle_s).","type":"server_error","param":null,"code":"timeout"}}'
)
TOO_MANY_HEADERS_BODY = (
    '{"error":{"message":"Too many request headers.","type":"invalid_request_error",'
    '"param":null,"code":"request_header_fields_too_large"}}'
)
# Envoy's codec refusing a request that is not valid HTTP (a control character in a header, two
# content-lengths, an unknown method): its details name the codec. The router's own 400s keep
# their bodies.
# Any status the codec picks (a 400, a 501 for `Transfer-Encoding: gzip, chunked`), and Envoy's
# 403 for an `Upgrade: websocket` it does not forward (text/plain and an empty body before).
BAD_HTTP_BODY = (
    '{"error":{"message":"The request is not valid HTTP, or not served here '
    '(%RESPONSE_CODE_DETAILS%).","type":"invalid_request_error","param":null,'
    '"code":"bad_request"}}'
)
BAD_HTTP_FILTER = ("(response.code >= 400 && (response.code_details.startsWith('http1.') || "
                   "response.code_details.startsWith('http2.'))) || "
                   "response.code_details == 'upgrade_failed' || "
                   # a path Envoy will not normalise: a `#fragment` (RFC 3986 keeps it client-side)
                   "response.code_details == 'path_normalization_failed'")
# Envoy's response code details when a header mutation (the router's routing headers) would take
# the request past max_headers_count.
HEADERS_FULL_DETAILS = "header_mutation_result_exceeds_limit"
NOT_FOUND_BODY = (
    '{"error":{"message":"Unknown path; this gateway serves the OpenAI-style inference API.",'
    '"type":"invalid_request_error","param":null,"code":"not_found"}}'
)
UPSTREAM_FAILED_BODY = (
    '{"error":{"message":"The replica failed to answer; retry later.",'
    '"type":"server_error","param":null,"code":"upstream_unavailable"}}'
)
# Request body modes of the ext_proc filter: BUFFERED (one body message), or FULL_DUPLEX_STREAMED,
# which the Gateway API Inference Extension's endpoint-picker protocol uses.
BODY_MODES = {"buffered": "BUFFERED", "full-duplex": "FULL_DUPLEX_STREAMED"}
# Envoy hands a full-duplex body to the router as it arrives and cannot take it back, so it ignores
# failure_mode_allow once a body chunk is sent: a dead router fails requests instead. A gRPC health
# check of the router's LIVE_SERVICE takes out a router that is dead, hung (a TCP connect alone
# still succeeds to a stopped process) or draining after a stop signal, first (panic routing off),
# and Envoy then skips ext_proc.
EXTPROC_HEALTH_INTERVAL = "1s"
# With the response-headers round trip skipped (fleet extproc.response_headers: skip), Envoy tags
# the response from the decision's metadata (an unrouted answer has none and gets no header), and
# outlier detection ejects a replica after consecutive 5xx; the router reads each replica's errors
# and ejections from the admin API (extproc/envoy_admin.py). In a one-replica cluster an ejection
# only marks the host (panic routing keeps it): the router is what moves traffic away.
TAG_FROM_METADATA = [
    {"header": {"key": header, "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{field})%"},
     "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
    for header, field in ((REPLICA_HEADER, "replica"), (DECISION_HEADER, "decision_id"))
]


def _routing_from_metadata(spec: FleetSpec, picker: bool) -> list[dict]:
    """The filters between ext_proc and the router when the request-headers message is skipped
    (fleet extproc.request_headers: skip). The ext_proc filter then lets the headers through at
    once, and Envoy 1.40 applies no header mutation of a body answer, so a buffer filter holds
    the headers until the body is answered and a header-mutation filter sets the routing headers
    from the decision's metadata; an unrouted request has none and takes the default route. A
    request without a body (a GET) would send the router nothing: its route still sends the
    headers (`_routes`)."""
    headers = [(CLUSTER_HEADER, METADATA_NAMESPACE, CLUSTER_FIELD),
               (STREAM_HEADER, METADATA_NAMESPACE, STREAM_FIELD)]
    if spec.retries.enabled:
        headers.append((ENDPOINTS_HEADER, METADATA_NAMESPACE, ENDPOINTS_FIELD))
    if picker:
        headers.append((PICKER_HEADER, PICKER_NAMESPACE, PICKER_HEADER))
    return [{
        "name": "envoy.filters.http.buffer",
        "typed_config": {"@type": _T + "envoy.extensions.filters.http.buffer.v3.Buffer",
                         # also the body limit while the router is down (`render_bootstrap`)
                         "max_request_bytes": spec.limits.max_body_bytes},
    }, {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"append": {
                "header": {"key": h, "value": f"%DYNAMIC_METADATA({ns}:{field})%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}} for h, ns, field in headers]},
        },
    }]


OUTLIER_DETECTION = {
    "consecutive_5xx": 5, "interval": "1s", "base_ejection_time": "10s",
    "max_ejection_percent": 100,
}
# Envoy's own 503s for a failed upstream (connect failure, no host, reset, retries exhausted),
# and its 502 for an answer it could not parse (UPE, text/plain before); the router's immediate
# 503 (no_healthy_replica) carries none of these flags and keeps its body.
UPSTREAM_FAILURE_FLAGS = ("UF", "UH", "UR", "UC", "URX", "UPE")
# HTTP/2 frames Envoy may queue towards the router on one connection. In full-duplex mode each
# DATA frame of a client's body is one ext_proc message: one client sending a 60 KB body in
# 1-byte frames passed Envoy's default 10,000, Envoy closed the connection as a flood, and every
# other request on it failed (failure_mode_allow does not apply once body bytes were streamed).
EXTPROC_MAX_OUTBOUND_FRAMES = 2_000_000
TIMEOUT_FLAGS = ("UT", "SI")  # upstream request timeout, stream idle timeout


def _hostport(value: str, flag: str) -> tuple[str, int]:
    """HOST:PORT as Envoy's socket address takes it: an IPv6 host without its brackets (kept,
    Envoy refused the file, or `--extproc '[::1]:P'` skipped the router for every request).
    Never a URL: `--extproc http://127.0.0.1:P` rendered a DNS cluster of host "http://127.0.0.1"
    that nothing resolves, so every request skipped the router (failure_mode_allow)."""
    try:
        return split_address(value, lowest_port=0)
    except ValueError as exc:
        raise UserError(f"{flag}: {exc}") from None


def _duration(seconds: float) -> str:
    """Seconds as Envoy's Duration text, in fixed point (``{:g}`` wrote 1e+06s for a request
    timeout of 1,000,000 s, which Envoy refused naming its own field, not the fleet's)."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def _cluster(name: str, addresses: list[tuple[str, int]], connect_ms: int,
             http2: bool = False, http2_options: dict | None = None,
             preconnect_ratio: float = 1.0) -> dict:
    """A round-robin cluster of ``addresses`` (one replica; or every `gorgo extproc` worker)."""
    try:
        for host, _ in addresses:
            ipaddress.ip_address(host)
        kind = "STATIC"
    except ValueError:
        kind = "STRICT_DNS"  # resolved by name; IPv4 first, as most container networks are
    c: dict[str, Any] = {
        "name": name,
        "type": kind,
        "connect_timeout": _duration(connect_ms / 1000),
        "lb_policy": "ROUND_ROBIN",
        **({"dns_lookup_family": "V4_PREFERRED"} if kind == "STRICT_DNS" else {}),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": host, "port_value": port}}}}
                for host, port in addresses]}],
        },
        "circuit_breakers": _circuit_breakers(max_retries=100),
        **_preconnect(preconnect_ratio),
    }
    if http2:
        c["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": http2_options or {}},
            }
        }
    return c


def _preconnect(ratio: float) -> dict:
    """A replica cluster's connections opened ahead of the requests (fleet `upstream`): one
    stream per HTTP/1.1 connection, so a request that finds none idle pays a handshake, a
    round trip to its region; nothing at 1, Envoy's default."""
    return {"preconnect_policy": {"per_upstream_preconnect_ratio": ratio}} if ratio > 1 else {}


def _circuit_breakers(**extra: Any) -> dict:
    """Every cluster's thresholds, far above Envoy's defaults (1,024 connections, pending and
    active requests: LLM streams last seconds to minutes), plus ``extra``."""
    return {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                            "max_requests": 100000, **extra}]}


def _cidr(cidr: str) -> dict:
    net = ipaddress.ip_network(cidr)
    return {"address_prefix": str(net.network_address), "prefix_len": net.prefixlen}


def _lb_policy(name: str, typed: str, **config: Any) -> dict:
    return {"policies": [{"typed_extension_config": {
        "name": f"envoy.load_balancing_policies.{name}",
        "typed_config": {"@type": f"{_T}envoy.extensions.load_balancing_policies.{typed}",
                         **config},
    }}]}


def _fleet_cluster(spec: FleetSpec) -> dict:
    """Every replica in one cluster, the host picked by the override-host policy from the
    x-gorgo-endpoints list (attempt k goes to the k-th address); round robin only if the list
    names no known endpoint. The retry budget caps retries in flight at ``budget_percent`` of
    active requests, so a fleet-wide outage cannot multiply the load."""
    r = spec.retries
    endpoints = [{"endpoint": {"address": {"socket_address": {
        "address": unbracketed(rep.host), "port_value": rep.port}}}}
        for rep in spec.replicas]
    return {
        "name": FLEET_CLUSTER,
        "type": "STATIC",
        "connect_timeout": _duration(spec.timeouts.connect_ms / 1000),
        "load_assignment": {"cluster_name": FLEET_CLUSTER,
                            "endpoints": [{"lb_endpoints": endpoints}]},
        "load_balancing_policy": _lb_policy(
            "override_host", "override_host.v3.OverrideHost",
            override_host_sources=[{"header": ENDPOINTS_HEADER}],
            fallback_policy=_lb_policy("round_robin", "round_robin.v3.RoundRobin"),
        ),
        "circuit_breakers": _circuit_breakers(
            retry_budget={"budget_percent": {"value": r.budget_percent},
                          "min_retry_concurrency": r.min_retry_concurrency}),
        **_preconnect(spec.upstream.preconnect_ratio),
    }


def forwarded_paths(spec: FleetSpec) -> tuple[str, ...]:
    """The exact paths Envoy forwards to a replica: the API, the health path, the fleet's extras."""
    return (*API_PATHS, HEALTH_PATH, *spec.routes.extra_paths)


def _routes(spec: FleetSpec, picker: bool) -> list[dict]:
    t = spec.timeouts
    limits = {"timeout": _duration(t.request_s), "idle_timeout": _duration(t.idle_s)}
    # RE2 full match on the path without its query: /v1/models/../../metrics or /metrics%2f do
    # not match, and fleet paths are plain unreserved characters (checked by the fleet schema).
    paths = {"safe_regex": {"regex": "|".join(re.escape(p) for p in forwarded_paths(spec))}}

    def on(header: str | None) -> dict:
        present = [{"name": header, "present_match": True}] if header else []
        return {**paths, **({"headers": present} if present else {})}

    def routed(header: str, action: dict) -> list[dict]:
        """A route the router's header selects, first for a non-streamed answer: it sends no
        byte until it is whole, so only the request timeout bounds its wait (with idle_s, an
        answer longer to make than that was cut at idle_s)."""
        whole = on(header)
        whole["headers"].append({"name": STREAM_HEADER, "string_match": {"exact": "false"}})
        return [{"match": whole, "route": {**action, **limits,
                                           "idle_timeout": _duration(t.request_s)},
                 "typed_per_filter_config": ROUTER_ON},
                {"match": on(header), "route": {**action, **limits},
                 "typed_per_filter_config": ROUTER_ON}]

    # Another method than POST on an inference path (a browser's CORS preflight, a GET) has no
    # body to route by: the fail-open replica answers it as an engine would (its CORS headers, its
    # 405), the router not asked (it answered 400 "Request body is empty", so every browser app
    # calling the engines broke behind GORGO).
    not_post = {"name": ":method", "string_match": {"exact": "POST"}, "invert_match": True}
    bodies = "|".join(re.escape(p) for p in BODY_PATHS)
    routes: list[dict[str, Any]] = [{
        "match": {"safe_regex": {"regex": bodies}, "headers": [not_post]},
        "route": {"cluster": spec.default_cluster, **limits},
        "typed_per_filter_config": _extproc_per_route({"disabled": True}),
    }]
    if picker:
        routes += routed(PICKER_HEADER, {"cluster": PICKER_CLUSTER})
    if spec.retries.enabled:
        # No per-try timeout: an attempt is a whole streamed answer, and a timeout must not cut
        # a stream (Envoy never retries after response bytes went downstream anyway).
        routes += routed(ENDPOINTS_HEADER, {"cluster": FLEET_CLUSTER, "retry_policy": {
            "retry_on": RETRY_ON, "num_retries": 1,
            "retriable_status_codes": list(RETRY_STATUS_CODES),
        }})
    routes += routed(CLUSTER_HEADER, {"cluster_header": CLUSTER_HEADER})
    if spec.extproc.skip_request_headers:
        # Requests other than POSTs (a GET of /v1/models or /health has no body) are matched
        # here before they are routed, and still send their headers to the router.
        mode = _processing_mode(spec, "buffered", request_headers=True)
        routes.append({
            "match": {**paths, "headers": [not_post]},
            "route": {"cluster": spec.default_cluster, **limits},
            "typed_per_filter_config": _extproc_per_route({"overrides": {"processing_mode": mode}}),
        })
    # The route every forwarded request first matches: the router is asked here. A request
    # still on it after the router failed it open (down, past its message timeout) may be a
    # non-streamed answer, which sends no byte until it is whole: only the request timeout
    # bounds it (with idle_s, such an answer was cut by a 504; a stalled stream on this route
    # now waits as long).
    routes.append({"match": on(None),
                   "route": {"cluster": spec.default_cluster, **limits,
                             "idle_timeout": _duration(t.request_s)},
                   "typed_per_filter_config": ROUTER_ON})
    # Everything else is Envoy's own 404, decided before the router is asked (ext_proc off).
    routes.append({
        "match": {"prefix": "/"},
        "direct_response": {"status": 404, "body": {"inline_string": NOT_FOUND_BODY}},
        "response_headers_to_add": [{
            "header": {"key": "content-type", "value": "application/json"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "typed_per_filter_config": _extproc_per_route({"disabled": True}),
    })
    return routes


def _extproc_per_route(settings: dict[str, Any]) -> dict[str, Any]:
    """A route's own ext_proc settings (off, on, or on in another processing mode): the filter
    is off by default, and any setting but ``disabled`` turns it on."""
    return {"envoy.filters.http.ext_proc": {
        "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute", **settings}}


ROUTER_ON = _extproc_per_route({"overrides": {}})


def _otlp_service(token: str | None) -> dict:
    """The gRPC service of every OTLP export (spans and the TTFT log); ``token``: the tuner's
    OTLP bearer token, sent as initial metadata with every export (the tuner counts nothing
    without it)."""
    return {
        "envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "1s",
        **({"initial_metadata": [{"key": "authorization", "value": f"Bearer {token}"}]}
           if token else {}),
    }


def _tracing(otlp: str | None, service_name: str, token: str | None,
             proxy_region: str) -> dict | None:
    """Envoy's span per request: the first-token time, the decision's fields and the proxy's
    region (several proxies, one per region, export to the same collector). Every request is
    sampled, whatever its client's `traceparent` says: Envoy follows a parent's "not sampled"
    flag (OpenTelemetry SDKs with a ratio sampler send it on most requests) unless a sampler is
    set, and the tuner needs every routed request's span (its windows waited for them)."""
    if otlp is None:
        return None
    tags: list[dict[str, Any]] = [{"tag": TTFT_ATTR, "value": TTFT_FORMAT},
                                  {"tag": UPLOAD_ATTR, "value": UPLOAD_FORMAT},
                                  {"tag": ATTEMPTS_ATTR, "value": ATTEMPTS_FORMAT},
                                  {"tag": PROXY_REGION_ATTR, "literal": {"value": proxy_region}}]
    tags += [{"tag": f"{SPAN_PREFIX}{k}", "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{k})%"}
             for k in (*DECISION_FIELDS, *REQUEST_FIELDS)]
    return {
        "random_sampling": {"value": 100},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": _T + "envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": _otlp_service(token),
                "service_name": service_name,
                "sampler": {
                    "name": "envoy.tracers.opentelemetry.samplers.always_on",
                    "typed_config": {"@type": _T + "envoy.extensions.tracers.opentelemetry"
                                     ".samplers.v3.AlwaysOnSamplerConfig"},
                },
            },
        },
        "custom_tags": tags,
    }


def _log_type_filter(*types: str, exclude: bool = False) -> dict:
    return {"log_type_filter": {"types": list(types), **({"exclude": True} if exclude else {})}}


def _ttft_log(token: str | None) -> dict:
    """The first-token time of open streams, to the tuner over OTLP logs: the periodic entries
    (``access_log_flush_interval``) and the end entry, only once the response has started (a
    status is set; its first body byte follows at once for a stream) and only for a decision.
    Envoy cannot tell whether an earlier entry of the stream already carried the TTFT, so each
    open stream sends one entry per interval; the tuner counts its decision's TTFT once."""
    attrs = {TTFT_ATTR: TTFT_FORMAT, UPLOAD_ATTR: UPLOAD_FORMAT, STATUS_ATTR: "%RESPONSE_CODE%",
             ATTEMPTS_ATTR: ATTEMPTS_FORMAT, LOG_TYPE_ATTR: "%ACCESS_LOG_TYPE%",
             **{f"{SPAN_PREFIX}{k}": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:{k})%"
                for k in DECISION_FIELDS}}
    return {
        "name": "envoy.access_loggers.open_telemetry",
        "filter": {"and_filter": {"filters": [
            _log_type_filter(LOG_PERIODIC, LOG_END),
            {"status_code_filter": {"comparison": {
                "op": "GE", "value": {"default_value": 100, "runtime_key": "gorgo.ttft_log"}}}},
            {"metadata_filter": {"matcher": {
                "filter": METADATA_NAMESPACE, "path": [{"key": "decision_id"}],
                "value": {"present_match": True}}}},
        ]}},
        "typed_config": {
            "@type": _T + "envoy.extensions.access_loggers.open_telemetry.v3."
            "OpenTelemetryAccessLogConfig",
            "grpc_service": _otlp_service(token),
            "log_name": TTFT_LOG_NAME,
            "body": {"string_value": TTFT_LOG_NAME},
            "attributes": {"values": [{"key": k, "value": {"string_value": v}}
                                      for k, v in attrs.items()]},
        },
    }


def _access_log(path: str) -> dict:
    """One line per request: never the periodic entries of the TTFT log's flush interval."""
    return {
        "name": "envoy.access_loggers.file",
        "filter": _log_type_filter(LOG_PERIODIC, exclude=True),
        "typed_config": {
            "@type": _T + "envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": path,
            "log_format": {"json_format": ACCESS_LOG_FORMAT, "formatters": [{
                "name": "envoy.formatter.req_without_query",
                "typed_config": {"@type": _T + "envoy.extensions.formatter.req_without_query.v3."
                                 "ReqWithoutQuery"},
            }]},
        },
    }


def _processing_mode(spec: FleetSpec, body_mode: str, *, request_headers: bool) -> dict[str, str]:
    duplex = body_mode == "full-duplex"
    return {
        "request_header_mode": "SEND" if request_headers else "SKIP",
        "request_body_mode": BODY_MODES[body_mode],
        "response_header_mode": "SKIP" if spec.extproc.skip_response_headers else "SEND",
        "response_body_mode": "NONE",
        # Envoy requires the request trailers to be sent in full-duplex mode. In that mode it
        # also closes the router's stream once nothing more can be sent to it: with the response
        # trailers skipped, at the response headers, while the answer still streams (the router
        # holds a streamed answer's booking for its predicted decoding: released there, 9
        # concurrent streams all went to one replica). Sent (`extproc.response_trailers:
        # send`), the stream and the booking last as long as the response, and the answer fails
        # if the router dies before it ends (3 of 3 streaming answers cut by a SIGKILL), so
        # that is the operator's choice, not the default.
        "request_trailer_mode": "SEND" if duplex else "SKIP",
        "response_trailer_mode": "SEND" if duplex and spec.extproc.response_trailers == "send"
                                 else "SKIP",
    }


def render_bootstrap(
    spec: FleetSpec,
    *,
    listen: str = "0.0.0.0:10000",
    extproc: str = "127.0.0.1:50051",
    otlp: str | None = None,
    otlp_token: str | None = None,
    admin: str = "127.0.0.1:9901",
    picker: bool = False,
    service_name: str = "gorgo-envoy",
    body_mode: str = "buffered",
    cds: str | None = None,
) -> dict[str, Any]:
    """The bootstrap as a dict; ``picker`` (or the fleet's ``endpoint_picker``) adds the
    endpoint-picker route to an ORIGINAL_DST cluster, the fleet's ``retries`` the retried route
    to the override-host cluster of every replica. ``body_mode`` "full-duplex" streams request
    bodies to the router (FULL_DUPLEX_STREAMED, as an InferencePool's picker is run). With
    ``cds`` (a file path) the replicas' clusters are not in the bootstrap: Envoy loads them from
    that file (`render_cds`) and follows every atomic rewrite of it, without a restart."""
    if body_mode not in BODY_MODES:
        raise ValueError(f"body_mode must be one of {sorted(BODY_MODES)}, not {body_mode!r}")
    duplex = body_mode == "full-duplex"
    skip = spec.extproc.skip_response_headers
    skip_request = spec.extproc.skip_request_headers
    if duplex and skip_request:
        raise UserError("the full-duplex body mode streams the body after the request headers: "
                        "it needs the fleet's extproc.request_headers: send")
    picker = picker or spec.endpoint_picker
    lhost, lport = _hostport(listen, "--listen")
    ahost, aport = _hostport(admin, "--admin")
    t = spec.timeouts
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        # Off unless the route asks for it (`_extproc_per_route`): a request Envoy's codec
        # refuses (a bad header, a bad content-length, a 70 KB header) is answered before any
        # route, and with the filter on every stream its 400 or 431 waited for the router's
        # response-headers call and was never written (an empty reply).
        "disabled": True,
        "typed_config": {
            "@type": _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER},
                             "timeout": _duration(t.connect_ms / 1000)},
            "message_timeout": _duration(t.message_ms / 1000),
            "failure_mode_allow": True,
            # The picker's endpoint travels in its own namespace; with the request headers
            # skipped Envoy sets it from the body answer's metadata, which it keeps only from the
            # namespaces named here (without it the picker route never matched).
            "metadata_options": {"receiving_namespaces": {"untyped": [
                METADATA_NAMESPACE, *([PICKER_NAMESPACE] if picker and skip_request else [])]}},
            # Only what the router reads: never a client's authorization or cookies.
            "forward_rules": {"allowed_headers": {"patterns": [
                {"exact": h} for h in ROUTER_READS]}},
            "processing_mode": _processing_mode(spec, body_mode,
                                                request_headers=not skip_request),
            **({"request_attributes": list(REQUEST_ATTRIBUTES)} if skip_request else {}),
        },
    }
    hcm: dict[str, Any] = {
        "@type": _T + "envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager",
        "stat_prefix": "gorgo_ingress",
        "codec_type": "AUTO",
        # HTTP/1.0 (nginx's default to its upstreams, HAProxy's health checks): refused, its
        # refusal went through the router and the connection closed before it was written
        # (an empty reply) where the engine alone answers it.
        # ... with no Host header too (HAProxy's `option httpchk` sends none): a 400 without it
        "http_protocol_options": {"accept_http_10": True, "default_host_for_http_10": "gorgo"},
        "stream_idle_timeout": _duration(t.idle_s),
        "request_timeout": "0s",
        # Routing headers are set by the router only: a client's copy is dropped before any
        # filter or route sees it.
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _T + "envoy.extensions.http.early_header_mutation.header_mutation.v3."
                "HeaderMutation",
                "mutations": [{"remove": h}
                              for h in (CLUSTER_HEADER, PICKER_HEADER, ENDPOINTS_HEADER,
                                        STREAM_HEADER)],
            },
        }],
        # Control headers (priority, policy) come only from the fleet's trusted peers, which have
        # a filter chain of their own (`_filter_chains`): on this one every client is external
        # (use_remote_address, no internal_address_config: with an empty one, loopback and RFC
        # 1918 peers would be internal) and loses them before any filter.
        "use_remote_address": True,
        "route_config": {
            "name": "gorgo_routes",
            "internal_only_headers": list(CONTROL_HEADERS),
            # The replicas' clusters come from the CDS file, after the routes are loaded.
            **({"validate_clusters": False} if cds else {}),
            # x-envoy-attempt-count on the response tells ext_proc that the retry served it.
            "virtual_hosts": [{"name": "llm", "domains": ["*"], "routes": _routes(spec, picker),
                               "include_attempt_count_in_response": True,
                               **({"response_headers_to_add": TAG_FROM_METADATA} if skip else {})}],
        },
        "http_filters": [ext_proc, *(_routing_from_metadata(spec, picker) if skip_request
                                     else []),
                         # The body limit without the router too: failing open, ext_proc holds
                         # nothing and any body went on to the default replica (a 40 MiB one was
                         # measured). Buffered mode holds the body anyway; full duplex hands it
                         # on in chunks and must not hold it; skipping the request headers has
                         # its own buffer filter above.
                         *([] if duplex or skip_request else [{
                             "name": "envoy.filters.http.buffer",
                             "typed_config": {
                                 "@type": _T + "envoy.extensions.filters.http.buffer.v3.Buffer",
                                 "max_request_bytes": spec.limits.max_body_bytes}}]), {
            "name": "envoy.filters.http.router",
            "typed_config": {
                "@type": _T + "envoy.extensions.filters.http.router.v3.Router"},
        }],
        "local_reply_config": {"mappers": [{
            "filter": {"status_code_filter": {"comparison": {
                "op": "EQ", "value": {"default_value": 413, "runtime_key": "gorgo.413"}}}},
            "body_format_override": {
                "text_format_source": {"inline_string": TOO_LARGE_BODY},
                "content_type": "application/json"},
        }, {
            "filter": {"response_flag_filter": {"flags": list(UPSTREAM_FAILURE_FLAGS)}},
            "body_format_override": {
                "text_format_source": {"inline_string": UPSTREAM_FAILED_BODY},
                "content_type": "application/json"},
        }, {
            # Envoy's own timeouts: the route's (a whole request) and the idle one (no byte
            # either way for timeouts.idle_s; a routed non-streamed answer has the route's)
            "filter": {"response_flag_filter": {"flags": list(TIMEOUT_FLAGS)}},
            "body_format_override": {
                "text_format_source": {"inline_string": TIMEOUT_BODY},
                "content_type": "application/json"},
        }, {
            # Envoy's own 431 (over max_headers_count), and the request that fits only until the
            # router's routing headers are added (a bare 500 otherwise): one clean 431.
            "filter": {"or_filter": {"filters": [
                {"status_code_filter": {"comparison": {
                    "op": "EQ", "value": {"default_value": 431, "runtime_key": "gorgo.431"}}}},
                {"extension_filter": {
                    "name": "envoy.access_loggers.extension_filters.cel",
                    "typed_config": {
                        "@type": _T + "envoy.extensions.access_loggers.filters.cel.v3."
                        "ExpressionFilter",
                        "expression": f"response.code_details == '{HEADERS_FULL_DETAILS}'"}}},
            ]}},
            "status_code": 431,
            "body_format_override": {
                "text_format_source": {"inline_string": TOO_MANY_HEADERS_BODY},
                "content_type": "application/json"},
        }, {
            "filter": {"extension_filter": {
                "name": "envoy.access_loggers.extension_filters.cel",
                "typed_config": {
                    "@type": _T + "envoy.extensions.access_loggers.filters.cel.v3."
                    "ExpressionFilter",
                    "expression": BAD_HTTP_FILTER}}},
            "body_format_override": {
                "text_format_source": {"inline_string": BAD_HTTP_BODY},
                "content_type": "application/json"},
        }]},
    }
    tracing = _tracing(otlp, service_name, otlp_token, spec.proxy_region)
    if tracing is not None:
        hcm["tracing"] = tracing
    logs = []
    if spec.observability.access_log:
        logs.append(_access_log(spec.observability.access_log_path))
    interval = spec.observability.ttft_log_interval_s
    if otlp is not None and interval > 0:
        logs.append(_ttft_log(otlp_token))
        hcm["access_log_options"] = {"access_log_flush_interval": _duration(interval)}
    if logs:
        hcm["access_log"] = logs
    clusters = [] if cds else replica_clusters(spec)
    workers = [_hostport(a.strip(), "--extproc") for a in extproc.split(",")]
    clusters.append(_cluster(EXTPROC_CLUSTER, workers, t.connect_ms, http2=True, http2_options={
        "max_outbound_frames": EXTPROC_MAX_OUTBOUND_FRAMES}))
    # Several workers: a dead, hung or draining one leaves the round robin at the next health
    # check, so its share of requests is routed by the others, not failed open.
    if duplex or len(workers) > 1:
        clusters[-1]["health_checks"] = [{
            "timeout": _duration(t.connect_ms / 1000), "interval": EXTPROC_HEALTH_INTERVAL,
            "no_traffic_interval": EXTPROC_HEALTH_INTERVAL, "unhealthy_threshold": 1,
            "healthy_threshold": 1, "grpc_health_check": {"service_name": LIVE_SERVICE},
        }]
        clusters[-1]["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    if otlp is not None:
        clusters.append(_cluster(OTLP_CLUSTER, [_hostport(otlp, "--otlp")], t.connect_ms,
                                 http2=True))
    if picker:
        clusters.append({
            "name": PICKER_CLUSTER,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": _duration(t.connect_ms / 1000),
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": PICKER_HEADER},
            # Envoy's defaults (1,024 requests) held the 1,025th concurrent stream of the whole
            # fleet behind another: the same thresholds as every replica cluster.
            "circuit_breakers": _circuit_breakers(),
            **_preconnect(spec.upstream.preconnect_ratio),
        })
    return {
        "admin": {"address": {"socket_address": {"address": ahost, "port_value": aport}}},
        # Dynamic resources need a node identity, even from a file.
        **({"node": {"id": service_name, "cluster": spec.name}} if cds else {}),
        **({"dynamic_resources": {"cds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": cds, "watched_directory": {
                "path": os.path.dirname(os.path.abspath(cds))}}}}} if cds else {}),
        "static_resources": {
            "listeners": [{
                "name": "gorgo_ingress",
                "address": {"socket_address": {"address": lhost, "port_value": lport}},
                # Envoy's default (SO_REUSEPORT) let a second Envoy bind this port and silently
                # take a share of its clients, with other routers or none; without it the second
                # fails to start with "Address already in use".
                "enable_reuse_port": False,
                # Buffered: holds the largest body. Full duplex: Envoy holds no body but hands it
                # on in chunks of up to this much plus one socket read, which must stay under
                # the router's gRPC message limit (max_body_bytes + 64 KiB).
                "per_connection_buffer_limit_bytes":
                    spec.limits.max_body_bytes + (0 if duplex else 65536),
                "filter_chains": _filter_chains(spec, hcm),
            }],
            "clusters": clusters,
        },
    }


def _filter_chains(spec: FleetSpec, hcm: dict) -> list[dict]:
    """The listener's filter chains: every client's, and with `control_headers.trusted_peers` a
    second one chosen by the connection's source address, whose requests keep their control
    headers. Envoy's own internal-request rule could not serve: it counts a request carrying
    X-Forwarded-For as external, and a trusted gateway in front sends one (its control headers
    were stripped)."""
    def chain(config: dict) -> list[dict]:
        return [{"name": "envoy.filters.network.http_connection_manager",
                 "typed_config": config}]

    chains = [{"filters": chain(hcm)}]
    if spec.control_headers.trusted_peers:
        trusted = copy.deepcopy(hcm)
        del trusted["route_config"]["internal_only_headers"]
        chains.append({"filter_chain_match": {"source_prefix_ranges": [
            _cidr(c) for c in spec.control_headers.trusted_peers]}, "filters": chain(trusted)})
    return chains


def replica_clusters(spec: FleetSpec) -> list[dict]:
    """One cluster per replica, and with retries the override-host cluster of them all: what
    changes with the fleet's membership."""
    t = spec.timeouts
    clusters = [_cluster(r.cluster, [(unbracketed(r.host), r.port)], t.connect_ms,
                         preconnect_ratio=spec.upstream.preconnect_ratio)
                for r in spec.replicas]
    if spec.retries.enabled:
        clusters.append(_fleet_cluster(spec))
    if spec.extproc.skip_response_headers:
        for c in clusters:
            c["outlier_detection"] = OUTLIER_DETECTION
    return clusters


def render_cds(spec: FleetSpec) -> dict[str, Any]:
    """The replicas' clusters as a filesystem CDS file (a DiscoveryResponse)."""
    return {"resources": [{"@type": _T + "envoy.config.cluster.v3.Cluster", **c}
                          for c in replica_clusters(spec)]}


def stage_cds(spec: FleetSpec, path: str | os.PathLike[str]) -> Path:
    """The CDS file for ``spec`` written beside ``path`` under a temporary name, to be renamed
    over it (`os.replace`): what can fail (a missing directory, a full disk) fails here."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(yaml.safe_dump(render_cds(spec), sort_keys=False, width=100))
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_cds(spec: FleetSpec, path: str | os.PathLike[str]) -> None:
    """Write the CDS file atomically (a temporary file in its directory, renamed over it): Envoy
    watches for the rename and never reads half a file."""
    os.replace(stage_cds(spec, path), path)


def render_yaml(spec: FleetSpec, **kwargs: Any) -> str:
    header = f"# Rendered by `gorgo envoy-config` for fleet {spec.name!r}; do not edit by hand.\n"
    boot = render_bootstrap(spec, **kwargs)
    check_bootstrap(boot)  # an EnvoyConfigError (a UserError) names the field at fault
    return header + yaml.safe_dump(boot, sort_keys=False, width=100)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("fleet", help="fleet YAML file")
    p.add_argument("--listen", default="0.0.0.0:10000", help="Envoy listener HOST:PORT")
    p.add_argument("--extproc", default="127.0.0.1:50051",
                   help="gorgo extproc HOST:PORT; several, comma-separated, for the ports of "
                        "`gorgo extproc --workers N` (PORT and up, past --metrics-port) or "
                        "several routers")
    p.add_argument("--otlp", default=None, help="OTLP/gRPC collector HOST:PORT (enables tracing)")
    p.add_argument("--otlp-token-file", default=None,
                   help="the tuner's OTLP bearer token, sent with every export (the rendered "
                        "file then holds it and is written owner-only)")
    p.add_argument("--admin", default="127.0.0.1:9901", help="Envoy admin HOST:PORT")
    p.add_argument("--picker", action="store_true",
                   help="also accept the endpoint-picker header (ORIGINAL_DST cluster)")
    p.add_argument("--body-mode", choices=sorted(BODY_MODES), default="buffered",
                   help="request body mode of the ext_proc filter: buffered (default) or "
                        "full-duplex (FULL_DUPLEX_STREAMED, the endpoint-picker protocol's)")
    p.add_argument("--cds-file", default=None,
                   help="cluster mode with membership changes: write the replicas' clusters to "
                        "this file, which Envoy watches (filesystem CDS); `gorgo extproc "
                        "--cds-file` rewrites it on every fleet reload")
    p.add_argument("-o", "--output", default="-", help="output file (default stdout)")


def _otlp_token(path: str | None, otlp: str | None) -> str | None:
    if path is None:
        return None
    if otlp is None:
        raise UserError("--otlp-token-file needs --otlp (the token goes with the exported spans)")
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the OTLP token: {exc.strerror}") from None
    if not token or not header_token(token):
        raise UserError(f"{path}: the OTLP token must be one line of printable ASCII without "
                        "spaces")
    return token


def main(args: argparse.Namespace) -> int:
    spec = load_fleet(args.fleet)
    if args.cds_file:
        refuse_clusters_file(dns_sources(read_fleet(args.fleet)), Path(args.fleet).name)
    token = _otlp_token(args.otlp_token_file, args.otlp)
    text = render_yaml(spec, listen=args.listen, extproc=args.extproc, otlp=args.otlp,
                       otlp_token=token, admin=args.admin, picker=args.picker,
                       body_mode=args.body_mode,
                       cds=args.cds_file and os.path.abspath(args.cds_file))
    if args.cds_file:
        try:
            write_cds(spec, args.cds_file)
        except OSError as exc:
            raise UserError(f"cannot write {args.cds_file}: {exc.strerror}") from None
    if args.output == "-":
        if token:  # a redirect is world-readable under the usual umask; -o writes it 0600
            print("gorgo envoy-config: warning: the output holds the OTLP token: keep it owner-"
                  "only (-o FILE writes it so); Envoy's admin /config_dump shows it too",
                  file=sys.stderr)
        sys.stdout.write(text)
        return 0
    try:
        # A rendered token is a secret: the file is then the owner's only.
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                     0o600 if token else 0o666)
        if token:
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
    except OSError as exc:
        raise UserError(f"cannot write {args.output}: {exc.strerror}") from None
    return 0
