"""One routed request as the tuner sees it, parsed from the OpenTelemetry span Envoy exported.

Envoy writes every ``gorgo.*`` decision field and the TTFT as string attributes (custom tags), and
``-`` where the value was missing (a request the router never decided on, or one that got no first
byte). Spans are parsed strictly: a span that does not carry a decision is *foreign* (another
service's span fanned out by the same collector), one with a decision but no TTFT is *no_ttft*, and
one whose values do not parse is *malformed*. All three are dropped and counted, never raised past
the receiver. Every attribute name is the contract's (`gorgo.core.contract`): the TTFT in
microseconds, the HTTP status, and each decision field under ``gorgo.``, one per cost term of the
registry included.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from gorgo.core.contract import SPAN_PREFIX, STATUS_ATTR, TERM_FIELDS, TTFT_ATTR
from gorgo.core.terms import TERMS

# (term name, span tag) for every term of the registry: each decision carries each of them.
_TERM_TAGS = tuple((t.name, SPAN_PREFIX + f)
                   for t, f in zip(TERMS, TERM_FIELDS, strict=True))
FOREIGN = "foreign"
NO_TTFT = "no_ttft"
MALFORMED = "malformed"
DROP_REASONS = (FOREIGN, NO_TTFT, MALFORMED)
_MISSING = ("", "-")


class SpanDropped(ValueError):
    """The span is not a usable sample; ``reason`` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Sample:
    """Measured latency of one request plus the decision that routed it (times in ms).

    ``terms`` holds every term of the registry, read from its ``gorgo.<name>_ms`` tag: the
    tuner's weight fit and calibration iterate over it rather than naming fields.
    """

    ttft_ms: float
    e2e_ms: float
    status: int
    replica: str
    region: str
    policy: str
    weights_version: int
    predicted_ttft_ms: float
    terms: dict[str, float]  # term name (gorgo.core.terms) -> its unweighted ms in the decision
    uncached_tokens: int
    prompt_tokens: int
    decision_id: str = ""
    end_unix_s: float = 0.0

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(v, kind)
    return None


def span_attributes(span: Span) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


def _present(attrs: dict[str, Any], key: str) -> bool:
    v = attrs.get(key)
    return v is not None and not (isinstance(v, str) and v.strip() in _MISSING)


def _number(attrs: dict[str, Any], key: str) -> float:
    v = attrs.get(key)
    if isinstance(v, bool) or v is None:
        raise SpanDropped(MALFORMED, f"{key} missing")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise SpanDropped(MALFORMED, f"{key}={v!r} is not a number") from None
    if not math.isfinite(x) or x < 0:
        raise SpanDropped(MALFORMED, f"{key}={v!r} is not a finite non-negative number")
    return x


def _integer(attrs: dict[str, Any], key: str) -> int:
    x = _number(attrs, key)
    if x != int(x):
        raise SpanDropped(MALFORMED, f"{key}={x!r} is not an integer")
    return int(x)


def _text(attrs: dict[str, Any], key: str) -> str:
    if not _present(attrs, key) or not isinstance(attrs[key], str):
        raise SpanDropped(MALFORMED, f"{key} missing")
    return attrs[key]


def parse_span(span: Span) -> Sample:
    """The span as a Sample, or SpanDropped saying why it is not one."""
    attrs = span_attributes(span)
    if not _present(attrs, SPAN_PREFIX + "decision_id"):
        raise SpanDropped(FOREIGN, "no gorgo.decision_id")
    if not _present(attrs, TTFT_ATTR):
        raise SpanDropped(NO_TTFT, "no first byte from upstream")
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if start <= 0 or end < start:
        raise SpanDropped(MALFORMED, f"span times {start}..{end}")
    status = _integer(attrs, STATUS_ATTR)
    if not 100 <= status <= 599:
        raise SpanDropped(MALFORMED, f"{STATUS_ATTR}={status}")
    return Sample(
        ttft_ms=_number(attrs, TTFT_ATTR) / 1000.0,
        e2e_ms=(end - start) / 1e6,
        status=status,
        replica=_text(attrs, SPAN_PREFIX + "replica"),
        region=_text(attrs, SPAN_PREFIX + "region"),
        policy=_text(attrs, SPAN_PREFIX + "policy"),
        weights_version=_integer(attrs, SPAN_PREFIX + "weights_version"),
        predicted_ttft_ms=_number(attrs, SPAN_PREFIX + "predicted_ttft_ms"),
        terms={name: _number(attrs, tag) for name, tag in _TERM_TAGS},
        uncached_tokens=_integer(attrs, SPAN_PREFIX + "uncached_tokens"),
        prompt_tokens=_integer(attrs, SPAN_PREFIX + "prompt_tokens"),
        decision_id=str(attrs[SPAN_PREFIX + "decision_id"]),
        end_unix_s=end / 1e9,
    )


def iter_spans(request: ExportTraceServiceRequest) -> Iterable[Span]:
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            yield from ss.spans


def parse_export(request: ExportTraceServiceRequest) -> tuple[list[Sample], Counter[str]]:
    """Every usable sample in one OTLP export, and how many spans were dropped for each reason."""
    samples: list[Sample] = []
    dropped: Counter[str] = Counter()
    for span in iter_spans(request):
        try:
            samples.append(parse_span(span))
        except SpanDropped as exc:
            dropped[exc.reason] += 1
        except (ValueError, TypeError, OverflowError):  # whatever else a hostile span holds
            dropped[MALFORMED] += 1
    return samples, dropped
