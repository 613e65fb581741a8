"""Span -> sample parsing: Envoy's string attributes in, foreign and malformed spans out."""

from __future__ import annotations

import pytest

from gorgo.core.contract import (
    ATTEMPTS_ATTR,
    RESPONSE_FLAGS_ATTR,
    SPAN_PREFIX,
    TERM_FIELDS,
    TTFT_ATTR,
    UPLOAD_ATTR,
)
from gorgo.core.terms import EXCLUDED, TERMS, TTFT
from tests.tuner.conftest import make_log_export, make_record
from tuner.samples import (
    FOREIGN,
    MALFORMED,
    MAX_ATTRIBUTES,
    MAX_CONTAINERS,
    NO_TTFT,
    OUT_OF_RANGE,
    Oversized,
    SpanDropped,
    count_records,
    count_spans,
    parse_export,
    parse_record,
    parse_span,
)

MAX_MS = 600_000.0  # the fleet's default request timeout


def parse(span):
    return parse_span(span, MAX_MS)


def test_envoy_span_becomes_a_sample(span_builders) -> None:
    attrs, span, _ = span_builders
    s = parse(span(attrs(), duration_ms=812.5))
    assert s.ttft_ms == pytest.approx(123.456)
    assert s.e2e_ms == pytest.approx(812.5)
    assert s.status == 200 and s.ok
    assert (s.replica, s.region, s.policy, s.decision_id) == ("r0", "near", "gorgo", "ab-1")
    assert s.weights_version == 3
    assert s.predicted_ttft_ms == 101.5
    assert s.terms == {"rtt": 40.25, "queue": 10.0, "admission": 0.0, "prefill": 51.25,
                       "congestion": 3.5, "penalty": 0.0}
    assert (s.uncached_tokens, s.prompt_tokens) == (512, 1024)
    assert s.end_unix_s == pytest.approx(1_700_000_000.8125)


@pytest.mark.parametrize(("upload", "first_byte", "duration_ms", "ttft_ms", "e2e_ms"), [
    ("2300000", "2423456", 3112.5, 123.456, 812.5), ("-", None, 812.5, 123.456, 812.5),
    (None, None, 812.5, 123.456, 812.5),
    ("900000", "850000", 850.0, 0.0, 0.0)])  # an answer (an error) before the body was all in
def test_the_clients_upload_is_taken_off_ttft_and_e2e(span_builders, upload, first_byte,
                                                      duration_ms, ttft_ms, e2e_ms) -> None:
    """A body trickled in over 2.4 s scored a replica that answered in 35 ms at 2,434 ms: the
    router decides once the request is in, so no choice has a part in its upload. Span and
    TTFT log alike."""
    attrs, span, _ = span_builders
    over = {k: v for k, v in ((UPLOAD_ATTR, upload), (TTFT_ATTR, first_byte)) if v is not None}
    s = parse(span(attrs(**over), duration_ms=duration_ms))
    assert (s.ttft_ms, s.e2e_ms) == (pytest.approx(ttft_ms), pytest.approx(e2e_ms))
    early = parse_record(make_record(attrs(**over)), MAX_MS)
    assert early.ttft_ms == pytest.approx(ttft_ms)


def test_typed_attribute_values_are_accepted(span_builders) -> None:
    attrs, span, _ = span_builders
    s = parse(span(attrs(gorgo__weights_version=4, http__status_code=503,
                              gorgo__rtt_ms=2.5, gorgo__uncached_tokens="64.0")))
    assert (s.weights_version, s.status, s.terms["rtt"], s.uncached_tokens) == (4, 503, 2.5, 64)
    assert not s.ok


