"""One routed request as the tuner sees it, parsed from the OpenTelemetry span Envoy exported.

Envoy writes every ``gorgo.*`` decision field and the TTFT as string attributes (custom tags), and
``-`` where the value was missing (a request the router never decided on, or one that got no first
byte). Spans are parsed strictly: a span that does not carry a decision is *foreign* (another
service's span fanned out by the same collector), one with a decision but no TTFT is *no_ttft*,
one whose values do not parse is *malformed*, and one whose TTFT or E2E exceeds the fleet's request
timeout (Envoy ends every request by then, so such a value is forged or broken) is *out_of_range*;
a stream Envoy cut (its response flags) ends a little past it (the route's timer starts once the
request is in) and counts at the timeout.
All are dropped and counted, never raised past the receiver. Every attribute name is the
contract's (`gorgo.core.contract`): the TTFT in microseconds, the HTTP status, and each decision
field under ``gorgo.``, one per cost term of the registry included.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from gorgo.core.contract import (
    ATTEMPTS_ATTR,
    CUT_STREAM_FLAGS,
    LOG_END,
    LOG_PERIODIC,
    LOG_TYPE_ATTR,
    RESPONSE_FLAGS_ATTR,
    SPAN_PREFIX,
    STATUS_ATTR,
    TERM_FIELDS,
    TOKENS_MAX,
    TTFT_ATTR,
    UPLOAD_ATTR,
    VERSION_MAX,
)
from gorgo.core.terms import EXCLUDED, TERMS, TTFT

# (term, span tag, required): a term of the predicted TTFT is on every span; any other (decode,
# congestion, the penalty) is read where the router tags it, so spans of a router older than the
# term still parse.
_TERM_TAGS = tuple((t.name, SPAN_PREFIX + f, TTFT in t.objectives and t.fit != EXCLUDED)
                   for t, f in zip(TERMS, TERM_FIELDS, strict=True))
FOREIGN = "foreign"
NO_TTFT = "no_ttft"
# The status of a sample whose request ended without a first byte and without an error status
# of its own (the client gave up: Envoy reports 0; a stream stalled after its 200 headers): a
# failure, as `Sample.ok` reads it.
NO_FIRST_BYTE_STATUS = 503
MALFORMED = "malformed"
OUT_OF_RANGE = "out_of_range"
DROP_REASONS = (FOREIGN, NO_TTFT, MALFORMED, OUT_OF_RANGE)
# A cost term may exceed the request timeout (a long predicted queue is what shedding acts on),
# but not by more than this factor: beyond it the decision is no basis for a fit.
TERM_SLACK = 10.0
# Envoy times the first byte and the span's end on one clock: a first byte after the end (beyond
# rounding) is no request's.
TTFT_SLACK = 0.01
# How far past the request timeout a stream Envoy cut may end: its route timer starts once the
# request is in and routed (the ext_proc round trips before it are bounded by their own timeout).
CUT_SLACK_MS = 30_000.0
_MISSING = ("", "-")
# What one export may hold before it is refused unread (`Oversized`): Envoy exports one resource
# and one scope per batch, a Collector one of each per sender. Counting an 8 MB export of 4M empty
# resources held the tuner's only event loop 2.2 s, and Envoy's exports in the meantime missed
# their 1 s deadline.
MAX_CONTAINERS = 10_000  # resources and scopes
# Attributes of a span (or log record) that is read at all: Envoy's carry about 50 (its own, the
# gorgo.* tags, a Collector's GenAI ones), and OpenTelemetry's SDKs keep 128 by default. Reading
# a span of 4M attributes took 2.0 s.
MAX_ATTRIBUTES = 128


class Oversized(ValueError):
    """An export whose shape alone would cost more than any sender's real one to read."""


class SpanDropped(ValueError):
    """The span is not a usable sample; ``reason`` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Sample:
    """Measured latency of one request plus the decision that routed it (times in ms).

    ``terms`` holds the registry's terms, read from their ``gorgo.<name>_ms`` tags (every TTFT
    term; the others where the span has them): the tuner's weight fit and calibration iterate
    over it rather than naming fields.
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
    source: int | None = None  # the export it came in (the receiver numbers them); None: offline
    start_unix_s: float = 0.0  # 0: unknown (then end_unix_s - e2e_ms)
    # The stream ended after its first byte without its whole answer (Envoy's response flags: a
    # reset, a timeout, the client leaving), its status still 2xx: its TTFT holds, its E2E is
    # no answer's (cut streams once scored as fast successes under `e2e`).
    cut: bool = False
    # Envoy retried it on the next-best replica: served by another replica than the one it names
    # (the decision's), with the failed try in its TTFT. Scored in its window; no calibration
    # or weight-fit row (a retried request once fitted the failed replica at 325 ms, 100x).
    retried: bool = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def early(self) -> bool:
        """The TTFT of a stream still open (a TTFT log entry): its E2E is not known yet."""
        return math.isnan(self.e2e_ms)

    @property
    def arrival_s(self) -> float:
        """When the request started (Unix s), 0 if unknown: the order windows keep bursts in."""
        if self.start_unix_s > 0:
            return self.start_unix_s
        return self.end_unix_s - self.e2e_ms / 1000.0 if self.end_unix_s > 0 else 0.0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind in ("string_value", "int_value", "double_value", "bool_value"):
        return getattr(v, kind)
    return None


