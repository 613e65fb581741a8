"""The contract between processes: every name and bound that the router, the Envoy renderer, the
tuner and the fleet file must agree on, in one place.

The router writes the decision fields into Envoy's dynamic metadata (namespace ``gorgo``); the
rendered bootstrap copies each into a span tag ``gorgo.<field>``; the tuner parses them back. The
weight bounds are enforced by the fleet file, the admin API and the tuner's search alike.
"""

from __future__ import annotations

from typing import Any

from gorgo.core.terms import TERMS, WEIGHTED

METADATA_NAMESPACE = "gorgo"
SPAN_PREFIX = "gorgo."
# Envoy's %COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%: request start to the first upstream
# body byte, in microseconds, as a string (custom tags are strings). It is the first token only
# for a streamed answer, so it keeps a gorgo.* name; the GenAI attributes below are derived from it
# and the request fields (gorgo.core.otel). The tuner reads it as the request's TTFT.
TTFT_ATTR = "gorgo.first_byte_us"
# The region of the proxy (Envoy + router) that served the request, a constant of each rendered
# bootstrap: with a proxy per region, Jaeger tells their spans apart by it.
PROXY_REGION_ATTR = "gorgo.proxy_region"
STATUS_ATTR = "http.status_code"
# Envoy's own span tag of the request's response flags: a stream reset or timed out after its
# 2xx headers (the replica's reset UR/UC/UPE, a timeout UT/SI/DT/UMSDR, Envoy's own LR/OM, the
# client leaving DC/DPE) still reports its status, 200: these flags tell such a cut stream from a
# whole one.
RESPONSE_FLAGS_ATTR = "response_flags"
# Envoy's %UPSTREAM_REQUEST_ATTEMPT_COUNT% (span and TTFT log): a request Envoy retried on the
# next-best replica was served by another replica than the decision's, which its span names
# (the decision's metadata): such a request says nothing of either replica's rates or weights.
ATTEMPTS_ATTR = "gorgo.attempts"
ATTEMPTS_FORMAT = "%UPSTREAM_REQUEST_ATTEMPT_COUNT%"
# Envoy's %COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)% (span and TTFT log): how long the client took
# to send its request. The router decides once the whole body is in, so no replica or weight has
# a part in it: the tuner takes it off the TTFT and the E2E it scores (a body trickled in over
# 2.4 s scored a replica that answered in 35 ms at 2,434 ms). Absent ("-"): none known.
UPLOAD_ATTR = "gorgo.upload_us"
UPLOAD_FORMAT = "%COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)%"
CUT_STREAM_FLAGS = frozenset({"UR", "UC", "UPE", "UT", "SI", "DT", "UMSDR", "LR", "OM", "DC",
                              "DPE"})
# Envoy -> tuner, over OTLP logs: the HTTP connection manager's periodic access log sends an open
# stream's first-token time before the stream ends. Each record carries the span's attribute names
# (TTFT_ATTR, STATUS_ATTR, gorgo.<decision field>) plus the entry's %ACCESS_LOG_TYPE%; only these
# types are sent, and the tuner counts a decision's TTFT once (tuner/join.py).
TTFT_LOG_NAME = "gorgo.ttft"
LOG_TYPE_ATTR = "gorgo.log_type"
LOG_PERIODIC = "DownstreamPeriodic"
LOG_END = "DownstreamEnd"
# OpenTelemetry GenAI semantic-convention attributes, typed: made by the Collector's transform
# processor (deploy/otel-collector.yaml) or gorgo.core.otel from the string tags.
GENAI_OPERATION_ATTR = "gen_ai.operation.name"
GENAI_PROVIDER_ATTR = "gen_ai.provider.name"
GENAI_MODEL_ATTR = "gen_ai.request.model"
GENAI_STREAM_ATTR = "gen_ai.request.stream"
GENAI_TTFC_ATTR = "gen_ai.response.time_to_first_chunk"  # double, seconds, streamed answers only
# The router's own span per decision (extproc/telemetry.py), a child of Envoy's span of the
# ext_proc stream, which lasts the whole request and which Envoy always closes as "canceled".
ROUTER_SERVICE = "gorgo-router"
ROUTER_SPAN = "gorgo.route"
# routed, invalid_request, model_not_found, context_length_exceeded, shed, no_healthy_replica,
# fail_open (a refusal's `Rejection.reason`)
OUTCOME_ATTR = "gorgo.outcome"
ROUTER_STATUS_ATTR = "http.response.status_code"  # of an answer the router gave itself
EXTPROC_SPAN = "async envoy.service.ext_proc.v3.ExternalProcessor.Process egress"

