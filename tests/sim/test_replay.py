"""Open-loop replay against a small local SSE server running in its own thread."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from gorgo.core.contract import SIM_OUTPUT_KEY
from gorgo.core.tokens import Tokenization
from gorgo.errors import UserError
from gorgo.sim.replay import (
    EXIT_INTERRUPTED,
    RequestRecord,
    add_arguments,
    endpoint_url,
    main,
    replay,
    select_window,
    summarize_records,
)
from gorgo.sim.stats import percentile, rate_per_s, summarize
from gorgo.sim.traces import TraceRequest, load_trace

HOST = "127.0.0.1"
TOK = Tokenization()
REPO = Path(__file__).resolve().parents[2]


class SSEServer:
    """Streams ``max_tokens`` (capped at 4) chunks 5 ms apart.

    ``user == "fail"`` gets a 503, ``user == "slow"`` (or header ``x-test-delay``) waits first;
    header ``x-test-chunk-tokens: N`` counts N tokens per chunk in the usage (else 4 in all);
    ``x-test-reasoning: N`` makes the first N chunks a reasoning model's thinking.
    """

    def __init__(self) -> None:
        self.port = 0
        self.received: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SSEServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0
        )
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, HOST, 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        user = body.get("user")
        if user == "fail":
            return web.Response(status=503, text="overloaded")
        delay = 30.0 if user == "slow" else float(request.headers.get("x-test-delay", "0"))
        await asyncio.sleep(delay)
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-gorgo-replica": "r1"}
        )
        await resp.prepare(request)
        chat = "messages" in body
        thinking = int(request.headers.get("x-test-reasoning", "0"))  # reasoning chunks first
        for k in range(min(int(body.get("max_tokens", 1)), 4)):
            await asyncio.sleep(0.005)
            delta = {"reasoning_content": f"r{k} "} if k < thinking else {"content": f"t{k} "}
            choice = {"delta": delta} if chat else {"text": f"t{k} "}
            await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        per_chunk = int(request.headers.get("x-test-chunk-tokens", "0"))
        usage = {
            "prompt_tokens": TOK.count_tokens(len(prompt)),
            "completion_tokens": per_chunk * (k + 1) if per_chunk else 4,
            "prompt_tokens_details": {"cached_tokens": 64},
        }
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def server() -> Iterator[SSEServer]:
    with SSEServer() as s:
        yield s


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _requests(n: int, rate: float, session: str | None = None) -> list[TraceRequest]:
    return [
        TraceRequest(i, i / rate, 200, 3, session=session, parts=((f"r{i}", 200),))
        for i in range(n)
    ]


@pytest.mark.slow
def test_fires_on_schedule_and_measures_latency(server: SSEServer) -> None:
    n = 100  # 2 s at 50 req/s
    reqs = _requests(n, rate=50.0)
    seen: list[RequestRecord] = []
    result = asyncio.run(
        replay(reqs, f"http://{HOST}:{server.port}", 1.0, tok=TOK, on_result=seen.append)
    )
    assert not result.interrupted
    assert len(result.records) == len(seen) == n
    assert [r.index for r in result.records] == list(range(n))
    summary = result.summary
    assert summary["ok"] == n and summary["errors"] == {}
    # Never early, and kept up: the typical send is on time and even the late tail stays under
    # two 20 ms inter-arrival gaps (a loaded machine delays wake-ups, it never advances them).
    slip = summary["slip_ms"]
    assert slip["min"] > -0.01 and slip["p50"] < 5.0 and slip["p99"] < 40.0, slip
    assert summary["req_per_s"] == pytest.approx(50.0, rel=0.05)
    for rec in result.records:
        assert rec.scheduled_s == pytest.approx(rec.index / 50.0, abs=1e-6)
        assert rec.status == 200 and rec.outcome == "ok"
        assert rec.ttft_ms is not None and rec.e2e_ms is not None
        assert 4.0 < rec.ttft_ms <= rec.e2e_ms < 1000.0
        assert rec.chunks == 3
        assert rec.chunk_gap_mean_ms is not None and rec.chunk_gap_mean_ms > 0.0
        assert rec.prompt_tokens == 200 and rec.cached_tokens == 64
        assert rec.completion_tokens == 4
        assert rec.replica == "r1"
    assert summary["replicas"] == {"r1": n}
    assert summary["cache_hit_ratio"] == pytest.approx(64 / 200)
    assert server.received[0]["stream_options"] == {"include_usage": True}


def test_errors_are_recorded_not_raised(server: SSEServer) -> None:
    reqs = [*_requests(4, rate=100.0, session="fail"), TraceRequest(10, 0.0, 50, 2)]
    result = asyncio.run(replay(reqs, f"http://{HOST}:{server.port}", tok=TOK))
    by_index = {r.index: r for r in result.records}
    assert by_index[10].outcome == "ok"
    for i in range(4):
        assert by_index[i].status == 503
        assert by_index[i].outcome == "http_error"
        assert by_index[i].error == "overloaded"
    assert result.summary["errors"] == {"503": 4}

    down = asyncio.run(replay(_requests(3, rate=100.0), f"http://{HOST}:{_closed_port()}"))
    assert [r.outcome for r in down.records] == ["connection_error"] * 3
    assert all(r.status is None and r.error for r in down.records)
    assert down.summary["errors"] == {"connection_error": 3}
    assert down.summary["ok"] == 0 and down.summary["ttft_ms"]["count"] == 0


def test_timeout_and_stop_cancel_in_flight_requests(server: SSEServer) -> None:
    url = f"http://{HOST}:{server.port}"
    timed = asyncio.run(replay(_requests(2, 100.0, "slow"), url, timeout_s=0.3))
    assert [r.outcome for r in timed.records] == ["timeout", "timeout"]

    async def stopped() -> tuple[float, object]:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.4, stop.set)
        t0 = time.monotonic()
        reqs = [*_requests(3, 20.0, "slow"), TraceRequest(99, 60.0, 10, 1)]
        result = await replay(reqs, url, stop=stop)
        return time.monotonic() - t0, result

    elapsed, result = asyncio.run(stopped())
    assert elapsed < 5
    assert result.interrupted  # type: ignore[attr-defined]
    records = result.records  # type: ignore[attr-defined]
    assert [r.index for r in records] == [0, 1, 2]  # the unsent request is not recorded
    assert {r.outcome for r in records} == {"cancelled"}


def test_completions_endpoint_and_urls(server: SSEServer) -> None:
    assert endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1/", "completions") == "http://h:1/v1/completions"
    assert endpoint_url("http://h:1/custom/path", "chat") == "http://h:1/custom/path"
    with pytest.raises(ValueError):
        endpoint_url("http://h:1", "embeddings")
    progress = io.StringIO()
    result = asyncio.run(
        replay(
            _requests(3, 100.0),
            f"http://{HOST}:{server.port}",
            endpoint="completions",
            progress=progress,
        )
    )
    assert all(r.outcome == "ok" and r.chunks == 3 for r in result.records)
    assert "prompt" in server.received[0]
    last = progress.getvalue().rstrip("\n").split("\r")[-1]
    assert last.startswith("sent 3  done 3  errors 0  ttft p50/p95 ")


def test_itl_is_per_token_not_per_chunk(server: SSEServer) -> None:
    # An engine streams several tokens per chunk (8 in `gorgo demo`): the mean gap between
    # chunks (217 ms) was reported as ITL beside the offline table's per-token one (30 ms).
    reqs = [TraceRequest(i, i / 100.0, 200, 4, parts=((f"r{i}", 200),)) for i in range(3)]
    result = asyncio.run(replay(reqs, f"http://{HOST}:{server.port}",
                                headers={"x-test-chunk-tokens": "8"}))
    for rec in result.records:
        assert rec.chunks == 4 and rec.completion_tokens == 32
        assert rec.ttft_ms is not None and rec.e2e_ms is not None and rec.itl_ms is not None
        assert rec.itl_ms == pytest.approx((rec.e2e_ms - rec.ttft_ms) / 31)
        assert rec.chunk_gap_mean_ms is not None and rec.chunk_gap_mean_ms > rec.itl_ms
    assert result.summary["itl_ms"]["p50"] == pytest.approx(
        percentile([r.itl_ms for r in result.records], 50))


def test_a_reasoning_models_thinking_is_its_first_token(server: SSEServer) -> None:
    """A reasoning model streams its thinking (`reasoning_content`) before its answer: TTFT was
    taken at the first answer token (661 ms against 100)."""
    reqs = [TraceRequest(0, 0.0, 200, 4, parts=(("r0", 200),))]
    plain = asyncio.run(replay(reqs, f"http://{HOST}:{server.port}")).records[0]
    result = asyncio.run(replay(reqs, f"http://{HOST}:{server.port}",
                                headers={"x-test-reasoning": "3"}))
    (rec,) = result.records
    assert rec.outcome == "ok" and rec.chunks == plain.chunks == 4
    assert rec.ttft_ms is not None and plain.ttft_ms is not None
    assert rec.e2e_ms is not None and rec.ttft_ms < rec.e2e_ms - 10.0  # 3 chunks 5 ms apart


def test_simultaneous_requests_go_out_shortest_first_from_one_timer(
        server: SSEServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of one timestamp are sent in the offline simulation's order (shortest prompt
    first, `offline.arrival_order`), every time: a timer per request sent them in an order set by
    its microseconds of noise, which was once measured at the router and taken for Envoy's."""
    from gorgo.sim import replay as module
    sent: list[int] = []
    real = module._send

    async def recorded(session, url, payload, rec, at, endpoint):
        sent.append(rec.index)
        await real(session, url, payload, rec, at, endpoint)

    monkeypatch.setattr(module, "_send", recorded)
    sizes = [900, 100, 500, 100, 2000, 300, 700, 50, 1200, 400, 800, 600]
    reqs = [TraceRequest(i, 0.05 + 0.05 * (i >= 6), size, 1, parts=((f"r{i}", size),))
            for i, size in enumerate(sizes)]
    asyncio.run(replay(reqs, f"http://{HOST}:{server.port}"))
    first, second = sorted(range(6), key=lambda i: (sizes[i], i)), sorted(
        range(6, 12), key=lambda i: sizes[i])
    assert sent == first + second
    # A burst whose bodies take longer to build than the prebuild lead (time scale 0: the whole
    # slice at once): a request that found the clock past its time skipped the timer and went
    # ahead of the ones waiting on it, largest first.
    sent.clear()
    sizes = [2000 + (k * 7919) % 18000 for k in range(120)]
    reqs = [TraceRequest(i, 0.0, size, 1, parts=((f"r{i}", size),))
            for i, size in enumerate(sizes)]
    asyncio.run(replay(reqs, f"http://{HOST}:{server.port}", 0.0))
    assert sent == sorted(range(120), key=lambda i: (sizes[i], i))


