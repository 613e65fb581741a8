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
# Envoy's %COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)%: first upstream body byte, microseconds.
TTFT_ATTR = "gen_ai.response.time_to_first_chunk"
STATUS_ATTR = "http.status_code"

# Router -> Envoy: the chosen replica's cluster, and the ordered IP:port list Envoy's override-host
# policy retries on (attempt k goes to the k-th address).
CLUSTER_HEADER = "x-gorgo-cluster"
ENDPOINTS_HEADER = "x-gorgo-endpoints"
# Gateway API Inference Extension endpoint-picker protocol: header and dynamic metadata namespace.
PICKER_HEADER = "x-gateway-destination-endpoint"
PICKER_NAMESPACE = "envoy.lb"
# Router -> client, on the response: where the request went.
REPLICA_HEADER = "x-gorgo-replica"
DECISION_HEADER = "x-gorgo-decision-id"
# Client -> router request headers the router reads.
SESSION_HEADER = "x-session-id"
POLICY_HEADER = "x-gorgo-policy"
PRIORITY_HEADER = "x-gorgo-priority"

# Decision fields, in the order they are tagged: identity, the prediction, each term, tokens.
TEXT_FIELDS = ("decision_id", "replica", "region", "policy")
TERM_FIELDS = tuple(t.field for t in TERMS)
DECISION_FIELDS = (*TEXT_FIELDS, "weights_version", "predicted_ttft_ms", *TERM_FIELDS,
                   "uncached_tokens", "prompt_tokens")

WEIGHT_BOUNDS: dict[str, tuple[float, float]] = {k: t.bounds for k, t in WEIGHTED.items()}
PREFILL_RATE_BOUNDS = (1.0, 1e9)  # tokens/s
VERSION_MAX = 2**63 - 1  # versions are int64 everywhere (Prometheus, JSON, Envoy metadata)


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
