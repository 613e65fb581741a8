"""`gorgo demo --proxy-per-region`, shortened: a proxy per region, the same with the routers
sharing their bookings over NATS, then one proxy, and a report that shows each proxy's
traffic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gorgo.cli import main
from gorgo.demo import REGIONS

pytestmark = [pytest.mark.envoy, pytest.mark.slow]  # seven real Envoys; about 35 s


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
    served = {"": 0, "-shared": 0}
    for suffix in served:
        for g in REGIONS:  # every region's clients were served through their own proxy
            lines = (out / f"live-proxy-{g}{suffix}.jsonl").read_text().splitlines()
            assert lines and all(json.loads(line)["outcome"] == "ok" for line in lines)
            served[suffix] += len(lines)
    single = (out / "live-single-proxy.jsonl").read_text().splitlines()
    assert len(single) == served[""] == served["-shared"]  # the same clients each time
