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
    for png in ("ttft_cdf.png", "requests_per_region.png", "tuner_weights.png"):
        assert (out / png).stat().st_size > 5000, png
    lines = (out / "live-gorgo.jsonl").read_text().splitlines()
    assert lines and all('"outcome": "ok"' in line for line in lines)
