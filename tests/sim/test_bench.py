"""Capacity search and `gorgo bench sim` end to end on small slices."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gorgo.cli import main as cli_main
from gorgo.core.fleet import parse_fleet
from gorgo.sim.bench import ci95, goal_check, parse_policies
from gorgo.sim.capacity import analytic_estimate, cached_capacity, find_capacity, is_stable, probe
from gorgo.sim.presets import PRESETS, fleet_document, preset_fleet, resolve_fleet
from gorgo.sim.traces import chat_trace
from gorgo.sim.workload import tokenization, workload_from_requests


def test_presets_match_the_paper_fleet() -> None:
    paper = preset_fleet("paper")
    assert [r.region for r in paper.replicas] == ["us-east"] * 2 + ["eu-frankfurt"] * 2 + [
        "ap-seoul"] * 2
    assert {g.name: (g.rtt_ms, g.jitter_ms) for g in paper.regions} == {
        "us-east": (37.0, 8.0), "eu-frankfurt": (279.0, 80.0), "ap-seoul": (456.0, 138.0)}
    assert paper.proxy_region == "us-east"
    assert all(r.prefill_rate == pytest.approx(1000 / 0.09) for r in paper.replicas)
    hetero = preset_fleet("hetero")
    seoul = [r for r in hetero.replicas if r.region == "ap-seoul"]
    assert all(r.sim.speed == 0.5 and r.prefill_rate == pytest.approx(500 / 0.09) for r in seoul)
    assert {r.region for r in preset_fleet("one-region").replicas} == {"us-east"}
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_fleet("no-such-fleet")
    assert set(PRESETS) == {"paper", "one-region", "hetero"}


def test_fleet_yaml_path_is_accepted(tmp_path: Path) -> None:
    import yaml

    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(fleet_document({"us-east": 1}, name="mine")))
    assert resolve_fleet(str(path)).name == "mine"


def test_capacity_search_brackets_round_robin_stability(tmp_path: Path) -> None:
    spec = parse_fleet(fleet_document({"local": 2}, profile="h100-llama3-8b",
                                      links={"local": {"link": "local"}}))
    w = workload_from_requests("chat", chat_trace(seed=5, users=30, limit=150), tokenization(spec))
    cap = find_capacity(spec, w, key="t", tol=0.05)
    assert 0 < cap.rate_rps < cap.unstable_rps <= 1.05 * cap.rate_rps
    # Prefix reuse lets the fleet beat the no-cache estimate, but not by orders of magnitude.
    assert 0.2 * cap.estimate_rps < cap.rate_rps < 10 * cap.estimate_rps
    assert cap.estimate_rps == pytest.approx(analytic_estimate(spec, w))
    assert cap.reference is not None
    assert is_stable(probe(spec, w, 0.5 * cap.rate_rps), cap.reference)
    assert not is_stable(probe(spec, w, 3.0 * cap.rate_rps), cap.reference)
    # Cached by key: the second lookup does not search.
    path = tmp_path / "capacity.json"
    assert cached_capacity(path, "t", lambda: cap) == cap
    assert cached_capacity(path, "t", lambda: pytest.fail("searched again")) == cap


def test_ci95_and_policy_names() -> None:
    s = ci95([1.0, 2.0, 3.0])
    assert s.mean == 2.0
    assert s.ci95 == pytest.approx(4.302653 * 1.0 / math.sqrt(3), rel=1e-5)
    assert math.isinf(ci95([1.0, math.inf]).mean)
    assert math.isinf(ci95([5.0]).ci95)
    assert parse_policies("all")[-1] == "oracle"
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policies("gorgo,nope")


def test_goal_check_needs_disjoint_intervals() -> None:
    agg = {"0.8": {
        "gorgo": {"ttft_p95_ms": ci95([70, 72, 74]), "e2e_p95_ms": ci95([100, 100, 100])},
        "round-robin": {"ttft_p95_ms": ci95([100, 101, 102]), "e2e_p95_ms": ci95([99, 99, 99])},
        "oracle": {"ttft_p95_ms": ci95([65, 66, 67]), "e2e_p95_ms": ci95([90, 90, 90])},
    }}
    g = goal_check(agg, "0.8")
    assert g["best_ttft_baseline"] == "round-robin"
    assert g["ttft_p95_cis_disjoint"] and g["ttft_p95_goal_met"]
    assert g["e2e_p95_goal_met"] and g["oracle_goal_met"]
    agg["0.8"]["round-robin"]["ttft_p95_ms"] = ci95([60, 100, 140])
    assert not goal_check(agg, "0.8")["ttft_p95_goal_met"]


def test_bench_cli_writes_table_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "sim", "--trace", "chat:seed=1", "--requests", "200", "--fleet", "paper",
            "--policies", "round-robin,gorgo", "--seeds", "2", "--load", "0.8",
            "--out", str(out), "--jobs", "2"]
    assert cli_main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["requests"] == 200
    assert doc["capacity"]["rate_rps"] > 0
    assert len(doc["runs"]) == 2 * 2
    assert {r["leaked_inflight"] for r in doc["runs"]} == {0}
    agg = doc["aggregate"]["0.8"]
    assert set(agg) == {"round-robin", "gorgo"}
    assert agg["gorgo"]["ttft_p95_ms"]["n"] == 2
    assert doc["goal"]["best_ttft_baseline"] == "round-robin"
    md = (out / "results.md").read_text()
    assert "### Load 0.8" in md and "| gorgo |" in md and " ± " in md
    for png in ("ttft_cdf.png", "p95_vs_load.png"):
        data = (out / png).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000
    # The capacity is cached next to --out; --report-only rebuilds the same table, and
    # --write-docs puts it between markers (twice: still one block) with the plots beside.
    assert doc["capacity"]["key"] in json.loads((tmp_path / "capacity.json").read_text())
    docs = tmp_path / "docs" / "results.md"
    docs.parent.mkdir()
    docs.write_text("# Results\n\nintro\n\n## Live cross-check\n\nkept\n")
    for _ in range(2):
        assert cli_main([*argv, "--report-only", "--write-docs", str(docs)]) == 0
    table = md.split("### Load")[1].split("Simulation wall time")[0]
    assert table in (out / "results.md").read_text()
    text = docs.read_text()
    assert text.count("<!-- bench-sim:bench:begin") == 1 and table in text
    assert text.index("bench-sim:bench:end") < text.index("## Live cross-check")
    assert "intro" in text and "kept" in text
    assert (docs.parent / "img" / "bench-ttft_cdf.png").stat().st_size > 5000
