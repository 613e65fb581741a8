"""Read queue length, running requests and KV usage out of SGLang's or vLLM's /metrics text.

Engines label their series (model_name, engine, ...) and a replica may serve several models, so
values of one name are summed over label sets (usage is averaged). Unknown lines are ignored:
engines add metrics between releases and a scrape must not break on them.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

NAMES = {
    "sglang": ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"),
    "vllm": ("vllm:num_requests_waiting", "vllm:num_requests_running",
             "vllm:kv_cache_usage_perc"),
}
# vLLM before 0.10 called KV usage gpu_cache_usage_perc.
ALIASES = {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc"}
# Inter-token latency histograms (cumulative sum and count; the router takes their deltas):
# vLLM's and SGLang's current names first, their older time-per-output-token names after.
ITL_NAMES = {
    "sglang": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    "vllm": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}


@dataclass(frozen=True, slots=True)
class EngineLoad:
    queue_reqs: float
    running_reqs: float
    kv_usage: float
    itl_sum_s: float = float("nan")  # cumulative, NaN when the engine exports no ITL histogram
    itl_count: float = float("nan")


class MetricsFormatError(ValueError):
    """The scrape did not carry the flavor's queue/running metrics."""


def parse_engine_metrics(text: str, flavor: str) -> EngineLoad:
    queue_name, running_name, usage_name = NAMES[flavor]
    sums: dict[str, list[float]] = {queue_name: [], running_name: [], usage_name: []}
    for base in ITL_NAMES[flavor]:
        sums[f"{base}_sum"] = []
        sums[f"{base}_count"] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = ALIASES.get(sample.name, sample.name)
            if name in sums:
                sums[name].append(sample.value)
    if not sums[queue_name] or not sums[running_name]:
        raise MetricsFormatError(f"no {queue_name} / {running_name} in {flavor} metrics")
    usage = sums[usage_name]
    itl = next(((sum(sums[f"{b}_sum"]), sum(sums[f"{b}_count"])) for b in ITL_NAMES[flavor]
                if sums[f"{b}_count"]), (float("nan"), float("nan")))
    return EngineLoad(
        queue_reqs=sum(sums[queue_name]),
        running_reqs=sum(sums[running_name]),
        kv_usage=sum(usage) / len(usage) if usage else float("nan"),
        itl_sum_s=itl[0],
        itl_count=itl[1],
    )