def test_stats_summaries() -> None:
    s = summarize(range(1, 101))
    assert (s.count, s.min, s.max, s.mean) == (100, 1.0, 100.0, 50.5)
    assert (s.p50, s.p90, s.p95, s.p99) == pytest.approx((50.5, 90.1, 95.05, 99.01))
    assert summarize([None, float("nan"), 2.0]).to_dict()["count"] == 1
    empty = summarize([])
    assert empty.count == 0 and empty.p99 is None and empty.format() == "n=0"
    assert "p95=95.0" in s.format(digits=1)
    assert percentile([], 50) is None and percentile([3.0, 1.0], 50) == 2.0
    assert rate_per_s(10, 2.0) == 5.0 and rate_per_s(1, 0.0) is None


def test_select_window() -> None:
    reqs = [TraceRequest(i, float(i), 10, 1) for i in range(10)]
    assert [r.index for r in select_window(reqs, offset_s=3.0, max_requests=2)] == [3, 4]
    win = select_window(reqs, offset_s=2.5, duration_s=2.0, time_scale=0.5)
    assert [r.index for r in win] == [3, 4, 5, 6]
    assert [r.arrival_s for r in win] == [0.5, 1.5, 2.5, 3.5]
    assert summarize_records([], 0.0)["count"] == 0


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_honours_offset_duration_and_max_requests(server: SSEServer, tmp_path: Path) -> None:
    spec = "chat:seed=2,users=10,rate=40,message_tokens=40,system_tokens=100,limit=200"
    trace = load_trace(spec)
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    url = f"http://{HOST}:{server.port}"
    common = ["--trace", spec, "--url", url, "--out", str(out), "--summary", str(summary)]

    assert main(_args(*common, "--offset", "1.0", "--duration", "0.5", "--header", "x-a: b")) == 0
    expected = [r.index for r in trace if 1.0 <= r.arrival_s < 1.5]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == expected
    assert all(r["outcome"] == "ok" for r in rows)
    data = json.loads(summary.read_text())
    assert data["count"] == len(expected) and data["interrupted"] is False
    assert data["ttft_ms"]["p50"] > 0 and "trace_description" in data
    assert server.received[-1]["user"].startswith("user-")

    args = _args(*common, "--offset", "2.0", "--max-requests", "5", "--time-scale", "0.5")
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    after = [r for r in trace if r.arrival_s >= 2.0][:5]
    assert sorted(r["index"] for r in rows) == [r.index for r in after]
    first = after[0].arrival_s
    for row in rows:
        arrival = trace[row["index"]].arrival_s
        assert row["scheduled_s"] == pytest.approx((arrival - 2.0) * 0.5, abs=1e-6)
        assert row["scheduled_s"] >= (first - 2.0) * 0.5 - 1e-9

    with pytest.raises(UserError, match="unknown trace source 'nosuch'"):
        main(_args("--trace", "nosuch", "--url", url))  # gorgo.cli prints it and exits 2


