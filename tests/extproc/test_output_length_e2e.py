"""The output the decode terms price, learned live (`gorgo.core.outputs`): clients send one
generous cap through real Envoy to the simulated fleet, whose engines stop where the trace's
answers end (`gorgo replay --trace NAME:max_tokens=N`); the router learns the typical output
from the engines' counters and prices a capped request at it, not at the cap."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gorgo.core.tokens import Tokenization
from gorgo.harness.procs import wait_for
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.presets import fleet_document
from gorgo.sim.replay import replay
from gorgo.sim.traces import azure_trace

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

CAP = 4096
REQUESTS = 60


def test_a_capped_clients_requests_are_priced_at_the_output_the_engines_report(
        tmp_path: Path) -> None:
    doc = fleet_document({"near": 2}, profile="h100-llama3-8b",
                         links={"near": {"rtt_ms": 2.0, "jitter_ms": 0.2}}, name="outputs")
    doc["signals"] = {"scrape_interval_s": 0.5, "metrics_stale_s": 2.0}
    doc["timeouts"] = {"request_s": 60}
    reqs = azure_trace(limit=REQUESTS)
    t0 = reqs[0].arrival_s
    # short answers of varied lengths (the engines generate them in a few seconds)
    reqs = [replace(r, arrival_s=r.arrival_s - t0, output_tokens=min(r.output_tokens, 40))
            for r in reqs]
    scale = REQUESTS / 20.0 / reqs[-1].arrival_s  # 20 requests a second
    with LiveStack(with_free_ports(doc), tmp_path, StackOptions(stream_interval=16)) as stack:
        tok = Tokenization(stack.spec.chars_per_token, stack.spec.block_tokens)
        result = asyncio.run(replay(reqs, stack.url, scale, tok=tok, timeout_s=60, bound=CAP))
        records = result.records
        assert [r.outcome for r in records] == ["ok"] * REQUESTS
        # every engine stopped where the trace said, not at the cap
        assert [r.completion_tokens for r in records] == [r.output_tokens for r in reqs]
        mean = float(np.mean([r.output_tokens for r in reqs]))

        def learned() -> bool:
            typical = stack.metric_values("gorgo_output_tokens_typical").values()
            return len(typical) == 2 and all(abs(v - mean) < 0.1 * mean for v in typical)

        assert wait_for(learned, 15, 0.2), stack.metric_values("gorgo_output_tokens_typical")
        assert set(stack.metric_values("gorgo_max_tokens_typical").values()) == {float(CAP)}
        body = {"model": "m", "max_tokens": CAP,
                "messages": [{"role": "user", "content": "how long " * 20}]}
        rows = stack.explain(body)["replicas"]
        itl = 6.0  # the decode term's base step (its default): 4,096 tokens would be 24.6 s
        assert all(row["decode_ms"] < 3 * mean * itl for row in rows), rows
        assert stack.wait_idle(30)
