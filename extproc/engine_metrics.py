"""Read queue length, running requests and KV usage out of SGLang's or vLLM's /metrics text, and
the counters of tokens generated and requests finished (the typical output length,
`gorgo.core.outputs`).

Engines label their series (model_name, engine, ...) and a replica may serve several models, so
values of one name are summed over label sets (usage is averaged), each sample within its bounds
first: one engine's NaN or infinite count once made the whole sum NaN, read as 0. Unknown lines
are ignored: engines add metrics between releases and a scrape must not break on them.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from gorgo.core.decimals import whole_number
from gorgo.core.kv_events import MAX_GPU_BLOCKS, block_size_ok
from gorgo.core.outputs import MAX_COUNTER
from gorgo.core.state import MAX_ENGINE_REQS, scraped

NAMES = {
    "sglang": ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"),
    "vllm": ("vllm:num_requests_waiting", "vllm:num_requests_running",
             "vllm:kv_cache_usage_perc"),
}
# vLLM before 0.10 called KV usage gpu_cache_usage_perc.
ALIASES = {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc"}
# Counters of tokens generated and of requests finished (vLLM: one series per finish reason,
# summed), as their samples are named; first where a page has it, a histogram of the tokens each
# finished request generated (its sum and count are of the same requests: the counters also count
# aborted requests' tokens, never the requests).
COUNTERS = {
    "sglang": ("sglang:generation_tokens_total", "sglang:num_requests_total"),
    "vllm": ("vllm:generation_tokens_total", "vllm:request_success_total"),
}
PER_REQUEST = {
    "sglang": None,
    "vllm": ("vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count"),
}


CACHE_CONFIG = "vllm:cache_config_info"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """vLLM's cache_config_info labels: the KV block size and pool the engine really has, and the
    prefix-cache hash algorithm (so neither is configured by hand)."""

    block_size: int
    num_blocks: int
    hash_algo: str | None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    queue_reqs: float
    running_reqs: float
    kv_usage: float
    generated: float = float("nan")  # the counters (NaN: not on the page)
    finished: float = float("nan")
    cache: CacheConfig | None = None


def _cache_config(labels: dict[str, str]) -> CacheConfig | None:
    """The config of one cache_config_info sample; None without a usable block size and pool."""
    size = whole_number(labels.get("block_size", "")) or 0
    blocks = whole_number(labels.get("num_gpu_blocks", "")) or 0
    if not (block_size_ok(size) and 0 < blocks <= MAX_GPU_BLOCKS):
        return None
    return CacheConfig(size, blocks, labels.get("prefix_caching_hash_algo") or None)


class MetricsFormatError(ValueError):
    """The scrape did not carry the flavor's queue/running metrics."""


def _lines_of(names: tuple[str, ...]) -> re.Pattern[str]:
    alt = "|".join(re.escape(n) for n in names)
    return re.compile(rf"^(?:# (?:TYPE|HELP) )?(?:{alt})(?:[{{ \t].*)?$", re.MULTILINE)


# The lines each flavor reads (samples and their TYPE/HELP lines; a counter's or a histogram's
# TYPE line names its family, not the samples read, which parse as untyped). An engine's page holds
# thousands of histogram buckets the router never reads; the Prometheus parser costs about
# 0.2 s a megabyte, on the thread that also times the RTT probes.
_OUTPUT_NAMES = {flavor: (*COUNTERS[flavor], *(PER_REQUEST[flavor] or ())) for flavor in NAMES}
_READ = {flavor: _lines_of((*names, *ALIASES, CACHE_CONFIG, *_OUTPUT_NAMES[flavor]))
         for flavor, names in NAMES.items()}
# The most of those lines a page may hold (an engine has one per model and rank, with TYPE and
# HELP): 140,000 of them, within the page size limit, once held that thread 4.5 s.
MAX_READ_LINES = 10_000


def _counter(series: dict[tuple, float]) -> float:
    """A counter summed over its series (models, ranks, finish reasons), each label set once (a
    series listed twice was added twice); NaN when absent or when a series is not a finite count
    (the sum would mislead the increments)."""
    values = series.values()
    if not values or not all(0.0 <= v < MAX_COUNTER for v in values):
        return float("nan")
    return sum(values)


def parse_engine_metrics(text: str, flavor: str) -> EngineLoad:
    queue_name, running_name, usage_name = NAMES[flavor]
    sums: dict[str, list[float]] = {queue_name: [], running_name: [], usage_name: []}
    counters: dict[str, dict[tuple, float]] = {name: {} for name in _OUTPUT_NAMES[flavor]}
    cache = None
    lines = [m[0] for m in itertools.islice(_READ[flavor].finditer(text), MAX_READ_LINES + 1)]
    if len(lines) > MAX_READ_LINES:
        raise MetricsFormatError(f"over {MAX_READ_LINES} lines of the series read")
    text = "\n".join(lines) + "\n"
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = ALIASES.get(sample.name, sample.name)
            if name in sums:
                sums[name].append(sample.value)
            elif name in counters:
                counters[name][tuple(sorted(sample.labels.items()))] = sample.value
            elif name == CACHE_CONFIG and cache is None:
                cache = _cache_config(sample.labels)
    if not sums[queue_name] or not sums[running_name]:
        raise MetricsFormatError(f"no {queue_name} / {running_name} in {flavor} metrics")
    usage = [scraped(u, 1.0, 0.0) for u in sums[usage_name] if u == u]  # NaN: not reported
    generated, finished = (_counter(counters[n]) for n in COUNTERS[flavor])
    if PER_REQUEST[flavor] is not None:
        per_request = tuple(_counter(counters[n]) for n in PER_REQUEST[flavor])
        if all(v == v for v in per_request):
            generated, finished = per_request
    return EngineLoad(
        queue_reqs=sum(scraped(v, MAX_ENGINE_REQS, 0.0) for v in sums[queue_name]),
        running_reqs=sum(scraped(v, MAX_ENGINE_REQS, 0.0) for v in sums[running_name]),
        kv_usage=sum(usage) / len(usage) if usage else float("nan"),
        generated=generated,
        finished=finished,
        cache=cache,
    )
