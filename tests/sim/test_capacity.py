"""The capacity search's code digest: cached capacities and static tune-bench runs are reused only
by the code that made them."""

from __future__ import annotations

import ast
from pathlib import Path

from gorgo.sim.capacity import SIM_MODULES, cache_key
from gorgo.sim.presets import preset_fleet
from gorgo.sim.traces import TraceRequest
from gorgo.sim.workload import tokenization, workload_from_requests

SIM = Path(__file__).resolve().parents[2] / "gorgo" / "sim"


def _sim_imports(module: str) -> set[str]:
    tree = ast.parse((SIM / f"{module}.py").read_text())
    return {node.module.rsplit(".", 1)[1] for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith("gorgo.sim.")}


def test_the_digest_covers_every_module_a_simulated_run_executes() -> None:
    """`kv_publish` (a precise fleet's cache hits) and `link` were left out: an edit to either
    reused cached capacities made by the code before it."""
    executed = {"offline", *_sim_imports("offline"), *_sim_imports("engine")}
    assert executed <= set(SIM_MODULES), executed - set(SIM_MODULES)


def test_the_key_names_the_requests_not_only_the_trace() -> None:
    """A trace file rewritten in place with 3x longer prompts kept its key: the capacity found
    for the old prompts would have scaled every load 3x."""
    spec = preset_fleet("paper")
    tok = tokenization(spec)

    def key(prompt: int) -> str:
        reqs = [TraceRequest(k, 0.5 * k, prompt, 100) for k in range(20)]
        return cache_key(workload_from_requests("mooncake", reqs, tok), "paper", spec)

    assert key(2000) == key(2000)
    assert key(2000) != key(6000)
