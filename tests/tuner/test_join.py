"""The TTFT log's entries as early samples, and the join that counts each decision once."""

from __future__ import annotations

import math

import pytest

from gorgo.core.contract import LOG_END, TTFT_ATTR
from tests.tuner.conftest import T0_NS, envoy_attrs, make_log_export, make_record, make_span
from tuner.join import DUPLICATE, END, FIRST, Join
from tuner.samples import FOREIGN, NO_TTFT, parse_export, parse_record, parse_span

MAX_MS = 600_000.0


def test_a_periodic_entry_is_an_early_sample_with_the_spans_fields() -> None:
    s = parse_record(make_record(envoy_attrs()), MAX_MS, source=7)
    span = parse_span(make_span(envoy_attrs()), MAX_MS, source=7)
    assert s.early and not span.early
    assert math.isnan(s.e2e_ms) and s.end_unix_s == 0.0
    assert s.ttft_ms == span.ttft_ms == 123.456
    assert s.arrival_s == span.arrival_s == T0_NS / 1e9
    assert (s.decision_id, s.replica, s.weights_version, s.terms, s.source) == (
        span.decision_id, span.replica, span.weights_version, span.terms, span.source)


def test_entries_that_are_not_a_decisions_ttft_are_dropped_by_reason() -> None:
    records = [make_record(envoy_attrs()), make_record(envoy_attrs(), log_type=LOG_END),
               make_record(envoy_attrs(), log_type="TcpPeriodic"),
               make_record(envoy_attrs(**{TTFT_ATTR: "-"})),
               make_record(envoy_attrs(gorgo__decision_id="-"))]
    samples, dropped = parse_export(make_log_export(records), MAX_MS)
    assert len(samples) == 2 and all(s.early for s in samples)
    assert dropped == {FOREIGN: 2, NO_TTFT: 1}
    # the limit counts records, as it counts spans
    samples, dropped = parse_export(make_log_export(records), MAX_MS, limit=1)
    assert len(samples) == 1 and not dropped


def test_an_out_of_range_ttft_in_a_log_entry_is_no_sample() -> None:
    samples, dropped = parse_export(make_log_export(
        [make_record(envoy_attrs(**{TTFT_ATTR: str(int(MAX_MS * 1000) + 1)}))]), MAX_MS)
    assert not samples and dropped == {"out_of_range": 1}


def early(decision: str):
    return parse_record(make_record(envoy_attrs(gorgo__decision_id=decision)), MAX_MS)


def end(decision: str):
    return parse_span(make_span(envoy_attrs(gorgo__decision_id=decision)), MAX_MS)


def test_each_decision_counts_its_ttft_once_and_its_end_once() -> None:
    j = Join(ttl_s=10.0, clock=lambda: 0.0)
    # a stream's periodic entries, then its end entry, then its span
    assert [j.admit(s) for s in (early("a"), early("a"), early("a"), end("a"), end("a"))] == [
        FIRST, DUPLICATE, DUPLICATE, END, DUPLICATE]
    # a stream shorter than the flush interval: the span may come first
    assert [j.admit(s) for s in (end("b"), early("b"))] == [FIRST, DUPLICATE]


def test_the_join_forgets_a_decision_after_the_request_timeout_and_is_bounded() -> None:
    now = [0.0]
    j = Join(ttl_s=10.0, max_ids=3, clock=lambda: now[0])
    j.admit(early("a"))
    now[0] = 9.0
    assert j.admit(end("a")) == END
    now[0] = 10.5  # no record of "a" can come any more: its id is gone
    j.admit(early("b"))
    assert len(j) == 1
    for k in range(5):
        j.admit(early(f"c{k}"))
    assert len(j) == 3  # the oldest went first
    with pytest.raises(ValueError):
        Join(ttl_s=0.0)


def test_at_the_bound_the_ended_go_before_the_streaming() -> None:
    j = Join(ttl_s=600.0, max_ids=3, clock=lambda: 0.0)
    assert j.admit(early("long")) == FIRST  # a long stream's TTFT, its end minutes away
    for k in range(10):  # many short requests end meanwhile
        assert j.admit(end(f"short{k}")) == FIRST
    assert len(j) == 3 and j.evicted_open == 0
    assert j.admit(end("long")) == END  # counted once: it was FIRST again before
    for k in range(4):
        j.admit(early(f"open{k}"))  # more streaming at once than the bound
    assert len(j) == 3 and j.evicted_open == 1
