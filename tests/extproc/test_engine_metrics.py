"""The scraper reads both engines' Prometheus names."""

from __future__ import annotations

import math

import pytest

from extproc.engine_metrics import MAX_READ_LINES, MetricsFormatError, parse_engine_metrics

SGLANG = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",engine_type="unified"} 7.0
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",engine_type="unified"} 12.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",engine_type="unified"} 0.42
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="qwen"} 1234.5
"""

VLLM = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 2.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 8.0
vllm:num_requests_running{engine="1",model_name="llama"} 9.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.7
"""


def test_sglang_names() -> None:
    load = parse_engine_metrics(SGLANG, "sglang")
    assert (load.queue_reqs, load.running_reqs, load.kv_usage) == (7.0, 12.0, 0.42)


def test_vllm_sums_engines_and_averages_usage() -> None:
    load = parse_engine_metrics(VLLM, "vllm")
    assert (load.queue_reqs, load.running_reqs) == (5.0, 17.0)
    assert load.kv_usage == pytest.approx(0.6)


def test_each_sample_is_bounded_before_the_engines_are_summed() -> None:
    # One engine's NaN made the whole sum NaN, read as 0: the other engine's 7 waiting were lost.
    w, r, u = "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
    load = parse_engine_metrics(
        f'{w}{{engine="0"}} 7\n{w}{{engine="1"}} NaN\n{r}{{engine="0"}} +Inf\n'
        f'{r}{{engine="1"}} -Inf\n{u}{{engine="0"}} 0.9\n{u}{{engine="1"}} NaN\n', "vllm")
    assert (load.queue_reqs, load.running_reqs, load.kv_usage) == (7.0, 1e6, 0.9)


def test_a_page_of_too_many_read_lines_is_refused_before_parsing() -> None:
    # 140,000 lines of a read series (within the 16 MiB page limit) held the probes' thread 4.5 s.
    w = "vllm:num_requests_waiting"
    page = VLLM + "".join(f'{w}{{a="{k}"}} 1\n' for k in range(MAX_READ_LINES))
    with pytest.raises(MetricsFormatError, match="lines"):
        parse_engine_metrics(page, "vllm")


def test_old_vllm_usage_name() -> None:
    text = VLLM.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_engine_metrics(text, "vllm").kv_usage == pytest.approx(0.6)


def test_missing_usage_is_nan_and_missing_queue_is_an_error() -> None:
    text = "\n".join(line for line in SGLANG.splitlines() if "token_usage" not in line)
    assert math.isnan(parse_engine_metrics(text + "\n", "sglang").kv_usage)
    with pytest.raises(MetricsFormatError):
        parse_engine_metrics(VLLM, "sglang")



@pytest.mark.parametrize(("labels", "expected"), [
    ('block_size="16",num_gpu_blocks="2048"', (16, 2048)),
    ('block_size="²",num_gpu_blocks="2048"', None),  # isdigit's, not int's: lost the scrape
    ('block_size="99999999999999999999",num_gpu_blocks="2048"', None),  # overflowed the view
    ('block_size="16",num_gpu_blocks="' + "9" * 5000 + '"', None),  # int refuses past 4,300
    ('block_size="0",num_gpu_blocks="2048"', None),
    ('block_size="16"', None),
])
def test_a_cache_config_out_of_any_engines_range_is_no_config_and_the_load_stands(
        labels: str, expected: tuple[int, int] | None) -> None:
    text = VLLM + f'vllm:cache_config_info{{{labels},prefix_caching_hash_algo="sha256"}} 1.0\n'
    load = parse_engine_metrics(text, "vllm")
    assert (load.queue_reqs, load.running_reqs) == (5.0, 17.0)
    got = None if load.cache is None else (load.cache.block_size, load.cache.num_blocks)
    assert got == expected


def test_the_output_counters_of_both_engines() -> None:
    # vLLM counts successes per finish reason and engine: all of them are finished requests
    vllm = VLLM + (
        "# TYPE vllm:generation_tokens counter\n"
        'vllm:generation_tokens_total{engine="0"} 1200\n'
        'vllm:generation_tokens_total{engine="1"} 800\n'
        "# TYPE vllm:request_success counter\n"
        'vllm:request_success_total{engine="0",finished_reason="stop"} 5\n'
        'vllm:request_success_total{engine="0",finished_reason="length"} 2\n'
        'vllm:request_success_total{engine="1",finished_reason="stop"} 3\n'
        'vllm:generation_tokens_created{engine="0"} 1.7e9\n')
    load = parse_engine_metrics(vllm, "vllm")
    assert (load.generated, load.finished) == (2000.0, 10.0)
    sglang = SGLANG + ("# TYPE sglang:generation_tokens counter\n"
                       'sglang:generation_tokens_total{model_name="qwen"} 640\n'
                       "# TYPE sglang:num_requests counter\n"
                       'sglang:num_requests_total{model_name="qwen"} 4\n')
    load = parse_engine_metrics(sglang, "sglang")
    assert (load.generated, load.finished) == (640.0, 4.0)


def test_absent_or_broken_output_counters_are_not_reported() -> None:
    load = parse_engine_metrics(VLLM, "vllm")
    assert math.isnan(load.generated) and math.isnan(load.finished)
    broken = VLLM + ('vllm:generation_tokens_total{engine="0"} 10\n'
                     'vllm:generation_tokens_total{engine="1"} NaN\n'
                     'vllm:request_success_total{engine="0"} +Inf\n')
    load = parse_engine_metrics(broken, "vllm")
    assert math.isnan(load.generated) and math.isnan(load.finished)


def test_vllm_per_request_histogram_comes_first_and_series_count_once() -> None:
    # aborted requests add their tokens to generation_tokens_total but never to
    # request_success_total: the histogram's sum and count are of the same finished requests
    page = VLLM + (
        'vllm:generation_tokens_total{engine="0"} 3620\n'
        'vllm:request_success_total{engine="0",finished_reason="stop"} 20\n'
        "# TYPE vllm:request_generation_tokens histogram\n"
        'vllm:request_generation_tokens_bucket{engine="0",le="+Inf"} 20\n'
        'vllm:request_generation_tokens_sum{engine="0"} 2000\n'
        'vllm:request_generation_tokens_count{engine="0"} 20\n')
    load = parse_engine_metrics(page, "vllm")
    assert (load.generated, load.finished) == (2000.0, 20.0)
    # a series listed twice is one series
    twice = VLLM + ('vllm:generation_tokens_total{engine="0"} 50000000\n' * 2
                    + 'vllm:request_success_total{engine="0"} 10\n')
    assert parse_engine_metrics(twice, "vllm").generated == 5e7
