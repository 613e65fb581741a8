import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.engine_metrics import parse_engine_metrics
from gorgo.core.contract import SIM_OUTPUT_KEY
from gorgo.core.features import prompt_text
from gorgo.core.tokens import Tokenization
from gorgo.sim import engine_server
from gorgo.sim.engine import Engine
from gorgo.sim.engine_server import SERVED_BY_HEADER, EngineServer, add_arguments, build_server
from gorgo.sim.profiles import EngineProfile, get_profile

TOK = Tokenization()
MODEL = "test-model"
ROOT = Path(__file__).resolve().parents[2]


def serve(fn, profile: str | EngineProfile = "h100-llama3-8b", speed: float = 20.0, **kw):
    """Run ``fn(server, session)`` against a fresh server on a free port, then stop it."""

    async def main():
        prof = get_profile(profile) if isinstance(profile, str) else profile
        srv = EngineServer(Engine(prof, TOK, speed=speed), TOK, MODEL, **kw)
        await srv.start()
        try:
            async with aiohttp.ClientSession() as session:
                return await fn(srv, session)
        finally:
            await srv.stop()

    return asyncio.run(main())


def parse_sse(text: str) -> list[dict | str]:
    """Events of an SSE body the way OpenAI clients read it: every event is one `data:` line."""
    assert text.endswith("\n\n")
    events: list[dict | str] = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_body(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def stream_chat(srv, session, body) -> tuple[list, aiohttp.ClientResponse]:
    async with session.post(srv.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return parse_sse(await resp.text()), resp


def check_chat_stream(events: list, expect_usage: bool) -> tuple[str, dict | None]:
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage = None
    if expect_usage:
        assert chunks[-1]["choices"] == []
        usage = chunks[-1]["usage"]
        chunks = chunks[:-1]
    choices = [c["choices"][0] for c in chunks]
    finishes = [c["finish_reason"] for c in choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    text = "".join(c["delta"].get("content", "") for c in choices)
    return text, usage


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_streamed_chat_completion_and_prefix_reuse(flavor):
    content = "You are a careful assistant. " * 40
    body = chat_body(content, stream=True, max_tokens=7, stream_options={"include_usage": True})

    async def fn(srv, session):
        events, resp = await stream_chat(srv, session, body)
        assert resp.headers[SERVED_BY_HEADER] == srv.name
        text, usage = check_chat_stream(events, expect_usage=True)
        assert usage["completion_tokens"] == 7
        assert len(text) == 7 * TOK.chars_per_token
        prompt = prompt_text("chat", body)
        assert usage["prompt_tokens"] == TOK.count_tokens(len(prompt))
        assert usage["total_tokens"] == usage["prompt_tokens"] + 7
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        again, _ = await stream_chat(srv, session, body)
        _, usage2 = check_chat_stream(again, expect_usage=True)
        cached = usage2["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < usage2["prompt_tokens"]
        assert cached == len(TOK.block_hashes(prompt)) * TOK.block_tokens

    serve(fn, flavor=flavor)


def test_a_prompt_of_token_ids_is_cached_in_blocks_of_ids_as_the_router_prices_it():
    """Two 2,000-id prompts sharing 1,000 ids: 15 blocks of 64 ids cached, what the router
    prices (the engine paged the decimal text and served 1,728 tokens from cache)."""
    shared = list(range(100_000, 101_000))
    a, b = shared + list(range(200_000, 201_000)), shared + list(range(300_000, 301_000))

    async def fn(srv, session):
        usage = []
        for prompt in (a, b):
            async with session.post(srv.url + "/v1/completions",
                                    json={"model": MODEL, "prompt": prompt, "max_tokens": 2}) as r:
                usage.append((await r.json())["usage"])
        return usage

    first, second = serve(fn)
    assert first["prompt_tokens"] == second["prompt_tokens"] == 2000
    assert second["prompt_tokens_details"]["cached_tokens"] == 1000 // 64 * 64


def test_stream_without_usage_and_stream_interval():
    body = chat_body("hi there", stream=True, max_tokens=10)

    async def fn(srv, session):
        events, _ = await stream_chat(srv, session, body)
        text, usage = check_chat_stream(events, expect_usage=False)
        assert usage is None
        assert len(text) == 10 * TOK.chars_per_token
        content_chunks = [e for e in events[1:-1] if e["choices"][0]["delta"].get("content")]
        # The first token goes out at once, later ones at most one chunk per 4 tokens (a busy
        # client that reads late gets fewer, larger chunks).
        assert 1 <= len(content_chunks) <= 1 + math.ceil(9 / 4)

    serve(fn, stream_interval=4)


def test_non_streaming_chat_and_completions_shapes():
    async def fn(srv, session):
        async with session.post(srv.url + "/v1/chat/completions",
                                json=chat_body("hello", max_completion_tokens=5)) as resp:
            assert resp.status == 200
            assert resp.headers[SERVED_BY_HEADER] == srv.name
            data = await resp.json()
        assert data["object"] == "chat.completion" and data["model"] == MODEL
        choice = data["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] == "length"
        assert len(choice["message"]["content"]) == 5 * TOK.chars_per_token
        assert data["usage"]["completion_tokens"] == 5
        assert data["usage"]["prompt_tokens"] == TOK.count_tokens(len("hello"))

        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3}
        async with session.post(srv.url + "/v1/completions", json=body) as resp:
            data = await resp.json()
        assert data["object"] == "text_completion"
        assert len(data["choices"][0]["text"]) == 3 * TOK.chars_per_token
        assert data["usage"]["prompt_tokens"] == 4

        async with session.post(srv.url + "/v1/completions",
                                json={**body, "stream": True}) as resp:
            events = parse_sse(await resp.text())
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "text_completion" for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks) == data["choices"][0]["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        async with session.post(srv.url + "/v1/chat/completions", json=chat_body("x")) as resp:
            data = await resp.json()
        assert data["usage"]["completion_tokens"] == srv.default_max_tokens

    serve(fn, speed=200.0)


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_metrics_parse_with_the_flavors_names(flavor):
    async def fn(srv, session):
        async with session.post(srv.url + "/v1/chat/completions",
                                json=chat_body("count me " * 30, max_tokens=4)) as resp:
            usage = (await resp.json())["usage"]
        async with session.get(srv.url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        samples = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.endswith("_bucket") or s.name == "vllm:cache_config_info":
                    continue  # vLLM's cache config info carries no model name
                assert s.labels["model_name"] == MODEL
                samples[s.name] = samples.get(s.name, 0) + s.value  # summed over labels
        return samples, usage, parse_engine_metrics(text, flavor)

    samples, usage, load = serve(fn, flavor=flavor)
    # what the router learns the typical output from (`gorgo.core.outputs`): vLLM's per-request
    # histogram (one request of 4 tokens), SGLang's counters
    assert (load.generated, load.finished) == (4.0, 1.0)
    if flavor == "vllm":
        assert samples["vllm:request_generation_tokens_sum"] == 4
        assert samples["vllm:request_generation_tokens_count"] == 1
    p = flavor + ":"
    # the ITL histogram the router calibrates decode from: 3 gaps after the first of 4 tokens
    assert samples[p + "inter_token_latency_seconds_count"] == usage["completion_tokens"] - 1
    assert samples[p + "inter_token_latency_seconds_sum"] > 0
    if flavor == "sglang":
        gauges = ("num_running_reqs", "num_queue_reqs", "token_usage", "cache_hit_rate")
        assert samples["sglang:cached_tokens_total"] == 0
        assert samples["sglang:num_requests_total"] == 1
    else:
        gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        assert samples["vllm:prefix_cache_queries_total"] == usage["prompt_tokens"]
        assert samples["vllm:prefix_cache_hits_total"] == 0
        assert samples["vllm:request_success_total"] == 1
    for g in gauges:
        assert samples[p + g] == 0
    assert samples[p + "prompt_tokens_total"] == usage["prompt_tokens"]
    assert samples[p + "generation_tokens_total"] == 4
    assert samples[p + "time_to_first_token_seconds_count"] == 1
    assert samples[p + "time_to_first_token_seconds_sum"] > 0


def test_models_and_health():
    async def fn(srv, session):
        async with session.get(srv.url + "/health") as resp:
            assert (resp.status, await resp.text()) == (200, "ok")
            assert resp.headers[SERVED_BY_HEADER] == "replica-7"
        async with session.get(srv.url + "/v1/models") as resp:
            data = await resp.json()
        assert data["object"] == "list" and data["data"][0]["id"] == MODEL

    serve(fn, name="replica-7")


def error_of(data: dict) -> dict:
    assert set(data) == {"error"}
    assert {"message", "type", "param", "code"} <= set(data["error"])
    return data["error"]


def test_bad_requests_get_openai_error_bodies():
    async def fn(srv, session):
        url = srv.url + "/v1/chat/completions"
        cases = [
            (b"{not json", None),
            (b"[1, 2]", None),
            (json.dumps({"model": MODEL}).encode(), "messages"),
            (json.dumps(chat_body("x", max_tokens=0)).encode(), "max_tokens"),
            (json.dumps(chat_body("x", stream="yes")).encode(), "stream"),
            (json.dumps(chat_body("x", stream=True, stream_options=3)).encode(),
             "stream_options"),
        ]
        for raw, param in cases:
            async with session.post(url, data=raw,
                                    headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400, raw
                assert resp.headers[SERVED_BY_HEADER] == srv.name
                err = error_of(await resp.json())
                assert err["type"] == "invalid_request_error"
                assert err["param"] == param
        too_long = "y" * (srv.engine.cache.capacity_tokens * 4)
        async with session.post(url, json=chat_body(too_long)) as resp:
            assert resp.status == 400
            assert "KV cache" in error_of(await resp.json())["message"]
        async with session.post(url, json=chat_body("fine", max_tokens=2)) as resp:
            assert resp.status == 200  # still serving

    serve(fn, profile="tiny-test")


def test_full_queue_answers_503():
    profile = replace(get_profile("tiny-test"), max_queue=1)

    async def fn(srv, session):
        srv.slowdown = 2000.0  # the first step takes seconds: later arrivals must queue
        url = srv.url + "/v1/chat/completions"
        first = asyncio.ensure_future(session.post(url, json=chat_body("a", max_tokens=2)))
        await _until(lambda: srv.engine.metrics().num_running == 1)
        second = asyncio.ensure_future(session.post(url, json=chat_body("b", max_tokens=2)))
        await _until(lambda: srv.engine.metrics().num_waiting == 1)
        async with session.post(url, json=chat_body("c", max_tokens=2)) as resp:
            assert resp.status == 503
            err = error_of(await resp.json())
            assert err["type"] == "server_error" and "queue is full" in err["message"]
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)

    serve(fn, profile=profile)


async def _until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def test_client_disconnect_cancels_the_request():
    async def fn(srv, session):
        body = chat_body("long story please", stream=True, max_tokens=100_000)
        resp = await session.post(srv.url + "/v1/chat/completions", json=body)
        assert resp.status == 200
        line = await resp.content.readline()
        assert line.startswith(b"data: ")
        resp.close()
        await _until(lambda: srv.engine.metrics().requests_cancelled == 1)
        m = srv.engine.metrics()
        assert (m.num_running, m.num_waiting, m.kv_usage) == (0, 0, 0)
        assert not srv.engine.has_work()

        plain = asyncio.ensure_future(session.post(srv.url + "/v1/chat/completions",
                                                   json={**body, "stream": False}))
        await _until(lambda: srv.engine.metrics().num_running == 1)
        plain.cancel()  # a non-streaming client giving up closes its connection too
        await _until(lambda: srv.engine.metrics().requests_cancelled == 2)
        assert not srv.engine.has_work()

    serve(fn, speed=1.0)


def test_injected_failures_and_recovery():
    async def fn(srv, session):
        url = srv.url + "/v1/chat/completions"
        srv.fail_mode = "503"
        async with session.post(url, json=chat_body("x", max_tokens=1)) as resp:
            assert resp.status == 503
            assert resp.headers[SERVED_BY_HEADER] == srv.name
            error_of(await resp.json())
        srv.fail_mode = "reset"
        with pytest.raises(aiohttp.ClientError):
            async with session.post(url, json=chat_body("x", max_tokens=1)) as resp:
                await resp.read()
        srv.fail_mode = None
        async with session.post(url, json=chat_body("x", max_tokens=1)) as resp:
            assert resp.status == 200

    serve(fn)


def test_slowdown_stretches_steps():
    profile = get_profile("h100-llama3-8b")
    body = chat_body("z " * 2000, max_tokens=2)  # 1000 prompt tokens: one prefill, one decode
    engine_s = profile.step_time_s(1000, 0, 1000) + profile.step_time_s(0, 1, 1001)

    def timed(slowdown: float) -> float:
        async def fn(srv, session):
            srv.slowdown = slowdown
            loop = asyncio.get_running_loop()
            start = loop.time()
            async with session.post(srv.url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
            return loop.time() - start

        return serve(fn, profile=profile, speed=1.0)

    # Lower bounds only: the server sleeps until each step's end, load can only add to that.
    assert timed(1.0) >= 0.95 * engine_s
    assert timed(5.0) >= 0.95 * 5 * engine_s


def test_servers_in_one_process_are_independent():
    async def main():
        servers = []
        for i, flavor in enumerate(("sglang", "vllm")):
            srv = EngineServer(Engine(get_profile("tiny-test"), TOK, speed=20.0), TOK, MODEL,
                               flavor=flavor, name=f"r{i}")
            await srv.start()
            servers.append(srv)
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(servers[0].url + "/v1/chat/completions",
                             json=chat_body("only r0", max_tokens=2)) as resp,
            ):
                assert resp.headers[SERVED_BY_HEADER] == "r0"
            assert servers[0].engine.metrics().requests_finished == 1
            assert servers[1].engine.metrics().requests_finished == 0
            assert servers[0].port != servers[1].port
        finally:
            for srv in servers:
                await srv.stop()

    asyncio.run(main())


def test_cli_arguments_build_a_server():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--profile", "tiny-test", "--flavor", "vllm", "--speed", "3",
                              "--stream-interval", "2", "--model", "m1", "--name", "n1"])
    srv = build_server(args)
    assert (srv.flavor, srv.model_name, srv.name, srv.stream_interval) == ("vllm", "m1", "n1", 2)
    assert srv.engine.speed == 3.0 and srv.engine.profile.name == "tiny-test"
    assert build_server(parser.parse_args([])).model_name == "h100-llama3-8b"


def test_main_serves_until_sigterm():
    code = ("import argparse, sys\n"
            "from gorgo.sim.engine_server import add_arguments, main\n"
            "p = argparse.ArgumentParser(); add_arguments(p)\n"
            "sys.exit(main(p.parse_args(sys.argv[1:])))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code, "--profile", "tiny-test"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])

        async def probe():
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"http://127.0.0.1:{port}/health") as resp,
            ):
                return resp.status

        assert asyncio.run(probe()) == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_stop_ends_requests_in_flight_promptly():
    async def main():
        srv = EngineServer(Engine(get_profile("h100-llama3-8b"), TOK), TOK, MODEL)
        await srv.start()
        async with aiohttp.ClientSession() as session:
            url = srv.url + "/v1/chat/completions"
            plain = asyncio.ensure_future(session.post(url, json=chat_body("a", max_tokens=10**5)))
            streamed = await session.post(url, json=chat_body("b", max_tokens=10**5, stream=True))
            await _until(lambda: srv.engine.metrics().num_running == 2)
            loop = asyncio.get_running_loop()
            start = loop.time()
            await srv.stop()
            assert loop.time() - start < 1.0
            # Reset, as a crashed engine's connections are: a stream ended cleanly before
            # [DONE] read as a whole answer to Envoy (no UPE flag), and to the tuner.
            with pytest.raises(aiohttp.ClientError):
                await (await plain).read()
            with pytest.raises(aiohttp.ClientPayloadError):
                await streamed.text()
            streamed.close()

    asyncio.run(main())


def test_a_slowdown_set_back_applies_to_the_step_under_way():
    """Chaos: a replica slowed 2000x and set back to 1 finished its step at the old factor
    (20 s for a prompt that takes a tenth of a second)."""
    profile = get_profile("h100-llama3-8b")
    slow_s = 2000 * profile.step_time_s(4000, 0, 4000)

    async def fn(srv, session):
        srv.slowdown = 2000.0
        url = srv.url + "/v1/chat/completions"
        sent = asyncio.ensure_future(session.post(url, json=chat_body("z " * 8000,
                                                                      max_tokens=1)))
        # The engine model has run the step; the server holds its end for the slowed time.
        await _until(lambda: len(srv._pending) == 1 and not srv.engine.has_work())
        srv.slowdown = 1.0
        loop = asyncio.get_running_loop()
        start = loop.time()
        resp = await asyncio.wait_for(sent, slow_s)
        assert resp.status == 200
        return loop.time() - start

    assert slow_s > 60.0
    assert serve(fn, profile=profile, speed=1.0) < slow_s / 4


def test_the_engines_itl_histogram_counts_the_slowdown():
    """What a router reads of a slowed replica's decoding: its clients' inter-token gaps, not
    the unslowed step (61 ms seen, 6 ms reported at 10x)."""
    profile = get_profile("h100-llama3-8b")

    def itl(slowdown: float) -> float:
        async def fn(srv, session):
            srv.slowdown = slowdown
            async with session.post(srv.url + "/v1/chat/completions",
                                    json=chat_body("hi", max_tokens=20)) as resp:
                await resp.read()
            return srv.engine._itl_sum / srv.engine._itl_count

        return serve(fn, profile=profile, speed=20.0)

    assert itl(10.0) == pytest.approx(10 * itl(1.0), rel=0.05)


def test_a_request_naming_no_model_is_served_as_vllm_serves_it():
    """vLLM takes a missing or empty `model` as its served model (the router sends such a
    request to a one-model fleet's replicas); a wrong name is still a 404."""
    async def fn(srv, session):
        url = srv.url + "/v1/chat/completions"
        statuses = []
        for model in (None, "", "other"):
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            if model is not None:
                body["model"] = model
            async with session.post(url, json=body) as resp:
                statuses.append(resp.status)
        return statuses

    assert serve(fn, served=(MODEL,), flavor="vllm") == [200, 200, 404]


def test_a_body_over_the_engines_limit_is_a_json_413(monkeypatch):
    monkeypatch.setattr(engine_server, "MAX_BODY_BYTES", 1024)

    async def fn(srv, session):
        async with session.post(srv.url + "/v1/chat/completions",
                                json=chat_body("x" * 4096)) as resp:
            return resp.status, error_of(await resp.json())

    status, err = serve(fn)
    assert status == 413 and "1024 bytes" in err["message"]


# -- what peer routers call ------------------------------------------------------------------


def test_sglang_load_server_info_and_model_info():
    """sglang-router's power_of_two polls /get_load (a list per DP rank; it sums num_tokens) and
    its worker registration reads /server_info and /model_info (falling back to /get_*)."""
    body = chat_body("a prompt to keep the engine busy " * 30, stream=True, max_tokens=5000)

    async def fn(srv, session):
        async with session.get(srv.url + "/get_load") as resp:
            assert resp.status == 200 and resp.headers[SERVED_BY_HEADER] == srv.name
            idle = await resp.json()
        assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        async with session.post(srv.url + "/v1/chat/completions", json=body) as gen:
            await gen.content.readline()  # first event: the request is running
            async with session.get(srv.url + "/get_load") as resp:
                (busy,) = await resp.json()
        prompt_tokens = TOK.count_tokens(len(prompt_text("chat", body)))
        assert busy["num_reqs"] == 1 and busy["num_waiting_reqs"] == 0
        assert busy["num_tokens"] >= prompt_tokens  # its KV, prompt and generated tokens
        for name in ("server_info", "model_info"):
            async with session.get(f"{srv.url}/{name}") as resp:
                info = await resp.json()
            async with session.get(f"{srv.url}/get_{name}") as resp:
                assert await resp.json() == info
            assert info["model_path"] == MODEL
        async with session.get(srv.url + "/server_info") as resp:
            info = await resp.json()
        assert info["dp_size"] == 1 and info["served_model_name"] == MODEL
        assert info["max_total_num_tokens"] == srv.engine.cache.capacity_tokens
        assert info["page_size"] == TOK.block_tokens
        async with session.post(srv.url + "/v1/chat/completions/render", json=body) as resp:
            assert resp.status == 404  # vLLM's endpoint, not SGLang's

    serve(fn, flavor="sglang")


def test_vllm_render_gives_prefix_stable_token_ids_and_runs_nothing():
    """vllm-router's cache_aware posts each request to /v1/chat/completions/render on every
    worker and keys its prefix tree on ``token_ids``: shared prefixes must share leading ids."""
    shared = "The same long system prompt for everyone. " * 20

    async def fn(srv, session):
        async def render(path, body):
            async with session.post(srv.url + path, json=body) as resp:
                return resp.status, await resp.json()

        status, a = await render("/v1/chat/completions/render",
                                 chat_body(shared + "first question", max_tokens=9))
        _, b = await render("/v1/chat/completions/render", chat_body(shared + "other one"))
        assert status == 200
        assert a["sampling_params"]["max_tokens"] == 9 and a["model"] == MODEL
        n_a = TOK.count_tokens(len(shared + "first question"))
        assert len(a["token_ids"]) == n_a
        assert all(isinstance(t, int) and 0 <= t < 2**17 for t in a["token_ids"])
        common = int(len(shared) // TOK.chars_per_token)
        assert a["token_ids"][:common] == b["token_ids"][:common]
        assert a["token_ids"][common:] != b["token_ids"][common:]
        _, again = await render("/v1/chat/completions/render", chat_body(shared + "first question"))
        assert again["token_ids"] == a["token_ids"]
        status, listed = await render("/v1/completions/render",
                                      {"model": MODEL, "prompt": shared + "first question"})
        assert status == 200 and listed[0]["token_ids"] == a["token_ids"]
        status, err = await render("/v1/chat/completions/render", {"model": MODEL})
        assert status == 400 and error_of(err)["param"] == "messages"
        assert srv.engine.metrics().requests_finished == 0 and not srv.engine.has_work()
        async with session.get(srv.url + "/get_load") as resp:
            assert resp.status == 404  # SGLang's endpoint, not vLLM's

    serve(fn, flavor="vllm")


def parse_typed_sse(text: str) -> list[dict]:
    """Responses API events: each block is an ``event:`` line naming the ``data:`` JSON's type."""
    events = []
    for block in text.strip("\n").split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: "):])
        assert event["type"] == kind[len("event: "):]
        events.append(event)
    return events


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_responses_api_streamed_and_whole(flavor):
    body = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 6,
            "input": [{"role": "user", "content": "Tell me about prefix caches. " * 20}]}
    prompt_tokens = TOK.count_tokens(len(prompt_text("responses", body)))

    async def fn(srv, session):
        async with session.post(srv.url + "/v1/responses", json=body) as resp:
            assert resp.status == 200 and resp.headers[SERVED_BY_HEADER] == srv.name
            whole = await resp.json()
        assert whole["object"] == "response" and whole["id"].startswith("resp_")
        assert whole["status"] == "incomplete"
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
        (item,) = whole["output"]
        assert item["type"] == "message" and item["role"] == "assistant"
        text = item["content"][0]["text"]
        assert item["content"][0]["type"] == "output_text"
        assert len(text) == 6 * TOK.chars_per_token
        usage = whole["usage"]
        assert (usage["input_tokens"], usage["output_tokens"]) == (prompt_tokens, 6)
        assert usage["total_tokens"] == prompt_tokens + 6
        assert usage["input_tokens_details"]["cached_tokens"] == 0

        async with session.post(srv.url + "/v1/responses", json={**body, "stream": True}) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = parse_typed_sse(await resp.text())
        kinds = [e["type"] for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert set(kinds[4:-4]) == {"response.output_text.delta"}
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[0]["response"]["status"] == "in_progress"
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert deltas == events[-4]["text"] == text
        final = events[-1]["response"]
        assert final["output"][0]["id"] == events[2]["item"]["id"] == events[4]["item_id"]
        assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0  # same prefix again

        for bad, param in (({"max_output_tokens": 0}, "max_output_tokens"),
                           ({"previous_response_id": "resp_1"}, "previous_response_id")):
            async with session.post(srv.url + "/v1/responses", json={**body, **bad}) as resp:
                assert resp.status == 400 and error_of(await resp.json())["param"] == param

    serve(fn, flavor=flavor)


@pytest.mark.parametrize("factor", [0, -1.0, float("inf"), float("nan"), 10**400])
def test_a_slowdown_factor_is_finite_and_positive(factor: float) -> None:
    srv = EngineServer(Engine(get_profile("tiny-test"), TOK), TOK, MODEL)
    with pytest.raises(ValueError, match="slowdown factor must be a finite number > 0"):
        srv.slowdown = factor  # 10**400 raised OverflowError
    assert srv.slowdown == 1.0 and srv.engine.speed == 1.0


@pytest.mark.parametrize(("bound", "told", "generated", "finish"), [
    (None, 7, 7, "stop"),  # no max_tokens: the replay says where the request stops
    (5, 7, 5, "length"),  # a cap still cuts
    (40, 7, 7, "stop"),  # a generous cap: stops at the trace's output, at "end of sequence"
    (7, 7, 7, "length"),  # the bound is the output: its limit, as before
    (9, None, 9, "length"),  # nothing told: the bound, as before
])
def test_the_replay_tells_the_engine_where_a_request_stops(
        bound: int | None, told: int | None, generated: int, finish: str) -> None:
    async def fn(srv, session):
        said = {} if told is None else {"metadata": {SIM_OUTPUT_KEY: str(told)}}
        body = chat_body("stop me " * 20, **said,
                         **({} if bound is None else {"max_tokens": bound}))
        async with session.post(srv.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            chat = await resp.json()
        responses = {"model": MODEL, "input": "stop me " * 20, **said,
                     **({} if bound is None else {"max_output_tokens": bound})}
        async with session.post(srv.url + "/v1/responses", json=responses) as resp:
            answer = await resp.json()
        async with session.get(srv.url + "/metrics") as resp:
            page = await resp.text()
        return chat, answer, page

    chat, answer, page = serve(fn, flavor="vllm")
    assert chat["usage"]["completion_tokens"] == generated
    assert chat["choices"][0]["finish_reason"] == finish
    assert answer["usage"]["output_tokens"] == generated
    # the Responses API: "completed" at end of sequence, else "incomplete" at the client's limit
    assert answer["status"] == ("completed" if finish == "stop" else "incomplete")
    assert answer["max_output_tokens"] == (bound if finish == "stop" else generated)
    assert f'finished_reason="{finish}"' in page
    stops = sum(s.value for fam in text_string_to_metric_families(page) for s in fam.samples
                if s.name == "vllm:request_success_total" and s.labels["finished_reason"] == "stop")
    assert stops == (2 if finish == "stop" else 0)


@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5", str(2**21), "9" * 30, 5, None])
def test_a_bad_output_length_is_a_json_400(value: object) -> None:
    async def fn(srv, session):
        body = chat_body("hi", metadata={SIM_OUTPUT_KEY: value})
        async with session.post(srv.url + "/v1/chat/completions", json=body) as resp:
            return resp.status, await resp.json()

    status, body = serve(fn)
    assert status == 400 and SIM_OUTPUT_KEY in body["error"]["message"]
    assert body["error"]["param"] == "metadata"
