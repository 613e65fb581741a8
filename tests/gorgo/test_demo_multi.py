"""`gorgo demo --proxy-per-region`, shortened: a proxy per region, the same with the routers
sharing their bookings over NATS, then one proxy, and a report that shows each proxy's
traffic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gorgo.cli import main
from gorgo.core.fleet import parse_fleet
from gorgo.demo import REGIONS, LiveRun
from gorgo.demo_multi import client_felt
from gorgo.sim.presets import fleet_document
from gorgo.sim.replay import RequestRecord


@pytest.mark.envoy
@pytest.mark.slow  # seven real Envoys; about 35 s
def test_proxy_per_region_demo_reports_each_proxy(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    # Short chat turns: every request finishes in seconds on the demo's engines.
    assert main(["demo", "--proxy-per-region", "--duration", "2",
                 "--trace", "chat:seed=1,users=20,rate=8", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    per_proxy = report.split("## Per proxy")[1].split("## Requests per replica")[0]
    for g in REGIONS:
        assert f"| proxy {g} |" in per_proxy
    assert "| all proxies |" in per_proxy and "| single proxy |" in per_proxy
    assert "| all proxies shared |" in per_proxy
    assert "With the bookings shared:" in report
    assert "TTFT p95 (ms) | E2E p95 (ms)" in per_proxy
    assert "## Do the routers agree" in report and "with one proxy" in report
    assert "As the clients feel it" in report and "bookings shared: p95 TTFT" in report
    served = {"": 0, "-shared": 0}
    for suffix in served:
        for g in REGIONS:  # every region's clients were served through their own proxy
            lines = (out / f"live-proxy-{g}{suffix}.jsonl").read_text().splitlines()
            assert lines and all(json.loads(line)["outcome"] == "ok" for line in lines)
            served[suffix] += len(lines)
    single = (out / "live-single-proxy.jsonl").read_text().splitlines()
    assert len(single) == served[""] == served["-shared"]  # the same clients each time


def _served(index: int, ttft_ms: float) -> RequestRecord:
    return RequestRecord(index=index, session=None, input_tokens=10, max_tokens=10,
                         scheduled_s=0.0, outcome="ok", ttft_ms=ttft_ms, e2e_ms=ttft_ms + 1000)


def test_the_clients_way_to_their_proxy_is_added() -> None:
    # One client per region, each served in 100 ms: through its own region's proxy it pays the
    # in-region link (37 ms); through the one proxy in us-east, its region's link from there.
    spec = parse_fleet(fleet_document({r: 2 for r in REGIONS}, profile="h100-llama3-8b"))
    client_of = dict(enumerate(REGIONS))
    runs = [LiveRun(f"proxy {g}", [_served(k, 100.0)]) for k, g in enumerate(REGIONS)]
    single = LiveRun("single proxy", [_served(k, 100.0) for k in range(3)])
    lines = client_felt(spec, runs, [], single, client_of)
    assert len(lines) == 2  # the heading, then the proxies' own bookings (no shared run)
    per_region = float(lines[1].split("p95 TTFT ")[1].split(" ms")[0])
    one = float(lines[1].split("one proxy's ")[1].split(" ms)")[0])
    assert per_region == pytest.approx(137.0, abs=1)  # the report gives whole milliseconds
    assert one == pytest.approx(float(np.percentile([137.0, 379.0, 556.0], 95)), abs=1)
    assert client_felt(spec, runs, [], None, client_of) == []


def test_the_clients_figures_count_a_failed_request_as_the_table_does() -> None:
    # A fifth of one proxy's requests failed: its p95 is unbounded in the table, and was read
    # here off the served ones alone (0.58x the one proxy's).
    spec = parse_fleet(fleet_document({r: 2 for r in REGIONS}, profile="h100-llama3-8b"))
    client_of = {k: "us-east" for k in range(100)}
    failed = [RequestRecord(k, None, 10, 10, 0.0, outcome="http_error", status=503)
              for k in range(0, 100, 5)]
    served = [_served(k, 100.0) for k in range(100) if k % 5]
    runs = [LiveRun("proxy us-east", failed + served),
            *(LiveRun(f"proxy {g}", []) for g in REGIONS[1:])]
    single = LiveRun("single proxy", [_served(k, 200.0) for k in range(100)])
    line = client_felt(spec, runs, [], single, client_of)[1]
    assert "p95 TTFT ∞ (- one proxy's" in line and "E2E p95 ∞" in line
