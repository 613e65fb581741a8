"""`gorgo demo`, shortened: every process starts, traffic flows, report and plots are written."""

from __future__ import annotations

from pathlib import Path

import pytest

from gorgo.cli import main

pytestmark = [pytest.mark.envoy, pytest.mark.slow]  # real Envoy; about 40 s


def test_short_demo_writes_report_and_plots(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A relative results folder, as `make demo` uses: every process must still find its files.
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "demo"
    rc = main(["demo", "--duration", "8", "--baselines", "round-robin",
               "--offline-policies", "gorgo,round-robin", "--out", "demo"])
    assert rc == 0
    report = (out / "report.md").read_text()
    assert "| gorgo |" in report and "| round-robin |" in report
    assert "Offline simulation" in report
    # TTFT and E2E side by side, as ratios to the best peer; the offline cells have intervals.
    live, offline = report.split("## Live runs")[1].split("## Offline simulation")
    for part in (live, offline):
        assert "| TTFT p95 (ms) | / best peer (round-robin) | E2E p95 (ms) |" in part
    assert " ± " in offline.split("## Where gorgo loses")[0]
    # Where gorgo loses is said for both parts, from the numbers.
    verdicts = report.split("## Where gorgo loses")[1]
    for label in ("Live", "Offline"):
        assert f"- {label}: " in verdicts
    for png in ("ttft_cdf.png", "requests_per_region.png", "tuner_weights.png"):
        assert (out / png).stat().st_size > 5000, png
    lines = (out / "live-gorgo.jsonl").read_text().splitlines()
    assert lines and all('"outcome": "ok"' in line for line in lines)
