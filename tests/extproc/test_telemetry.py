"""The router's telemetry without Envoy: metric names and labels, structured log lines, health
endpoints, decision spans, and the collector's span rewrite."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.http_api import make_app, readiness
from extproc.service import ExtProcService
from extproc.signals import Signals
from extproc.telemetry import (
    MAX_MODEL_LABELS,
    MAX_QUEUED_SPANS,
    DecisionSpans,
    RouterMetrics,
    log_event,
    parse_traceparent,
)
from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.contract import (
    EXTPROC_SPAN,
    GENAI_STREAM_ATTR,
    GENAI_TTFC_ATTR,
    TTFT_ATTR,
)
from gorgo.core.fleet import FleetError, parse_fleet
from gorgo.core.otel import ottl_statements, typed_attributes
from gorgo.core.router import Router
from gorgo.core.state import FAILURES_TO_EJECT
from tests.support.prometheus import exposed, naming_problems, router_families, tuner_families

REPO = Path(__file__).resolve().parents[2]
DOC = {
    "regions": {"near": {}, "far": {}},
    "replicas": [{"name": f"r{i}", "region": "near" if i < 2 else "far",
                  "address": f"127.0.0.1:{9 + i}", "engine": "sglang"} for i in range(3)],
    "allow_policy_override": True,
}


def _router() -> Router:
    return Router(parse_fleet(DOC))


def _headers(pairs: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def _request(service: ExtProcService, model: str, status: str = "200") -> None:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    reqs = [
        pb.ProcessingRequest(request_headers=_headers({
            ":path": "/v1/chat/completions", "x-gorgo-policy": "round-robin"})),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(body).encode(),
                                                      end_of_stream=True)),
        pb.ProcessingRequest(response_headers=_headers({":status": status})),
    ]

    async def run() -> None:
        async def it():
            for r in reqs:
                yield r
        async for _ in service.Process(it(), None):
            pass

    asyncio.run(run())


# --- Prometheus ---------------------------------------------------------------------------------


def test_every_exported_metric_name_follows_prometheus_naming(tmp_path: Path) -> None:
    families = router_families() + tuner_families(tmp_path)
    assert len(families) > 20
    problems = {f.name: p for f in families if (p := naming_problems(f.name, f.type))}
    assert problems == {}
    for f in families:
        assert f.documentation, f"{f.name} has no help text"
    # The check does catch what the router exported before it followed the conventions.
    for old in ("gorgo_rtt_ms", "gorgo_penalty_ms", "gorgo_engine_kv_usage",
                "gorgo_prefill_rate_tokens_per_s"):
        assert naming_problems(old, "gauge"), old
    assert naming_problems("gorgo_decision", "histogram")


def test_every_router_family_is_in_the_docs_metrics_table() -> None:
    import re

    doc = (REPO / "docs" / "observability.md").read_text()
    table = doc.split("## Metrics")[1].split("**Renamed**")[0]
    documented = {n.removesuffix("_total") for n in re.findall(r"`(gorgo_[a-z_]+)`", table)}
    exported = {f.name.removesuffix("_total") for f in router_families()}
    assert exported <= documented, sorted(exported - documented)


def test_exposition_has_no_created_series_and_consistent_labels() -> None:
    router = _router()
    metrics = RouterMetrics(router.state, lambda: router.open_requests)
    service = ExtProcService(router, metrics)
    for k in range(3):
        _request(service, "m", "503" if k == 0 else "200")
    text = generate_latest(metrics.registry).decode()
    assert "_created" not in text
    names = exposed(router_families())
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.name in names, sample.name  # what the dashboard test relies on
            if "replica" in sample.labels:
                assert "region" in sample.labels, sample.name
    decisions = metrics.registry.get_sample_value(
        "gorgo_decisions_total",
        {"policy": "round-robin", "replica": "r0", "region": "near", "model": "m"})
    assert decisions == 1
    assert sum(s.value for f in metrics.registry.collect() for s in f.samples
               if s.name == "gorgo_request_duration_seconds_count") == 3
    seconds = {s.labels["replica"]: s.value for f in metrics.registry.collect()
               for s in f.samples if s.name == "gorgo_rtt_seconds"}
    assert set(seconds) == {"r0", "r1", "r2"}


def test_the_model_label_is_bounded() -> None:
    router = _router()
    metrics = RouterMetrics(router.state, lambda: 0)
    labels = [metrics.model(f"model-{k}") for k in range(MAX_MODEL_LABELS + 5)]
    assert labels[:MAX_MODEL_LABELS] == [f"model-{k}" for k in range(MAX_MODEL_LABELS)]
    assert set(labels[MAX_MODEL_LABELS:]) == {"other"}
    assert metrics.model("model-3") == "model-3"  # a known one keeps its label
    assert metrics.model(None) == "none" and metrics.model("") == "none"
    assert metrics.model("x" * 500) == "other"


def _per_replica(metrics: RouterMetrics, sample: str) -> dict[str, float]:
    return {s.labels["replica"]: s.value for fam in metrics.registry.collect()
            for s in fam.samples if s.name == sample}


def test_a_reload_that_removes_a_replica_drops_the_series_the_request_path_keeps() -> None:
    """The request path keeps its series (`RouterMetrics.labelled`); a reload that removes a
    replica removes its series, so a replica of that name back later counts afresh in an
    exported series, never in the removed one's kept child (lost, or counting on from before)."""
    router = _router()
    metrics = RouterMetrics(router.state, lambda: router.open_requests)
    service = ExtProcService(router, metrics)
    for _ in range(3):  # round robin: one request to each replica
        _request(service, "m")
    series = ("gorgo_decisions_total", "gorgo_upstream_responses_total",
              "gorgo_request_duration_seconds_count")
    assert all(_per_replica(metrics, name) == {"r0": 1, "r1": 1, "r2": 1} for name in series)
    metrics.rebind(router.state, ["r0", "r1"])
    assert all(_per_replica(metrics, name) == {"r2": 1} for name in series)
    for _ in range(3):
        _request(service, "m")
    assert all(_per_replica(metrics, name) == {"r0": 1, "r1": 1, "r2": 2} for name in series)


