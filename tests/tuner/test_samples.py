"""Span -> sample parsing: Envoy's string attributes in, foreign and malformed spans out."""

from __future__ import annotations

import pytest

from gorgo.core.contract import SPAN_PREFIX, TERM_FIELDS
from gorgo.core.terms import TERMS
from tuner.samples import FOREIGN, MALFORMED, NO_TTFT, SpanDropped, parse_export, parse_span


def test_envoy_span_becomes_a_sample(span_builders) -> None:
    attrs, span, _ = span_builders
    s = parse_span(span(attrs(), duration_ms=812.5))
    assert s.ttft_ms == pytest.approx(123.456)
    assert s.e2e_ms == pytest.approx(812.5)
    assert s.status == 200 and s.ok
    assert (s.replica, s.region, s.policy, s.decision_id) == ("r0", "near", "gorgo", "ab-1")
    assert s.weights_version == 3
    assert s.predicted_ttft_ms == 101.5
    assert s.terms == {"rtt": 40.25, "queue": 10.0, "prefill": 51.25, "penalty": 0.0}
    assert (s.uncached_tokens, s.prompt_tokens) == (512, 1024)
    assert s.end_unix_s == pytest.approx(1_700_000_000.8125)


def test_typed_attribute_values_are_accepted(span_builders) -> None:
    attrs, span, _ = span_builders
    s = parse_span(span(attrs(gorgo__weights_version=4, http__status_code=503,
                              gorgo__rtt_ms=2.5, gorgo__uncached_tokens="64.0")))
    assert (s.weights_version, s.status, s.terms["rtt"], s.uncached_tokens) == (4, 503, 2.5, 64)
    assert not s.ok


def test_every_term_of_the_registry_is_read_from_its_contract_tag(span_builders) -> None:
    """The terms come from the registry, not from a list of fields of the tuner's own."""
    attrs, span, _ = span_builders
    tags = {SPAN_PREFIX + f: str(7.5 + k) for k, f in enumerate(TERM_FIELDS)}
    s = parse_span(span({**attrs(), **tags}))
    assert s.terms == {t.name: 7.5 + k for k, t in enumerate(TERMS)}
    for field in TERM_FIELDS:  # each one is required, strictly
        with pytest.raises(SpanDropped, match=MALFORMED):
            parse_span(span(attrs(**{SPAN_PREFIX + field: None})))


@pytest.mark.parametrize(("over", "reason"), [
    ({"gorgo__decision_id": None}, FOREIGN),
    ({"gorgo__decision_id": "-"}, FOREIGN),  # Envoy's rendering of absent metadata
    ({"gorgo__decision_id": ""}, FOREIGN),
    ({"gen_ai.response.time_to_first_chunk": None}, NO_TTFT),
    ({"gen_ai.response.time_to_first_chunk": "-"}, NO_TTFT),
    ({"gen_ai.response.time_to_first_chunk": "soon"}, MALFORMED),
    ({"gen_ai.response.time_to_first_chunk": "-5"}, MALFORMED),
    ({"gen_ai.response.time_to_first_chunk": "nan"}, MALFORMED),
    ({"gen_ai.response.time_to_first_chunk": "inf"}, MALFORMED),
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
    ({"gorgo__penalty_ms": "-"}, MALFORMED),
    ({"gorgo__uncached_tokens": "1e400"}, MALFORMED),
    ({"gorgo__prompt_tokens": "-1"}, MALFORMED),
])
def test_unusable_spans_are_dropped_with_a_reason(span_builders, over, reason) -> None:
    attrs, span, _ = span_builders
    with pytest.raises(SpanDropped) as exc:
        parse_span(span(attrs(**over)))
    assert exc.value.reason == reason


def test_bad_span_times_are_malformed(span_builders) -> None:
    attrs, span, _ = span_builders
    with pytest.raises(SpanDropped, match=MALFORMED):
        parse_span(span(attrs(), duration_ms=-1))
    with pytest.raises(SpanDropped, match=MALFORMED):
        parse_span(span(attrs(), start_ns=0))


def test_export_counts_every_drop_and_keeps_the_rest(span_builders) -> None:
    attrs, span, export = span_builders
    spans = [span(attrs(gorgo__decision_id=f"id-{k}")) for k in range(3)]
    spans += [span({"http.status_code": "200", "component": "other-service"})] * 2
    spans += [span(attrs(gorgo__weights_version="x"))]
    spans += [span(attrs(**{"gen_ai.response.time_to_first_chunk": "-"}))]
    samples, dropped = parse_export(export(spans))
    assert [s.decision_id for s in samples] == ["id-0", "id-1", "id-2"]
    assert dropped == {FOREIGN: 2, MALFORMED: 1, NO_TTFT: 1}
    assert parse_export(export([])) == ([], {})