# Envoy -> router: the gRPC health service name Envoy's health check of the ext_proc cluster asks
# for. SERVING while the process runs and takes streams; NOT_SERVING from a stop signal on, while
# it drains (a hung process does not answer, and is taken out the same way).
LIVE_SERVICE = "gorgo.live"
# The clusters of the Envoy config GORGO renders besides the replicas' own (no replica's cluster
# may take one: an admin add named gorgo_fleet sent every request to one replica, and one named
# gorgo_extproc to the router's gRPC port).
EXTPROC_CLUSTER = "gorgo_extproc"
OTLP_CLUSTER = "otel_collector"
PICKER_CLUSTER = "picker_original_dst"
FLEET_CLUSTER = "gorgo_fleet"
RESERVED_CLUSTERS = frozenset({EXTPROC_CLUSTER, OTLP_CLUSTER, PICKER_CLUSTER, FLEET_CLUSTER})
# Router -> Envoy: the chosen replica's cluster, and the ordered IP:port list Envoy's override-host
# policy retries on (attempt k goes to the k-th address).
CLUSTER_HEADER = "x-gorgo-cluster"
ENDPOINTS_HEADER = "x-gorgo-endpoints"
# ... and whether an inference request streams its answer ("true" / "false", the decision's
# `stream` field): a non-streamed answer sends no byte until it is whole, so its route's idle
# timeout is the whole request's, not timeouts.idle_s.
STREAM_HEADER = "x-gorgo-stream"
# Gateway API Inference Extension endpoint-picker protocol: header and dynamic metadata namespace.
PICKER_HEADER = "x-gateway-destination-endpoint"
PICKER_NAMESPACE = "envoy.lb"
# Router -> client, on the response: where the request went.
REPLICA_HEADER = "x-gorgo-replica"
DECISION_HEADER = "x-gorgo-decision-id"
# Client -> router request headers the router reads. The control headers change how a request is
# treated (its shedding limit, its policy), so Envoy strips them from every client the fleet's
# control_headers.trusted_peers do not name.
SESSION_HEADER = "x-session-id"
POLICY_HEADER = "x-gorgo-policy"
PRIORITY_HEADER = "x-gorgo-priority"
# Per-request latency targets of the `slo` objective, the Gateway API Inference Extension's names.
SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
CONTROL_HEADERS = (POLICY_HEADER, PRIORITY_HEADER, SLO_TTFT_HEADER, SLO_TPOT_HEADER)
PRIORITY_BOUNDS = (0, 100)
SLO_BOUNDS_MS = (1.0, 3_600_000.0)  # a target outside this is a client error
# Replay client -> simulated engine only (`gorgo replay --trace NAME:max_tokens=...`): the output
# the trace says this request generates, where its body's max_tokens is a cap or absent, as a real
# client's is (the engine stops there, as a real one stops at end of sequence). A key of the body's
# `metadata` (OpenAI's field for a client's own tags), the one place every router here passes on:
# sglang-router 0.3.2 drops unknown headers and body fields, and `user` too. The router neither
# reads it nor needs to: it learns output lengths from the engines' counters.
SIM_OUTPUT_KEY = "gorgo_sim_output_tokens"
# Envoy -> router, on the response (include_attempt_count_in_response): 2 means the retry served it.
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"
# Every header the router reads, request and response: the only ones Envoy forwards to it.
ROUTER_READS = (":path", ":method", "content-length", SESSION_HEADER, *CONTROL_HEADERS, ":status",
                ATTEMPT_COUNT_HEADER)
