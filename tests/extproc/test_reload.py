"""The fleet reloader (`extproc/reload.py`) in-process: what a reload says when it changes more
than the operator asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from extproc.reload import FleetReloader
from extproc.telemetry import RouterMetrics
from gorgo.core.fleet import load_fleet, parse_fleet
from gorgo.core.router import Router

DOC = {"regions": {"a": {}}, "replicas": [
    {"name": f"r{i}", "region": "a", "engine": "sglang", "address": f"10.0.0.{i + 1}:8000"}
    for i in range(2)]}


def test_a_reload_that_turns_retries_off_says_so(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Retries are on while every address is an IP: an admin add of a DNS-named replica turned
    # them off with nothing said.
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(DOC))
    router = Router(load_fleet(path))
    assert router.spec.retries.enabled
    reloader = FleetReloader(router, RouterMetrics(router.state, lambda: 0), router.reload,
                             path, lambda doc, source: parse_fleet(doc, source))
    named = {**DOC, "replicas": [*DOC["replicas"], {
        "name": "r2", "region": "a", "engine": "sglang", "address": "vllm-2.vllm:8000"}]}
    with caplog.at_level("WARNING", logger="gorgo.reload"):
        reloader.apply_doc(named, "admin add")
    assert not router.spec.retries.enabled
    assert any("event=retries_off" in r.getMessage() and "vllm-2.vllm:8000" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