# --- logs ---------------------------------------------------------------------------------------


def test_log_event_is_one_logfmt_line(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("gorgo.test")
    with caplog.at_level(logging.INFO, logger="gorgo.test"):
        log_event(logger, "weights_applied", version=3, rtt=1.5, note="two words", empty="")
    assert caplog.messages == ['event=weights_applied version=3 rtt=1.5 note="two words" '
                               'empty=""']


def test_a_logged_value_cannot_add_a_field_or_a_line(caplog: pytest.LogCaptureFixture) -> None:
    # A peer's bad message is logged as given: its quote ended the value and forged an event.
    logger = logging.getLogger("gorgo.test")
    with caplog.at_level(logging.INFO, logger="gorgo.test"):
        log_event(logger, "peers_bad_message", error='bad [\'x" event=replica_ejected r="a\nb\\\']')
    (line,) = caplog.messages
    assert line == ('event=peers_bad_message error="bad [\'x\\" event=replica_ejected '
                    'r=\\"a\\nb\\\\\']"')
    assert "\n" not in line and line.count("event=") == 2  # the second inside the quoted value


def test_stopping_mid_export_loses_no_span() -> None:
    """stop() cancelled the export loop while a batch was in flight: those spans were neither
    exported nor counted."""
    from prometheus_client import CollectorRegistry, Counter

    class SlowCollector:
        got = 0

        async def Export(self, request, timeout: float) -> None:  # gRPC's name
            await asyncio.sleep(0.5)
            self.got += sum(len(ss.spans) for rs in request.resource_spans
                            for ss in rs.scope_spans)

    async def main() -> tuple[int, float]:
        counter = Counter("gorgo_trace_spans", "", ["result"], registry=CollectorRegistry())
        spans = DecisionSpans("127.0.0.1:1", counter, interval_s=0.01)
        for _ in range(100):
            spans.record((b"\1" * 16, b"\2" * 8), 1, 2, {"gorgo.outcome": "routed"})
        await spans.start()
        spans._stub = stub = SlowCollector()
        await asyncio.sleep(0.1)  # the loop's export of the 100 spans is in flight
        await spans.stop()
        return stub.got, counter.labels("exported")._value.get()

    got, exported = asyncio.run(main())
    assert got >= 100 and exported == 100


def test_ejection_and_readmission_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    router = _router()
    signals = Signals(router, RouterMetrics(router.state, lambda: 0), clock=lambda: 100.0)
    with caplog.at_level(logging.INFO, logger="gorgo.signals"):
        for _ in range(FAILURES_TO_EJECT):
            router.state.record_failed_probe(2, 100.0)
        signals.tick()
        signals.tick()  # no change: no line
        router.state.record_success(2)
        signals.tick()
    assert [r.getMessage().split()[0] for r in caplog.records] == [
        "event=replica_ejected", "event=replica_readmitted"]
    ejected = caplog.records[0]
    assert ejected.levelno == logging.WARNING
    assert "replica=r2 region=far failures=" in ejected.getMessage()
    assert "retry_in_s=" in ejected.getMessage()


def test_a_weight_change_is_one_structured_line(caplog: pytest.LogCaptureFixture) -> None:
    router = _router()

    async def go() -> int:
        app = make_app(RouterMetrics(router.state, lambda: 0), router, "tok")
        async with TestClient(TestServer(app)) as client:
            r = await client.put("/admin/weights", json={"rtt": 1.5, "queue": 0.5, "version": 7},
                                 headers={"authorization": "Bearer tok"})
            return r.status

    with caplog.at_level(logging.INFO, logger="gorgo.admin"):
        assert asyncio.run(go()) == 200
    (line,) = [m for m in caplog.messages if m.startswith("event=weights_applied")]
    assert "version=7" in line and "rtt=1.5" in line and "queue=0.5" in line


# --- health -------------------------------------------------------------------------------------


def test_healthz_and_readyz() -> None:
    router = _router()
    signals = Signals(router, RouterMetrics(router.state, lambda: 0))

    async def go() -> list[tuple[str, int, object]]:
        app = make_app(RouterMetrics(router.state, lambda: 0), router,
                       ready=lambda: readiness(router, signals))
        out = []
        async with TestClient(TestServer(app)) as client:
            for path in ("/healthz", "/readyz"):
                r = await client.get(path)
                body = await (r.json() if path == "/readyz" else r.text())
                out.append((path, r.status, body))
        return out

    # Never started: the signal loop is not alive, so the router is not ready.
    (_, hz, text), (_, rz, doc) = asyncio.run(go())
    assert (hz, text) == (200, "ok")
    assert rz == 503 and doc == {"ready": False, "checks": {
        "fleet_loaded": True, "routable_replica": True, "signal_loop": False}}
    signals.alive = lambda: True  # a running loop, as the e2e test shows for real
    assert asyncio.run(go())[1][1] == 200
    router.state.healthy[:] = False
    (_, _, _), (_, rz, doc) = asyncio.run(go())
    assert rz == 503 and doc["checks"]["routable_replica"] is False


# --- spans --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "parsed"), [
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
     (bytes.fromhex("0af7651916cd43dd8448eb211c80319c"), bytes.fromhex("b7ad6b7169203331"))),
    ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00", None),  # not sampled
    ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None),  # invalid trace id
    ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None),  # invalid version
    ("00-xyz-b7ad6b7169203331-01", None),
    ("", None),
    (None, None),
])
def test_traceparent(value: str | None, parsed: tuple | None) -> None:
    assert parse_traceparent(value) == parsed


