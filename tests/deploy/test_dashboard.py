"""The Grafana dashboard and the Prometheus of the compose demo, checked without running either:
every series a panel queries is one the router or the tuner exports, and the provisioning, the
scrape targets and the compose mounts agree with each other."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support.prometheus import exposed, router_families, tuner_families

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "gorgo-router.json"
SERIES = re.compile(r"\bgorgo_[a-z0-9_]+\b")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())["services"]


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def _queries(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    out += [v["query"]["query"] for v in dashboard["templating"]["list"]]
    return out


def _mounts(svc: dict[str, Any]) -> dict[str, str]:
    return {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}


def test_dashboard_queries_only_series_that_are_exported(tmp_path: Path,
                                                         dashboard: dict[str, Any]) -> None:
    names = exposed(router_families() + tuner_families(tmp_path))
    queries = _queries(dashboard)
    used = {m for q in queries for m in SERIES.findall(q)}
    assert used and used <= set(names), sorted(used - set(names))
    # Functions over the right kind of series: rate() of counters and buckets, quantiles of
    # histogram buckets only.
    for q in queries:
        for m in re.finditer(r"histogram_quantile\([^,]+,.*?\b(gorgo_[a-z0-9_]+)", q):
            assert m.group(1).endswith("_bucket") and names[m.group(1)] == "histogram", q
        for m in re.finditer(r"(?:rate|increase)\((gorgo_[a-z0-9_]+)", q):
            assert names[m.group(1)] in ("counter", "histogram"), q
    # The router's headline series are all on it.
    for key in ("gorgo_decisions_total", "gorgo_decision_seconds_bucket",
                "gorgo_request_duration_seconds_bucket", "gorgo_replica_healthy",
                "gorgo_upstream_responses_total", "gorgo_rtt_seconds"):
        assert key in used, key


def test_panels_are_well_formed(dashboard: dict[str, Any]) -> None:
    panels = list(_panels(dashboard))
    assert len({p["id"] for p in panels}) == len(panels)
    uid = yaml.safe_load((REPO / "deploy" / "grafana" / "datasource.yaml").read_text())[
        "datasources"][0]["uid"]
    for p in panels:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"]) and p["gridPos"]["x"] + p["gridPos"][
            "w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == uid and p["targets"] and p["description"], p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])


def test_compose_provisions_grafana_and_scrapes_router_and_tuner(
        services: dict[str, Any]) -> None:
    grafana = _mounts(services["grafana"])
    provider = yaml.safe_load((REPO / "deploy/grafana/dashboards.yaml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert grafana[f"{folder}/{DASHBOARD.name}"] == f"./{DASHBOARD.relative_to(REPO)}"
    assert grafana["/etc/grafana/provisioning/dashboards/gorgo.yaml"] == (
        "./deploy/grafana/dashboards.yaml")
    assert grafana["/etc/grafana/provisioning/datasources/gorgo.yaml"] == (
        "./deploy/grafana/datasource.yaml")
    datasource = yaml.safe_load((REPO / "deploy/grafana/datasource.yaml").read_text())
    url = urlsplit(datasource["datasources"][0]["url"])
    assert url.hostname == "prometheus" and url.port == 9090

    prom = services["prometheus"]
    config_path = next(a for a in prom["command"] if a.startswith("--config.file=")).split("=")[1]
    assert _mounts(prom)[config_path] == "./deploy/prometheus.yaml"
    config = yaml.safe_load((REPO / "deploy/prometheus.yaml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    extproc = services["extproc"]["command"]
    tuner_cfg = yaml.safe_load((REPO / "deploy/tuner.compose.yaml").read_text())
    assert targets == {f"extproc:{extproc[extproc.index('--metrics-port') + 1]}",
                       f"tuner:{tuner_cfg['status_listen'].rsplit(':', 1)[1]}"}
    for name in ("prometheus", "grafana"):  # UIs on the host's loopback only
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name