def test_every_term_of_the_registry_is_read_from_its_contract_tag(span_builders) -> None:
    """The terms come from the registry, not from a list of fields of the tuner's own."""
    attrs, span, _ = span_builders
    tags = {SPAN_PREFIX + f: str(7.5 + k) for k, f in enumerate(TERM_FIELDS)}
    s = parse(span({**attrs(), **tags}))
    assert s.terms == {t.name: 7.5 + k for k, t in enumerate(TERMS)}
    for t, field in zip(TERMS, TERM_FIELDS, strict=True):
        if TTFT in t.objectives and t.fit != EXCLUDED:  # the predicted TTFT's: strictly
            with pytest.raises(SpanDropped, match=MALFORMED):
                parse(span(attrs(**{SPAN_PREFIX + field: None})))
        else:  # any other term may be absent (a router older than the term)
            assert t.name not in parse(span(attrs(**{SPAN_PREFIX + field: None}))).terms


@pytest.mark.parametrize(("over", "reason"), [
    ({"gorgo__decision_id": None}, FOREIGN),
    ({"gorgo__decision_id": "-"}, FOREIGN),  # Envoy's rendering of absent metadata
    ({"gorgo__decision_id": ""}, FOREIGN),
    ({TTFT_ATTR: "soon"}, MALFORMED),
    ({TTFT_ATTR: "-5"}, MALFORMED),
    ({TTFT_ATTR: "nan"}, MALFORMED),
    ({TTFT_ATTR: "inf"}, MALFORMED),
    ({"http__status_code": None}, MALFORMED),
    ({"http__status_code": "99"}, MALFORMED),
    ({"http__status_code": "2xx"}, MALFORMED),
    ({"gorgo__weights_version": "1.5"}, MALFORMED),
    ({"gorgo__weights_version": "-"}, MALFORMED),
    ({"gorgo__replica": "-"}, MALFORMED),
    ({"gorgo__replica": 7}, MALFORMED),
    ({"gorgo__region": None}, MALFORMED),
    ({"gorgo__rtt_ms": "fast"}, MALFORMED),
    ({"gorgo__queue_ms": True}, MALFORMED),
    ({"gorgo__admission_ms": "-"}, MALFORMED),
    ({"gorgo__uncached_tokens": "1e400"}, MALFORMED),
    ({"gorgo__prompt_tokens": "-1"}, MALFORMED),
    # a forged count past any context window, which would dwarf every real row in the fits
    ({"gorgo__prompt_tokens": "1e30", "gorgo__uncached_tokens": "1e30"}, OUT_OF_RANGE),
    ({"gorgo__prompt_tokens": str(2**31)}, OUT_OF_RANGE),
])
def test_unusable_spans_are_dropped_with_a_reason(span_builders, over, reason) -> None:
    attrs, span, _ = span_builders
    with pytest.raises(SpanDropped) as exc:
        parse(span(attrs(**over)))
    assert exc.value.reason == reason


@pytest.mark.parametrize(("status", "operation", "seen"), [
    ("503", None, 503), ("504", None, 504), ("0", None, 503), ("0", "chat", 503),
    ("200", None, NO_TTFT), ("-", None, MALFORMED),
    # the replica sent a stream's 200 headers and then nothing until a timeout or the client
    # ended it (dropped as no_ttft: a candidate stalling 30 % of its requests was accepted)
    ("200", "chat", 503), ("200", "text_completion", 503)])
def test_a_request_that_ended_with_no_first_byte_is_an_error_never_left_out(
        span_builders, status, operation, seen) -> None:
    """Envoy's own 503/504, or a client that gave up waiting (status 0): scored as a failure,
    waited for its whole E2E; dropping them scored weights that stall requests on the
    survivors."""
    attrs, span, _ = span_builders
    for ttft in (None, "-"):
        over = {TTFT_ATTR: ttft, "http__status_code": status, "gorgo__operation": operation}
        if isinstance(seen, str):  # an empty success (a /health probe) is no error
            with pytest.raises(SpanDropped, match=seen):
                parse(span(attrs(**over)))
            continue
        s = parse(span(attrs(**over), duration_ms=900.0))
        assert (s.status, s.ok) == (seen, False)
        assert s.ttft_ms == pytest.approx(900.0) and s.e2e_ms == pytest.approx(900.0)