def test_decision_spans_drop_when_full_and_count_failed_exports() -> None:
    router = _router()
    counter = RouterMetrics(router.state, lambda: 0).spans.counter
    spans = DecisionSpans("127.0.0.1:1", counter, interval_s=3600)  # nothing listens there
    parent = (b"\1" * 16, b"\2" * 8)
    for _ in range(MAX_QUEUED_SPANS + 3):
        spans.record(parent, 1, 2, {"gorgo.outcome": "routed"})

    async def go() -> None:
        await spans.start()
        await spans.stop()  # flushes once: the export fails

    asyncio.run(go())
    assert counter.labels("dropped")._value.get() == 3
    assert counter.labels("failed")._value.get() > 0
    assert counter.labels("exported")._value.get() == 0


# --- the collector's rewrite --------------------------------------------------------------------


def test_the_shipped_collector_config_runs_the_same_rewrite() -> None:
    cfg = yaml.safe_load((REPO / "deploy" / "otel-collector.yaml").read_text())
    transform = cfg["processors"]["transform/genai"]
    assert transform["error_mode"] == "ignore"
    (group,) = transform["trace_statements"]
    assert group["context"] == "span" and group["statements"] == ottl_statements()
    for name, pipeline in cfg["service"]["pipelines"].items():
        if name.startswith("traces"):  # the logs pipelines carry Envoy's TTFT log, no spans
            assert pipeline["processors"][0] == "transform/genai", name