@pytest.mark.parametrize(("option", "cap"), [
    ("", "exact"),  # the default
    (",max_tokens=exact", "exact"),
    (",max_tokens=none", None),
    (",max_tokens=50", 50),
])
def test_a_replayed_client_sends_its_bound_and_the_engine_is_told_the_output(
        server: SSEServer, tmp_path: Path, option: str, cap: object) -> None:
    spec = "chat:seed=2,users=4,rate=40,message_tokens=40,system_tokens=100,limit=12"
    outputs = sorted(r.output_tokens for r in load_trace(spec))
    generated = sorted(min(o, cap) if isinstance(cap, int) else o for o in outputs)
    assert generated != outputs or not isinstance(cap, int)  # the cap cuts some
    out = tmp_path / "out.jsonl"
    url = f"http://{HOST}:{server.port}"
    assert main(_args("--trace", spec + option, "--url", url, "--out", str(out))) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["max_tokens"] for r in rows) == generated  # what the engine generates
    bodies = [b.get("max_tokens") for b in server.received]
    told = [b.get("metadata", {}).get(SIM_OUTPUT_KEY) for b in server.received]
    if cap == "exact":
        assert sorted(bodies) == outputs and told == [None] * len(outputs)
    else:
        assert bodies == [cap] * len(outputs)
        assert sorted(int(v) for v in told) == generated