def span_attributes(item: Span | LogRecord) -> dict[str, Any]:
    if len(item.attributes) > MAX_ATTRIBUTES:  # counted without reading them
        raise SpanDropped(MALFORMED, f"{len(item.attributes)} attributes > {MAX_ATTRIBUTES}")
    return {a.key: _value(a.value) for a in item.attributes}


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


def _retried(attrs: dict[str, Any]) -> bool:
    """Whether Envoy tried the request more than once (the attempt count, absent: once)."""
    n = attrs.get(ATTEMPTS_ATTR)
    try:
        return n is not None and int(n) > 1
    except (TypeError, ValueError):
        return False


def _cut(attrs: dict[str, Any]) -> bool:
    """Whether Envoy's response flags (comma-separated, "-" for none) say the stream was cut."""
    flags = attrs.get(RESPONSE_FLAGS_ATTR)
    return isinstance(flags, str) and not CUT_STREAM_FLAGS.isdisjoint(flags.split(","))


def parse_span(span: Span, max_ms: float, source: int | None = None) -> Sample:
    """The span as a Sample, or SpanDropped saying why it is not one; ``max_ms`` is the fleet's
    request timeout, the longest TTFT or E2E a real request can have."""
    start, end = span.start_time_unix_nano, span.end_time_unix_nano
    if start <= 0 or end < start:
        raise SpanDropped(MALFORMED, f"span times {start}..{end}")
    return parse_attributes(span_attributes(span), start, end, max_ms, source)


def parse_record(record: LogRecord, max_ms: float, source: int | None = None) -> Sample:
    """An entry of Envoy's TTFT access log (`gorgo.envoy_config`) as an *early* Sample: the TTFT
    of a stream still open, its E2E unknown (NaN) until the span ends. Its time is the request's
    start (Envoy's OpenTelemetry access logger sets it so)."""
    attrs = span_attributes(record)
    if attrs.get(LOG_TYPE_ATTR) not in (LOG_PERIODIC, LOG_END):
        raise SpanDropped(FOREIGN, f"{LOG_TYPE_ATTR} is not {LOG_PERIODIC} or {LOG_END}")
    start = record.time_unix_nano
    if start <= 0:
        raise SpanDropped(MALFORMED, f"record time {start}")
    return parse_attributes(attrs, start, None, max_ms, source)