@pytest.mark.parametrize(("flags", "cut"), [
    ("UR", True), ("UPE", True), ("DC", True), ("UT,UR", True), ("-", False), ("DI", False),
    (None, False)])
def test_envoys_response_flags_tell_a_cut_stream_from_a_whole_one(span_builders, flags,
                                                                  cut) -> None:
    # A replica's reset or the client leaving after the first byte still reports 200.
    attrs, span, _ = span_builders
    s = parse(span(attrs(**{RESPONSE_FLAGS_ATTR: flags}), duration_ms=812.5))
    assert (s.status, s.ok, s.cut) == (200, True, cut)


@pytest.mark.parametrize(("attempts", "retried"), [("2", True), ("1", False), ("-", False),
                                                   (None, False)])
def test_a_request_envoy_retried_is_marked(span_builders, attempts, retried) -> None:
    attrs, span, _ = span_builders
    assert parse(span(attrs(**{ATTEMPTS_ATTR: attempts}))).retried is retried


def test_a_504_at_the_route_timeout_is_an_error_not_out_of_range(span_builders) -> None:
    """Envoy's route timeout is the request timeout, counted from the request's end: its 504
    span lasts a little longer than max_ms."""
    attrs, span, _ = span_builders
    s = parse(span(attrs(**{TTFT_ATTR: "-"}, http__status_code="504"),
                   duration_ms=MAX_MS + 5.2))
    assert (s.status, s.ok, s.e2e_ms, s.ttft_ms) == (504, False, MAX_MS, MAX_MS)


def test_a_stream_cut_at_the_route_timeout_after_its_first_byte_is_a_cut_sample(
        span_builders) -> None:
    """Its E2E, a little past max_ms as the 504's, dropped it as out of range: its window
    waited for it, then was scored without it (weights that make streams time out looked
    better). A whole stream that long is still out of range."""
    attrs, span, _ = span_builders
    s = parse(span(attrs(**{TTFT_ATTR: "800000", RESPONSE_FLAGS_ATTR: "UT"}),
                   duration_ms=MAX_MS + 6.0))
    assert (s.status, s.cut, s.ttft_ms, s.e2e_ms) == (200, True, 800.0, MAX_MS)
    with pytest.raises(SpanDropped, match=OUT_OF_RANGE):
        parse(span(attrs(**{TTFT_ATTR: "800000"}), duration_ms=MAX_MS + 6.0))
    with pytest.raises(SpanDropped, match=OUT_OF_RANGE):  # far past it: no request's
        parse(span(attrs(**{TTFT_ATTR: "800000", RESPONSE_FLAGS_ATTR: "UT"}),
                   duration_ms=100 * MAX_MS))


def test_a_first_byte_after_the_span_ended_is_malformed(span_builders) -> None:
    attrs, span, _ = span_builders
    with pytest.raises(SpanDropped, match=MALFORMED):
        parse(span(attrs(**{TTFT_ATTR: "5000000"}), duration_ms=800.0))


def test_bad_span_times_are_malformed(span_builders) -> None:
    attrs, span, _ = span_builders
    with pytest.raises(SpanDropped, match=MALFORMED):
        parse(span(attrs(), duration_ms=-1))
    with pytest.raises(SpanDropped, match=MALFORMED):
        parse(span(attrs(), start_ns=0))


def test_export_counts_every_drop_and_keeps_the_rest(span_builders) -> None:
    attrs, span, export = span_builders
    spans = [span(attrs(gorgo__decision_id=f"id-{k}")) for k in range(3)]
    spans += [span({"http.status_code": "200", "component": "other-service"})] * 2
    spans += [span(attrs(gorgo__weights_version="x"))]
    spans += [span(attrs(**{TTFT_ATTR: "-"}, gorgo__decision_id="id-3",
                         http__status_code="504"))]
    samples, dropped = parse_export(export(spans), MAX_MS)
    assert [s.decision_id for s in samples] == ["id-0", "id-1", "id-2", "id-3"]
    assert not samples[3].ok
    assert dropped == {FOREIGN: 2, MALFORMED: 1}
    assert parse_export(export([]), MAX_MS) == ([], {})