@pytest.mark.parametrize("tags", [None, "s", {"team": "a"}])
def test_a_clients_own_metadata_is_kept_beside_the_stop_point(server: SSEServer,
                                                               tags: object) -> None:
    # a null or non-object metadata (OpenAI allows null) failed every request's build
    reqs = _requests(2, 50.0)
    result = asyncio.run(replay(reqs, f"http://{HOST}:{server.port}", bound=4096,
                                extra_body={"metadata": tags}))
    assert [r.outcome for r in result.records] == ["ok", "ok"]
    kept = tags if isinstance(tags, dict) else {}
    assert [b["metadata"] for b in server.received] == [
        {**kept, SIM_OUTPUT_KEY: "3"}] * 2  # each request's output, under the cap


@pytest.mark.parametrize(("args", "error"), [
    (("--trace", "chat:max_tokens=lots"), r"max_tokens='lots': expected exact, none or a number"),
    (("--trace", "chat:max_tokens=none", "--ignore-eos"), r"--ignore-eos needs the trace's exact"),
    # a completion without max_tokens gets 16 tokens, not the trace's output
    (("--trace", "chat:max_tokens=none", "--endpoint", "completions"),
     r"max_tokens=none cannot be replayed on the completions endpoint"),
    (("--trace", "azure:turns=closed"), r"turns=closed needs a trace that marks its turns"),
])
def test_a_bad_client_bound_is_one_line(args: tuple[str, ...], error: str) -> None:
    with pytest.raises(UserError, match=error):
        main(_args(*args, "--url", f"http://{HOST}:{_closed_port()}"))