def parse_attributes(attrs: dict[str, Any], start: int, end: int | None, max_ms: float,
                     source: int | None = None) -> Sample:
    """A Sample from the contract's attributes, started at ``start`` and ended at ``end``
    (Unix ns; None: still open, its E2E unknown)."""
    if not _present(attrs, SPAN_PREFIX + "decision_id"):
        raise SpanDropped(FOREIGN, "no gorgo.decision_id")
    first_byte = _present(attrs, TTFT_ATTR)
    if not first_byte and end is None:  # a stream still open: nothing known of it yet
        raise SpanDropped(NO_TTFT, "no first byte from upstream yet")
    status = _integer(attrs, STATUS_ATTR)
    if first_byte and not 100 <= status <= 599:
        raise SpanDropped(MALFORMED, f"{STATUS_ATTR}={status}")
    if not first_byte:
        # A decided request that ended with no byte from its replica and an error (Envoy's own
        # 503, its 504 at the route timeout, a client that gave up waiting: status 0) failed as
        # its user saw it: an error sample, never left out (weights that make requests fail or
        # stall would otherwise be scored on the survivors). So did an inference request
        # (tagged with its GenAI operation) whose replica sent its 200 headers and then no
        # byte until the client or a timeout ended it (engines send the headers of a stream
        # before its first token): such an answer always has a body. A success with no body
        # of any other path (an empty 200 of /health) says nothing of a first token.
        inference = _present(attrs, SPAN_PREFIX + "operation")
        if not (status == 0 or 400 <= status <= 599 or (inference and 100 <= status < 400)):
            raise SpanDropped(NO_TTFT if 100 <= status < 400 else MALFORMED,
                              f"no first byte, {STATUS_ATTR}={status}")
        status = status if status >= 400 else NO_FIRST_BYTE_STATUS
    assert end is not None or first_byte
    # From the request's last byte in (UPLOAD_ATTR): how fast its client sends is no part of
    # the choice scored. An error without a first byte waited at least its E2E, at most the
    # request timeout (the route's timeout, which starts once the request is in, ends it a
    # little past max_ms).
    upload_ms = _number(attrs, UPLOAD_ATTR) / 1000.0 if _present(attrs, UPLOAD_ATTR) else 0.0
    total_ms = math.nan if end is None else max((end - start) / 1e6 - upload_ms, 0.0)
    waited_ms = min(total_ms, max_ms)
    # So does a stream Envoy cut after its first byte (its route timeout, UT): dropped as out of
    # range, it left its window waiting for it and then scored without it, an error unseen.
    cut = first_byte and end is not None and _cut(attrs) and total_ms <= max_ms + CUT_SLACK_MS
    s = Sample(
        ttft_ms=max(_number(attrs, TTFT_ATTR) / 1000.0 - upload_ms, 0.0) if first_byte
        else waited_ms,
        e2e_ms=(waited_ms if cut else total_ms) if first_byte else waited_ms,
        status=status,
        replica=_text(attrs, SPAN_PREFIX + "replica"),
        region=_text(attrs, SPAN_PREFIX + "region"),
        policy=_text(attrs, SPAN_PREFIX + "policy"),
        weights_version=_integer(attrs, SPAN_PREFIX + "weights_version"),
        predicted_ttft_ms=_number(attrs, SPAN_PREFIX + "predicted_ttft_ms"),
        terms={name: _number(attrs, tag) for name, tag, required in _TERM_TAGS
               if required or _present(attrs, tag)},
        uncached_tokens=_integer(attrs, SPAN_PREFIX + "uncached_tokens"),
        prompt_tokens=_integer(attrs, SPAN_PREFIX + "prompt_tokens"),
        decision_id=str(attrs[SPAN_PREFIX + "decision_id"]),
        end_unix_s=0.0 if end is None else end / 1e9,
        source=source,
        start_unix_s=start / 1e9,
        cut=cut,
        retried=_retried(attrs),
    )
    if s.ttft_ms > max_ms or s.e2e_ms > max_ms:  # NaN (still open) is no violation
        raise SpanDropped(OUT_OF_RANGE, f"TTFT {s.ttft_ms:g} ms, E2E {s.e2e_ms:g} ms > {max_ms:g}")
    if s.ttft_ms > s.e2e_ms * (1.0 + TTFT_SLACK) + 1.0:  # likewise
        raise SpanDropped(MALFORMED, f"first byte at {s.ttft_ms:g} ms, after the end at "
                          f"{s.e2e_ms:g} ms")
    if max(s.predicted_ttft_ms, *s.terms.values()) > TERM_SLACK * max_ms:
        raise SpanDropped(OUT_OF_RANGE, f"a cost term above {TERM_SLACK * max_ms:g} ms")
    if s.uncached_tokens > s.prompt_tokens or s.weights_version > VERSION_MAX:
        raise SpanDropped(MALFORMED, "uncached tokens above the prompt's, or version above int64")
    if s.prompt_tokens > TOKENS_MAX:
        raise SpanDropped(OUT_OF_RANGE, f"{s.prompt_tokens} prompt tokens > {TOKENS_MAX}")
    return s


def iter_records(request: ExportLogsServiceRequest) -> Iterable[LogRecord]:
    for rl in request.resource_logs:
        for sl in rl.scope_logs:
            yield from sl.log_records


def _count(resources: Any, scopes: str, items: str) -> int:
    """The ``items`` in an export's ``resources`` (each with its ``scopes``); Oversized, before
    any walk longer than MAX_CONTAINERS, if they hold more containers than that."""
    containers = len(resources)
    if containers > MAX_CONTAINERS:
        raise Oversized(f"{containers} resources > {MAX_CONTAINERS}")
    total = 0
    for r in resources:
        inner = getattr(r, scopes)
        containers += len(inner)
        if containers > MAX_CONTAINERS:
            raise Oversized(f"more than {MAX_CONTAINERS} resources and scopes")
        total += sum(len(getattr(sc, items)) for sc in inner)
    return total


def count_records(request: ExportLogsServiceRequest) -> int:
    return _count(request.resource_logs, "scope_logs", "log_records")


def iter_spans(request: ExportTraceServiceRequest) -> Iterable[Span]:
    for rs in request.resource_spans:
        for ss in rs.scope_spans:
            yield from ss.spans


def count_spans(request: ExportTraceServiceRequest) -> int:
    return _count(request.resource_spans, "scope_spans", "spans")


def parse_export(request: ExportTraceServiceRequest | ExportLogsServiceRequest, max_ms: float,
                 source: int | None = None,
                 limit: int | None = None) -> tuple[list[Sample], Counter[str]]:
    """The usable samples among the first ``limit`` spans (or TTFT log records) of one OTLP
    export (None: all), and how many were dropped for each reason."""
    samples: list[Sample] = []
    dropped: Counter[str] = Counter()
    if isinstance(request, ExportLogsServiceRequest):
        items: Iterable[Any] = iter_records(request)
        parse: Any = parse_record
    else:
        items, parse = iter_spans(request), parse_span
    for item in itertools.islice(items, limit):
        try:
            samples.append(parse(item, max_ms, source))
        except SpanDropped as exc:
            dropped[exc.reason] += 1
        except (ValueError, TypeError, OverflowError):  # whatever else a hostile span holds
            dropped[MALFORMED] += 1
    return samples, dropped