@pytest.mark.parametrize(("attrs", "expected"), [
    ({TTFT_ATTR: "1500", "gorgo.stream": "true"},
     {GENAI_STREAM_ATTR: True, GENAI_TTFC_ATTR: 0.0015}),
    ({TTFT_ATTR: "1500", "gorgo.stream": "false"}, {GENAI_STREAM_ATTR: False}),
    ({TTFT_ATTR: "-", "gorgo.stream": "true"}, {GENAI_STREAM_ATTR: True}),  # no first byte
    ({TTFT_ATTR: "1e3", "gorgo.stream": "true"}, {GENAI_STREAM_ATTR: True}),
    ({TTFT_ATTR: "²", "gorgo.stream": "true"}, {GENAI_STREAM_ATTR: True}),  # was a ValueError
    ({TTFT_ATTR: "9" * 5000, "gorgo.stream": "true"}, {GENAI_STREAM_ATTR: True}),  # too
    ({TTFT_ATTR: "1500", "gorgo.stream": "-", "gorgo.model": "-"}, {}),  # not a decided request
])
def test_typed_attributes(attrs: dict[str, str], expected: dict) -> None:
    added = {k: v for k, v in typed_attributes("ingress", attrs).items() if k not in attrs}
    assert added == expected
    # Only Envoy's stream span loses its "canceled", and only that tag.
    assert typed_attributes("other", {"status": "canceled"}) == {"status": "canceled"}
    assert typed_attributes(EXTPROC_SPAN, {"status": "canceled", "component": "proxy"}) == {
        "component": "proxy"}


@pytest.mark.parametrize(("observability", "error"), [
    ({"access_log": "yes"}, r"^fleet\.observability\.access_log: expected true or false"),
    ({"acces_log": True}, r"^fleet\.observability\.acces_log: unknown field"),
    ({"access_log": True, "access_log_path": ""}, r"^fleet\.observability\.access_log_path:"),
])
def test_the_fleet_observability_section_is_strict(observability: dict, error: str) -> None:
    with pytest.raises(FleetError, match=error):
        parse_fleet({**DOC, "observability": observability})
    assert parse_fleet(DOC).observability.access_log is False


def test_the_learned_output_length_is_exported() -> None:
    router = _router()
    metrics = RouterMetrics(router.state, lambda: 0)
    value = metrics.registry.get_sample_value
    s = router.state
    labels = [{"replica": name, "region": s.regions[s.region_idx[i]]}
              for i, name in enumerate(s.names)]
    assert all(math.isnan(value("gorgo_output_tokens_typical", x)) for x in labels)
    assert all(math.isnan(value("gorgo_max_tokens_typical", x)) for x in labels)
    s.observe_engine(0, 0.0, 0, 0, 0.1, generated=0.0, finished=0.0)
    s.observe_engine(0, 1.0, 0, 0, 0.1, generated=180.0 * 30, finished=30.0)
    s.outputs.sent(0, 4096)
    # one model: every replica shows its estimate
    assert [value("gorgo_output_tokens_typical", x) for x in labels] == pytest.approx(
        [180.0] * s.n)
    assert [value("gorgo_max_tokens_typical", x) for x in labels] == pytest.approx(
        [4096.0] * s.n)