def test_closed_turns_wait_for_the_answer_they_continue(server: SSEServer) -> None:
    # A chain of six turns all due at once, each continuing the one before; turn 3 fails (503):
    # its follower still goes. Open, every turn leaves at its time.
    reqs = [TraceRequest(i, 0.0, 200, 3, session="fail" if i == 3 else "s",
                         parts=((f"r{i}", 200),), follows=i - 1 if i else None) for i in range(6)]
    url = f"http://{HOST}:{server.port}"
    closed = asyncio.run(replay(reqs, url, closed=True)).records
    by = {r.index: r for r in closed}
    assert [by[i].outcome for i in range(6)] == ["ok", "ok", "ok", "http_error", "ok", "ok"]
    for i in range(1, 6):
        before = by[i - 1]
        ended = before.sent_s + (before.e2e_ms if before.e2e_ms is not None else 0.0) / 1000.0
        assert by[i].sent_s >= ended - 1e-3
        assert by[i].held_ms is not None and by[i].held_ms > 0
    assert by[0].held_ms is None
    opened = {r.index: r for r in asyncio.run(replay(reqs, url)).records}
    assert all(r.held_ms is None for r in opened.values())
    assert opened[1].sent_s < opened[0].sent_s + opened[0].e2e_ms / 1000.0  # went at its time


@pytest.mark.slow
def test_sigint_stops_cleanly_and_writes_results(server: SSEServer, tmp_path: Path) -> None:
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    code = (
        "import argparse, sys\n"
        "from gorgo.sim.replay import add_arguments, main\n"
        "p = argparse.ArgumentParser(); add_arguments(p)\n"
        "sys.exit(main(p.parse_args(sys.argv[1:])))\n"
    )
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i * 100, "input_length": 64, "output_length": 2,
                        "hash_ids": [i]}) + "\n"
            for i in range(200)
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--trace", f"mooncake:{trace}",
         "--url", f"http://{HOST}:{server.port}", "--out", str(out), "--summary", str(summary),
         "--header", "x-test-delay: 30"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 15
        while len(server.received) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(server.received) >= 5
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == EXIT_INTERRUPTED
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 5
    assert {r["outcome"] for r in rows} == {"cancelled"}
    data = json.loads(summary.read_text())
    assert data["interrupted"] is True
    assert data["count"] == len(rows) < 200
    assert data["errors"] == {"cancelled": len(rows)}


def test_an_unwritable_summary_is_refused_before_the_replay(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a traceback once the whole replay had run and its numbers were lost
    def no_replay(*_: object, **__: object) -> None:
        raise AssertionError("the replay ran")

    monkeypatch.setattr("gorgo.sim.replay.load_trace", no_replay)
    (tmp_path / "afile").write_text("")
    args = _args("--trace", "chat", "--url", "http://127.0.0.1:1",
                 "--summary", str(tmp_path / "afile" / "s.json"))
    with pytest.raises(UserError, match=r"cannot write .*/afile/s\.json: Not a directory"):
        main(args)