# With the request-headers message skipped (fleet extproc.request_headers: skip), the body message
# carries the request headers the router reads as ext_proc request attributes (CEL expressions,
# keyed by the expression in the attributes' struct), under this filter name. content-length is
# not among them: Envoy drops it in that mode, and the router measures the body itself.
ATTRIBUTES_FILTER = "envoy.filters.http.ext_proc"
REQUEST_ATTRIBUTES = {"request.path": ":path",
                      **{f"request.headers['{h}']": h for h in (SESSION_HEADER, *CONTROL_HEADERS)}}
# ... and Envoy sets the routing headers from these fields of the decision's metadata once the body
# is answered (an absent field sets no header: the request fails open to the default route).
CLUSTER_FIELD = "cluster"
ENDPOINTS_FIELD = "endpoints"
STREAM_FIELD = "stream"
# What Envoy forwards: the OpenAI-style inference API and the engines' health path (exact paths,
# plus the fleet's routes.extra_paths); any other path is a 404 from Envoy itself.
MODELS_PATH = "/v1/models"
BODY_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")  # routed by the body
API_PATHS = (*BODY_PATHS, MODELS_PATH)
HEALTH_PATH = "/health"

# Decision fields, in the order they are tagged: identity, the prediction, each term, tokens.
TEXT_FIELDS = ("decision_id", "replica", "region", "policy")
TERM_FIELDS = tuple(t.field for t in TERMS)
DECISION_FIELDS = (*TEXT_FIELDS, "weights_version", "predicted_ttft_ms", *TERM_FIELDS,
                   "uncached_tokens", "prompt_tokens")
# Request fields tagged beside them, for the GenAI attributes: the request's model and streaming
# flag, the GenAI operation of its endpoint and the chosen replica's engine (the provider).
REQUEST_FIELDS = ("model", "stream", "operation", "provider")
# gorgo.core.features.ENDPOINTS' kinds -> gen_ai.operation.name.
GENAI_OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat"}
MODEL_MAX_CHARS = 256  # a client's model name, cut to this length in metadata and spans

WEIGHT_BOUNDS: dict[str, tuple[float, float]] = {k: t.bounds for k, t in WEIGHTED.items()}
PREFILL_RATE_BOUNDS = (1.0, 1e9)  # tokens/s
# Versions travel as doubles (Envoy's metadata and its access log, Prometheus' gauge): exact up to
# 2^53. Above it the tuner read a version it never issued (2^53 + 1 came back as 2^53).
VERSION_MAX = 2**53 - 1
# A decision's prompt and uncached tokens as spans carry them: far above any context window, low
# enough that a forged count cannot dwarf every real one in the tuner's fits.
TOKENS_MAX = 1 << 30
# How long `gorgo extproc --workers`' supervisor waits for a worker before it leaves the worker
# out of the answer: a read (/metrics, /readyz, an admin GET) and a change (a reload, weights).
# The tuner waits longer for a router's answer (tuner.main.PUBLISH_TIMEOUT_S): a tuner that gave
# up first (its former 2 s) lost the router's census while one worker hung.
WORKER_READ_TIMEOUT_S = 3.0
WORKER_WRITE_TIMEOUT_S = 10.0


def decision_fields(
    decision: Any, replica: str, region: str
) -> dict[str, Any]:
    """A decision as the flat field mapping Envoy's metadata and span tags carry."""
    out: dict[str, Any] = {
        "decision_id": decision.id,
        "replica": replica,
        "region": region,
        "policy": decision.policy,
        "weights_version": decision.weights_version,
        "predicted_ttft_ms": round(decision.predicted_ms, 3),
    }
    for t in TERMS:
        out[t.field] = round(decision.terms[t.name], 3)
    out["uncached_tokens"] = decision.uncached_tokens
    out["prompt_tokens"] = decision.prompt_tokens
    return out


def request_fields(features: Any, engine: str) -> dict[str, str]:
    """The request fields of an inference request (none of a GET /v1/models), as strings: Envoy's
    metadata holds strings and numbers only."""
    operation = GENAI_OPERATIONS.get(features.endpoint or "")
    if operation is None:
        return {}
    out = {STREAM_FIELD: "true" if features.stream else "false", "operation": operation,
           "provider": engine}
    if features.model:
        out["model"] = features.model[:MODEL_MAX_CHARS]
    return out