@pytest.mark.parametrize(("over", "duration_ms", "reason"), [
    # A TTFT of 1.7e308 us once set a stored p95 of 1.7e305 ms (issue 12, finding 5).
    ({TTFT_ATTR: "1.7e308"}, 800.0, OUT_OF_RANGE),
    ({TTFT_ATTR: str(int(MAX_MS * 1000) + 1)}, 800.0,
     OUT_OF_RANGE),
    ({}, MAX_MS + 1, OUT_OF_RANGE),  # an E2E beyond the request timeout
    ({"gorgo__queue_ms": "1e300"}, 800.0, OUT_OF_RANGE),
    ({"gorgo__predicted_ttft_ms": str(11 * MAX_MS)}, 800.0, OUT_OF_RANGE),
    ({"gorgo__uncached_tokens": "2048"}, 800.0, MALFORMED),  # above the prompt's 1024
    ({"gorgo__weights_version": str(2**63)}, 800.0, MALFORMED),
])
def test_values_no_real_request_can_have_are_dropped(span_builders, over, duration_ms,
                                                     reason) -> None:
    attrs, span, _ = span_builders
    with pytest.raises(SpanDropped) as exc:
        parse(span(attrs(**over), duration_ms=duration_ms))
    assert exc.value.reason == reason
    # A long predicted queue is not one of them: shedding exists for it.
    assert parse(span(attrs(gorgo__queue_ms=str(5 * MAX_MS)))).terms["queue"] == 5 * MAX_MS


def test_an_export_is_parsed_up_to_its_limit_and_tagged_with_its_source(span_builders) -> None:
    attrs, span, export = span_builders
    spans = [span(attrs(gorgo__decision_id=f"id-{k}")) for k in range(5)]
    samples, dropped = parse_export(export(spans), MAX_MS, source=7, limit=3)
    assert [s.decision_id for s in samples] == ["id-0", "id-1", "id-2"] and not dropped
    assert {s.source for s in samples} == {7}


def test_an_item_of_too_many_attributes_is_malformed_unread(span_builders) -> None:
    """Reading a span of 4M attributes held the tuner's event loop 2.0 s."""
    attrs, span, _ = span_builders
    base = attrs()
    at_cap = {**base, **{f"pad.{k}": "x" for k in range(MAX_ATTRIBUTES - len(base))}}
    assert parse(span(at_cap)).decision_id == "ab-1"
    over = {**at_cap, "pad.over": "x"}
    with pytest.raises(SpanDropped, match=f"{MALFORMED}: {MAX_ATTRIBUTES + 1} attributes"):
        parse(span(over))
    with pytest.raises(SpanDropped, match=MALFORMED):
        parse_record(make_record(over), MAX_MS)


def test_an_export_of_too_many_containers_is_oversized_uncounted(span_builders) -> None:
    """Counting the spans of 4M empty resources (an 8 MB export) held the loop 2.2 s: more
    resources and scopes than MAX_CONTAINERS are refused before they are walked."""
    attrs, span, export = span_builders
    req = export([span(attrs())] * 3)
    for _ in range(MAX_CONTAINERS - 2):  # with the first resource and its scope: the cap
        req.resource_spans.add()
    assert count_spans(req) == 3
    req.resource_spans.add()
    with pytest.raises(Oversized, match="resources"):
        count_spans(req)
    req = export([span(attrs())])
    for _ in range(MAX_CONTAINERS):
        req.resource_spans[0].scope_spans.add()
    with pytest.raises(Oversized, match="scopes"):
        count_spans(req)
    logs = make_log_export([make_record(attrs())])
    assert count_records(logs) == 1
    for _ in range(MAX_CONTAINERS):
        logs.resource_logs.add()
    with pytest.raises(Oversized):
        count_records(logs)
