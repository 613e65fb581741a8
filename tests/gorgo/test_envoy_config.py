"""The rendered bootstrap is what Envoy accepts, in every mode we ship."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from gorgo.core.contract import CLUSTER_HEADER, DECISION_FIELDS, ENDPOINTS_HEADER
from gorgo.core.contract import TTFT_ATTR as TTFT_TAG
from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import (
    FLEET_CLUSTER,
    PICKER_CLUSTER,
    TTFT_FORMAT,
    render_bootstrap,
    render_yaml,
)
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
    assert names == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]
    for header in (CLUSTER_HEADER, ENDPOINTS_HEADER):
        assert header in hcm["route_config"]["internal_only_headers"]
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["failure_mode_allow"] is True
    assert ext["processing_mode"]["request_body_mode"] == "BUFFERED"
    routes = [r["route"] for r in hcm["route_config"]["virtual_hosts"][0]["routes"]]
    # picker (ORIGINAL_DST) -> endpoint list with one retry -> single cluster -> default.
    assert [r.get("cluster", r.get("cluster_header")) for r in routes] == [
        PICKER_CLUSTER, FLEET_CLUSTER, CLUSTER_HEADER, spec.default_cluster]
    retry = routes[1]["retry_policy"]
    assert retry["num_retries"] == 1 and retry["retriable_status_codes"] == [503]
    assert "per_try_timeout" not in retry  # a per-try timeout would cut a stream
    fleet = clusters[FLEET_CLUSTER]
    assert len(fleet["load_assignment"]["endpoints"][0]["lb_endpoints"]) == len(spec.replicas)
    assert fleet["circuit_breakers"]["thresholds"][0]["retry_budget"] == {
        "budget_percent": {"value": spec.retries.budget_percent},
        "min_retry_concurrency": spec.retries.min_retry_concurrency}
    tags = {t["tag"]: t["value"] for t in hcm["tracing"]["custom_tags"]}
    assert tags[TTFT_TAG] == TTFT_FORMAT
    for key in DECISION_FIELDS:
        assert tags[f"gorgo.{key}"] == f"%DYNAMIC_METADATA(gorgo:{key})%"


def test_retries_off_keeps_single_cluster_routing() -> None:
    spec = load_fleet(EXAMPLE)
    spec = replace(spec, retries=replace(spec.retries, enabled=False))
    boot = render_bootstrap(spec)
    names = [c["name"] for c in boot["static_resources"]["clusters"]]
    assert FLEET_CLUSTER not in names
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]
    routes = [r["route"] for r in hcm["route_config"]["virtual_hosts"][0]["routes"]]
    assert [r.get("cluster", r.get("cluster_header")) for r in routes] == [
        CLUSTER_HEADER, spec.default_cluster]


def test_cli_writes_yaml(tmp_path: Path) -> None:
    from gorgo.cli import main

    out = tmp_path / "b.yaml"
    assert main(["envoy-config", str(EXAMPLE), "-o", str(out), "--listen", "127.0.0.1:1"]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["static_resources"]["listeners"][0]["address"]["socket_address"][
        "port_value"] == 1
