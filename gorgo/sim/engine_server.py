"""A live OpenAI-compatible HTTP server over the engine model, speaking like SGLang or vLLM.

One asyncio task drives the engine: while it has work it runs a step at the current engine time,
sleeps until the step's end (absolute deadlines, so time does not drift) and hands the step's
tokens to the waiting handlers. Prompts are parsed and tokenised with the router's own functions
(gorgo.core.features, gorgo.core.tokens), so the router's token and prefix estimates are exact on
this engine. Everything lives on the instance: many servers can run in one process.

Besides generation (chat, completions, the Responses API) it answers what routers call on the
engine it imitates, so a real peer router runs against it as it would in production: SGLang's
``/get_load``, ``/server_info`` and ``/model_info`` (sglang-router's power_of_two polls the first
and reads ``num_tokens``; worker registration reads the others), and vLLM's render endpoints
(vllm-router's cache_aware posts every request to ``/v1/chat/completions/render`` on every worker
and keys its prefix tree on the returned ``token_ids``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from gorgo import shutdown
from gorgo.core.contract import SIM_OUTPUT_KEY
from gorgo.core.features import (
    RequestError,
    endpoint_for_path,
    output_bound,
    parse_json_body,
    prompt_block_hashes,
    prompt_sizes,
    prompt_text,
    token_count,
)
from gorgo.core.fleet import Limits, finite_number
from gorgo.core.prompt_tokens import SimTokenizer
from gorgo.core.tokens import DEFAULT_BLOCK_TOKENS, DEFAULT_CHARS_PER_TOKEN, Tokenization
from gorgo.errors import UserError, bind_error, port_number, positive_number
from gorgo.sim.engine import ITL_BUCKETS_S, Engine, EngineRejected, EngineRequest, StepResult
from gorgo.sim.kv_publish import HASH_ALGO, KVEventPublisher, SimHashing
from gorgo.sim.profiles import PROFILES, get_profile

FLAVORS = ("sglang", "vllm")
FAIL_MODES = (None, "503", "reset")
MAX_BODY_BYTES = 64 * 1024 * 1024
SERVED_BY_HEADER = "x-gorgo-served-by"
DEFAULT_MAX_TOKENS = 128
MAX_LAG_S = 1.0  # behind schedule by more than this (a stalled loop): restart the clock
SHUTDOWN_GRACE_S = 1.0
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
# vLLM's buckets for tokens per request (1-2-5 steps), of its per-request generation histogram.
GENERATION_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
# How late each step's end was delivered (the event loop's scheduling slip), for the fleet bench.
STEP_LAG_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0,
)
_FILLER = (
    "the engine writes these words so that a client can count what it receives and check that "
    "every token it was promised arrived in order without gaps or repeats and nothing more "
)


def pseudo_text(tok: Tokenization, start: int, end: int) -> str:
    """Deterministic text of completion tokens [start, end): each token is chars_per_token chars."""
    a, b = tok.chars_for_tokens(start), tok.chars_for_tokens(end)
    n = len(_FILLER)
    reps = (b // n) - (a // n) + 2
    text = _FILLER * reps
    off = a % n
    return text[off : off + (b - a)]


def pseudo_token_ids(tok: Tokenization, text: str) -> list[int]:
    """The ids the engine counts in ``text`` (`gorgo.core.prompt_tokens.SimTokenizer`; [0] for an
    empty prompt, which still runs one token)."""
    return SimTokenizer(tok.chars_per_token).ids(text).tolist() or [0]


class _Pending:
    """What one in-flight request has received from the engine so far."""

    __slots__ = ("aborted", "arrival", "cached", "event", "finish", "finished", "first_at",
                 "prompt_tokens", "sent", "stream", "tokens")

    def __init__(self, prompt_tokens: int, stream: bool, arrival: float) -> None:
        self.arrival = arrival
        self.prompt_tokens = prompt_tokens
        self.stream = stream
        self.tokens = 0
        self.sent = 0  # tokens already written to the client
        self.cached = 0
        self.first_at: float | None = None
        self.finished = False
        # why it ends: its token limit, or where the replay said it stops (`SIM_OUTPUT_KEY`),
        # which answers as a real engine's end of sequence
        self.finish = "length"
        self.aborted = False  # the server is shutting down
        self.event = asyncio.Event()


class _MetricsCollector(Collector):
    """Exposes the engine's state under the metric names of the flavor it imitates."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        s = self.server
        m = s.engine.metrics()
        keys = ["model_name"]
        vals = [s.model_name]
        if s.flavor == "vllm":
            keys.append("engine")
            vals.append("0")

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=keys)
            g.add_metric(vals, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=keys)
            c.add_metric(vals, value)
            return c

        def histogram(name: str, doc: str, edges: Sequence[float], counts: Sequence[int],
                      total: float) -> HistogramMetricFamily:
            """Per-bucket ``counts`` (+Inf last) as Prometheus' cumulative buckets."""
            cum = list(itertools.accumulate(counts))
            buckets = [(repr(b), n) for b, n in zip(edges, cum, strict=False)]
            buckets.append(("+Inf", cum[-1]))
            h = HistogramMetricFamily(name, doc, labels=keys)
            h.add_metric(vals, buckets, total)
            return h

        ttft = histogram(f"{s.flavor}:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", TTFT_BUCKETS,
                         s.ttft_counts, s.ttft_sum)
        lag = histogram("gorgo_sim:step_lag_seconds",
                        "How late each engine step ended relative to its planned end (loop slip).",
                        STEP_LAG_BUCKETS, s.lag_counts, s.lag_sum)
        # Real engines' ITL histogram (vLLM and SGLang name it alike, per flavor).
        itl = histogram(f"{s.flavor}:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S,
                        m.itl_buckets, m.itl_sum_s)
        hit = m.cached_tokens_total / m.prompt_tokens_total if m.prompt_tokens_total else 0.0
        if s.flavor == "sglang":
            yield gauge("sglang:num_running_reqs", "The number of running requests.", m.num_running)
            yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                        m.num_waiting)
            yield gauge("sglang:token_usage", "The token usage.", m.kv_usage)
            yield gauge("sglang:num_used_tokens", "The number of used tokens.",
                        round(m.kv_usage * s.engine.cache.capacity_tokens))
            yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit)
            yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.",
                          m.prompt_tokens_total)
            yield counter("sglang:generation_tokens", "Number of generation tokens processed.",
                          m.generated_tokens_total)
            yield counter("sglang:cached_tokens", "Number of cached prompt tokens.",
                          m.cached_tokens_total)
            yield counter("sglang:num_requests", "Number of requests processed.",
                          m.requests_finished)
            yield counter("sglang:num_aborted_requests", "Number of requests aborted.",
                          m.requests_cancelled)
        else:
            yield gauge("vllm:num_requests_running",
                        "Number of requests in model execution batches.", m.num_running)
            yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                        m.num_waiting)
            yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                        m.kv_usage)
            yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                          m.prompt_tokens_total)
            yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                          m.generated_tokens_total)
            yield counter("vllm:prefix_cache_queries",
                          "Prefix cache queries, in terms of number of queried tokens.",
                          m.prompt_tokens_total)
            yield counter("vllm:prefix_cache_hits",
                          "Prefix cache hits, in terms of number of cached tokens.",
                          m.cached_tokens_total)
            success = CounterMetricFamily("vllm:request_success", "Count of successfully processed "
                                          "requests.", labels=[*keys, "finished_reason"])
            success.add_metric([*vals, "length"], m.requests_finished - s.stopped_total)
            success.add_metric([*vals, "stop"], s.stopped_total)
            yield success
            yield histogram("vllm:request_generation_tokens",
                            "Number of generation tokens processed.", GENERATION_BUCKETS,
                            s.generation_counts, s.generation_sum)
            # vLLM's cache config as an info gauge: what a router reads block size and capacity
            # (and, for KV events, the hash algorithm) from.
            bt = s.tok.block_tokens
            cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine "
                                      "CacheConfig", labels=["block_size", "num_gpu_blocks",
                                                             "prefix_caching_hash_algo",
                                                             "enable_prefix_caching", "engine"])
            cache.add_metric([str(bt), str(s.engine.cache.capacity_tokens // bt), HASH_ALGO,
                              "True", "0"], 1.0)
            yield cache
        yield ttft
        yield itl
        yield lag
        # Not exposed by real engines: exact queue contents, for simulation-side analysis.
        yield gauge("gorgo_sim:waiting_prompt_tokens", "Prompt tokens in the waiting queue.",
                    m.waiting_prompt_tokens)
        yield gauge("gorgo_sim:pending_prefill_tokens",
                    "Uncached prompt tokens admitted requests still have to prefill.",
                    m.pending_prefill_tokens)


class EngineServer:
    """OpenAI-compatible front end of one simulated engine (see module docstring).

    ``slowdown`` stretches every step (chaos: a slow replica), the one under way included, and
    the engine's own step times with it (its ITL histogram is what a router reads);
    ``fail_mode`` "503" answers every request with 503, "reset" resets every connection.
    """

    def __init__(
        self,
        engine: Engine,
        tokenization: Tokenization,
        model_name: str,
        flavor: str = "sglang",
        stream_interval: int = 1,
        name: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        kv_events: KVEventPublisher | None = None,
        served: tuple[str, ...] = (),
    ) -> None:
        """``served``: every model name it answers to (vLLM's --served-model-name; the first is
        ``model_name``); empty: it answers whatever is asked. With ``kv_events`` (an engine
        built with ``kv_events=True``) the engine keys its cache
        on vLLM's block hashes and publishes its KV events, as ``--kv-events-config`` does."""
        if flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}")
        if stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.engine = engine
        self.tok = tokenization
        self.model_name = model_name
        self.served = served
        self.flavor = flavor
        self.stream_interval = stream_interval
        self.default_max_tokens = default_max_tokens
        self.name = name
        self.kv_events = kv_events
        self.hashing = SimHashing(tokenization) if kv_events is not None else None
        self._speed = engine.speed
        self._slowdown = 1.0
        self._rescaled = asyncio.Event()
        self._fail_mode: str | None = None
        self.created = int(time.time())
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.generation_counts = [0] * (len(GENERATION_BUCKETS) + 1)
        self.generation_sum = 0
        self.stopped_total = 0  # requests that finished where the replay said (`_Pending.finish`)
        self.lag_counts = [0] * (len(STEP_LAG_BUCKETS) + 1)
        self.lag_sum = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_MetricsCollector(self))
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._driver: asyncio.Task[None] | None = None
        self._closing = False
        self.port: int | None = None

    @property
    def slowdown(self) -> float:
        return self._slowdown

    @slowdown.setter
    def slowdown(self, factor: float) -> None:
        x = finite_number(factor)
        if x is None or not x > 0:
            raise ValueError(f"slowdown factor must be a finite number > 0, got {factor!r}")
        self._slowdown = x
        self.engine.speed = self._speed / factor
        self._rescaled.set()

    @property
    def fail_mode(self) -> str | None:
        return self._fail_mode

    @fail_mode.setter
    def fail_mode(self, mode: str | None) -> None:
        if mode not in FAIL_MODES:
            raise ValueError(f"fail mode must be one of {FAIL_MODES}, got {mode!r}")
        self._fail_mode = mode

    # -- lifecycle --------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/chat/completions", self._handle_generate)
        app.router.add_post("/v1/completions", self._handle_generate)
        app.router.add_post("/v1/responses", self._handle_generate)
        if self.flavor == "sglang":  # each under its current and its deprecated /get_ name
            app.router.add_get("/get_load", self._handle_get_load)
            for name in ("server_info", "model_info"):
                handler = getattr(self, f"_handle_{name}")
                app.router.add_get(f"/{name}", handler)
                app.router.add_get(f"/get_{name}", handler)
        else:
            app.router.add_post("/v1/chat/completions/render", self._handle_render)
            app.router.add_post("/v1/completions/render", self._handle_render)
        if self.kv_events is not None:
            app.router.add_get("/kv_event_sources", self._handle_kv_event_sources)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/metrics", self._handle_metrics)
        app.middlewares.append(self._fail_middleware)
        app.on_response_prepare.append(self._add_served_by)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: any free port) and start the engine; returns the port."""
        if self._runner is not None:
            raise RuntimeError("server already started")
        self._closing = False
        self._runner = web.AppRunner(
            self.make_app(), handler_cancellation=True, access_log=None,
            shutdown_timeout=SHUTDOWN_GRACE_S,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        if self.kv_events is not None:
            await self.kv_events.start()
        if self.name is None:
            self.name = f"{self.flavor}-{self.port}"
        self._driver = asyncio.create_task(self._drive(), name=f"engine-{self.name}")
        return self.port

    async def stop(self) -> None:
        """Stop listening; requests in flight end at once, their connections reset as a
        crashed engine's are (a stream ended cleanly before [DONE] read as a whole answer to
        Envoy, and to the tuner)."""
        self._closing = True
        for p in self._pending.values():
            p.aborted = True
            p.event.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None
        if self.kv_events is not None:
            await self.kv_events.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- engine driver ----------------------------------------------------------------------------
    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        t: float | None = None
        while True:
            if not engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                t = None
                continue
            now = loop.time()
            if t is None or now - t > MAX_LAG_S:
                t = now
            res = engine.step(t)
            if not res.steps:  # nothing could run: wait for the next arrival
                self._wake.clear()
                await self._wake.wait()
                t = None
                continue
            deadline = await self._step_end(t + res.duration)
            lag = max(0.0, loop.time() - deadline)
            self.lag_counts[bisect.bisect_left(STEP_LAG_BUCKETS, lag)] += 1
            self.lag_sum += lag
            self._deliver(res, deadline)
            if self.kv_events is not None:
                self.kv_events.publish(engine.take_kv_events())
            t = deadline

    async def _step_end(self, deadline: float) -> float:
        """Wait until a step's ``deadline``; when the slowdown changes meanwhile, what is left of
        the step runs at the new factor (a replica slowed 50x and set back to 1 took 20 s to
        finish its step). Returns the step's end."""
        loop = asyncio.get_running_loop()
        while (delay := deadline - loop.time()) > 0:
            scale = self._slowdown
            self._rescaled.clear()
            if scale == 1.0:  # the usual case: a change to a slowdown applies from the next step
                await asyncio.sleep(delay)
                break
            try:
                await asyncio.wait_for(self._rescaled.wait(), delay)
            except TimeoutError:
                break
            now = loop.time()
            deadline = now + (deadline - now) * self._slowdown / scale
        return deadline

    def _deliver(self, res: StepResult, at: float) -> None:
        pending = self._pending
        for ft in res.first_tokens:
            p = pending.get(ft.rid)
            if p is None:
                continue
            p.cached = ft.cached_tokens
            p.first_at = at
            ttft = at - p.arrival
            self.ttft_counts[bisect.bisect_left(TTFT_BUCKETS, ttft)] += 1
            self.ttft_sum += ttft
        interval = self.stream_interval
        steps = res.steps
        for rid in res.decoded:
            p = pending.get(rid)
            if p is None:
                continue
            p.tokens += steps
            if p.stream and (p.sent == 0 or p.tokens - p.sent >= interval):
                p.event.set()
        for f in res.finished:
            self.generation_counts[bisect.bisect_left(GENERATION_BUCKETS,
                                                      f.completion_tokens)] += 1
            self.generation_sum += f.completion_tokens
            p = pending.get(f.rid)
            if p is not None:
                p.finished = True
                self.stopped_total += p.finish == "stop"
                p.event.set()

    # -- HTTP -------------------------------------------------------------------------------------
    async def _add_served_by(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[SERVED_BY_HEADER] = self.name or ""

    @web.middleware
    async def _fail_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.fail_mode == "503":
            return _error(503, "Engine unavailable (injected failure).", "server_error")
        if self.fail_mode == "reset":
            _reset(request)
            return web.Response(status=500)
        return await handler(request)

    async def _handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _handle_models(self, request: web.Request) -> web.Response:
        cards = [{
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": self.flavor,
            "root": self.model_name,
            "max_model_len": self.engine.cache.capacity_tokens,
        } for name in self.served or (self.model_name,)]
        return web.json_response({"object": "list", "data": cards})

    async def _handle_kv_event_sources(self, request: web.Request) -> web.Response:
        assert self.kv_events is not None
        return web.json_response(self.kv_events.config())

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _handle_get_load(self, request: web.Request) -> web.Response:
        """SGLang's scheduler load, one entry per data-parallel rank: requests running and
        waiting, and ``num_tokens`` = KV tokens held by requests + prompt tokens still waiting."""
        m = self.engine.metrics()
        held = round(m.kv_usage * self.engine.cache.capacity_tokens)
        return web.json_response([{
            "dp_rank": 0,
            "num_reqs": m.num_running + m.num_waiting,
            "num_waiting_reqs": m.num_waiting,
            "num_tokens": held + m.waiting_prompt_tokens,
        }])

    async def _handle_server_info(self, request: web.Request) -> web.Response:
        """The server arguments and scheduler limits SGLang reports (the subset that applies)."""
        prof = self.engine.profile
        return web.json_response({
            "model_path": self.model_name,
            "tokenizer_path": self.model_name,
            "served_model_name": self.model_name,
            "tp_size": 1,
            "dp_size": 1,
            "page_size": self.tok.block_tokens,
            "chunked_prefill_size": prof.prefill_chunk_tokens,
            "max_running_requests": prof.max_running,
            "max_total_num_tokens": self.engine.cache.capacity_tokens,
            "disaggregation_mode": "null",
            "load_balance_method": "round_robin",
        })

    async def _handle_model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_name,
            "tokenizer_path": self.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": None,
            "architectures": None,
        })

    async def _handle_render(self, request: web.Request) -> web.Response:
        """vLLM's render: the request as the engine would run it (prompt token ids, sampling
        parameters), without running it; completions render a list of such requests."""
        endpoint = "chat" if request.path.startswith("/v1/chat/") else "completions"
        try:
            body = parse_json_body(await _read(request))
            text = prompt_text(endpoint, body)
            stream = body.get("stream", False)
            max_tokens = output_bound(endpoint, body)
        except RequestError as exc:
            return web.json_response(exc.to_body(), status=exc.status)
        rendered = {
            "request_id": ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex,
            "token_ids": pseudo_token_ids(self.tok, text),
            "features": None,
            "sampling_params": {"max_tokens": max(max_tokens or self.default_max_tokens, 1)},
            "model": self.model_name,
            "stream": stream is True,
            "cache_salt": None,
            "priority": 0,
            "kv_transfer_params": None,
        }
        return web.json_response(rendered if endpoint == "chat" else [rendered])

    async def _handle_generate(self, request: web.Request) -> web.StreamResponse:
        if self._closing:
            return _error(503, "Server is shutting down.", "server_error")
        endpoint = endpoint_for_path(request.path)
        assert endpoint in ("chat", "completions", "responses")
        responses = endpoint == "responses"
        try:
            body = parse_json_body(await _read(request))
            text = prompt_text(endpoint, body)
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise RequestError(400, "'stream' must be a boolean.", param="stream")
            bound = output_bound(endpoint, body)
            stops = _sim_output(body.get("metadata"))
            # stopped at "end of sequence" (the replay's) before the client's bound
            stopped = stops is not None and (bound is None or stops < bound)
            if stopped:
                max_tokens = stops
            else:  # echo without generation runs one step, as vLLM does
                max_tokens = self.default_max_tokens if bound is None else max(bound, 1)
            include_usage = not responses and _include_usage(body)
            if responses and body.get("previous_response_id") is not None:
                raise RequestError(400, "'previous_response_id' is not supported: this engine "
                                   "stores no responses; send the whole conversation as "
                                   "'input'.", param="previous_response_id")
            if self.served and body.get("model") and body["model"] not in self.served:
                raise RequestError(404, f"The model {body.get('model')!r} does not exist.",
                                   param="model", code="model_not_found")
        except RequestError as exc:
            return web.json_response(exc.to_body(), status=exc.status)

        # a completions batch runs here as one prompt of all its tokens (ids counted as ids)
        prompt_tokens = max(1, sum(prompt_sizes(body["prompt"], self.tok))
                            if endpoint == "completions" else self.tok.count_tokens(len(text)))
        prefix = {"chat": "chatcmpl-", "completions": "cmpl-", "responses": "resp_"}[endpoint]
        rid = prefix + uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self.hashing is None:  # blocks as the router cuts them
            req = EngineRequest(rid, prompt_tokens,
                                prompt_block_hashes(endpoint, body, text, self.tok),
                                max_tokens, now)
        else:
            ids, hashes = self.hashing.blocks(text)
            req = EngineRequest(rid, prompt_tokens, hashes, max_tokens, now, ids)
        try:
            self.engine.submit(req, now)
        except EngineRejected as exc:
            kind = "server_error" if exc.status >= 500 else "invalid_request_error"
            return _error(exc.status, exc.reason, kind)
        pending = _Pending(prompt_tokens, stream, now)
        limit = max_tokens  # what the Responses API reports: the client's own bound if it stopped
        if stopped:
            pending.finish, limit = "stop", bound
        self._pending[rid] = pending
        self._wake.set()
        try:
            if stream and responses:
                return await self._stream_responses(request, rid, pending, limit)
            if stream:
                return await self._stream(request, endpoint, rid, pending, include_usage)
            while not pending.finished:
                await pending.event.wait()
                pending.event.clear()
                if pending.aborted:  # what a crashed engine's client sees
                    _reset(request)
                    return web.Response(status=500)
            if responses:
                return web.json_response(self._response_object(
                    rid, "msg_" + uuid.uuid4().hex, pending, int(time.time()), limit))
            return web.json_response(self._full_body(endpoint, rid, pending))
        finally:
            self._pending.pop(rid, None)
            if rid in self.engine:
                self.engine.cancel(rid)

    def _usage(self, p: _Pending) -> dict[str, Any]:
        return {
            "prompt_tokens": p.prompt_tokens,
            "completion_tokens": p.tokens,
            "total_tokens": p.prompt_tokens + p.tokens,
            "prompt_tokens_details": {"cached_tokens": p.cached},
        }

    def _full_body(self, endpoint: str, rid: str, p: _Pending) -> dict[str, Any]:
        text = pseudo_text(self.tok, 0, p.tokens)
        if endpoint == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": p.finish,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": p.finish}
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": self._usage(p),
        }

    async def _pieces(self, p: _Pending) -> AsyncIterator[tuple[str, bool]]:
        """(new completion text, finished) each time the engine delivers; ends after the last
        piece, or without a finished one when the server stops."""
        while True:
            await p.event.wait()
            p.event.clear()
            if p.aborted:
                return
            n, done = p.tokens, p.finished
            text = pseudo_text(self.tok, p.sent, n) if n > p.sent else ""
            p.sent = n
            if text or done:
                yield text, done
            if done:
                return

    @staticmethod
    async def _event_stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        return resp

    async def _stream(
        self, request: web.Request, endpoint: str, rid: str, p: _Pending, include_usage: bool
    ) -> web.StreamResponse:
        resp = await self._event_stream(request)
        chat = endpoint == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        model = self.model_name
        vllm = self.flavor == "vllm"

        def chunk(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> str:
            data: dict[str, Any] = {
                "id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice] if choice is not None else [],
            }
            if usage is not None:
                data["usage"] = usage
            return "data: " + json.dumps(data, separators=(",", ":")) + "\n\n"

        def piece(text: str | None, finish: str | None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        role_sent = not chat
        async for text, done in self._pieces(p):
            out: list[str] = []
            if not role_sent:
                role = {"role": "assistant", "content": ""}
                out.append(chunk({"index": 0, "delta": role, "logprobs": None,
                                  "finish_reason": None}))
                role_sent = True
            finish_sent = False
            if text:
                finish_sent = done and vllm  # vLLM puts finish_reason on the last content chunk
                out.append(chunk(piece(text, p.finish if finish_sent else None)))
            if done:
                if not finish_sent:
                    out.append(chunk(piece(None, p.finish)))
                if include_usage:
                    out.append(chunk(None, self._usage(p)))
                out.append("data: [DONE]\n\n")
            await resp.write("".join(out).encode())
        return await self._end(request, resp, p)

    def _response_object(self, rid: str, msg_id: str, p: _Pending, created: int,
                         max_tokens: int | None, done: bool = True) -> dict[str, Any]:
        """A Responses API response; generation stops at the token limit, which the API reports
        as status "incomplete" with reason "max_output_tokens", or where the replay said
        (`_Pending.finish`), "completed"."""
        out: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": created, "model": self.model_name,
            "status": "in_progress", "incomplete_details": None, "error": None,
            "max_output_tokens": max_tokens, "output": [], "usage": None,
        }
        if done:
            text = pseudo_text(self.tok, 0, p.tokens)
            whole = p.finish == "stop"
            status = "completed" if whole else "incomplete"
            out.update(status=status,
                       incomplete_details=None if whole else {"reason": "max_output_tokens"},
                       output=[_message_item(msg_id, status, text)], usage={
                           "input_tokens": p.prompt_tokens,
                           "input_tokens_details": {"cached_tokens": p.cached},
                           "output_tokens": p.tokens,
                           "output_tokens_details": {"reasoning_tokens": 0},
                           "total_tokens": p.prompt_tokens + p.tokens,
                       })
        return out

    async def _stream_responses(
        self, request: web.Request, rid: str, p: _Pending, max_tokens: int | None
    ) -> web.StreamResponse:
        """The Responses API's typed event stream (``event:`` + ``data:``, no [DONE])."""
        resp = await self._event_stream(request)
        msg_id = "msg_" + uuid.uuid4().hex
        created = int(time.time())
        seq = itertools.count()
        where = {"item_id": msg_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **data: Any) -> str:
            payload = {"type": kind, "sequence_number": next(seq), **data}
            return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

        start = self._response_object(rid, msg_id, p, created, max_tokens, done=False)
        await resp.write((event("response.created", response=start)
                          + event("response.in_progress", response=start)).encode())
        opened = False
        async for text, done in self._pieces(p):
            out: list[str] = []
            if not opened:
                out += [event("response.output_item.added", output_index=0,
                              item=_message_item(msg_id, "in_progress", None)),
                        event("response.content_part.added", **where, part=_output_text(""))]
                opened = True
            if text:
                out.append(event("response.output_text.delta", **where, delta=text))
            if done:
                final = self._response_object(rid, msg_id, p, created, max_tokens)
                full = pseudo_text(self.tok, 0, p.tokens)
                out += [event("response.output_text.done", **where, text=full),
                        event("response.content_part.done", **where, part=_output_text(full)),
                        event("response.output_item.done", output_index=0,
                              item=final["output"][0]),
                        event(f"response.{final['status']}", response=final)]
            await resp.write("".join(out).encode())
        return await self._end(request, resp, p)

    @staticmethod
    async def _end(request: web.Request, resp: web.StreamResponse,
                   p: _Pending) -> web.StreamResponse:
        """A stream's end: whole, or reset when the engine stopped under it."""
        if p.aborted:
            _reset(request)
        else:
            await resp.write_eof()
        return resp


def _message_item(msg_id: str, status: str, text: str | None) -> dict[str, Any]:
    """An assistant message output item; ``text`` None: no content part yet."""
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [] if text is None else [_output_text(text)]}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _error(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


async def _read(request: web.Request) -> bytes:
    """The request's body, or the JSON 413 an OpenAI-style client can read (aiohttp's own is
    plain text)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(413, f"The request body is larger than this engine's "
                                f"{MAX_BODY_BYTES} bytes.") from None


def _reset(request: web.Request) -> None:
    """Abort the connection with a TCP RST, as a crashed engine process would."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _sim_output(metadata: Any) -> int | None:
    """The replay's `SIM_OUTPUT_KEY` in the body's metadata: the output this request generates
    (None: not said)."""
    if not isinstance(metadata, dict) or SIM_OUTPUT_KEY not in metadata:
        return None
    value = metadata[SIM_OUTPUT_KEY]
    n = token_count(value.strip()) if isinstance(value, str) else None
    if n is None:
        raise RequestError(400, f"metadata.{SIM_OUTPUT_KEY} must be a number of tokens from 1 "
                           f"to {Limits().max_output_tokens} (a string), not "
                           f"{str(value)[:40]!r}.", param="metadata")
    return n


def _include_usage(body: dict[str, Any]) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise RequestError(400, "'stream_options' must be an object.", param="stream_options")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError(400, "'stream_options.include_usage' must be a boolean.",
                           param="stream_options")
    return include


# -- CLI ------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `gorgo sim engine`."""
    parser.add_argument("--profile", default="h100-llama3-8b", choices=sorted(PROFILES),
                        help="engine performance profile")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=0, help="0 picks a free port")
    parser.add_argument("--flavor", default="sglang", choices=FLAVORS,
                        help="whose metric names and stream shape to imitate")
    parser.add_argument("--speed", type=positive_number, default=1.0,
                        help="engine speed factor (2 = steps take half as long)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens per streamed content chunk")
    parser.add_argument("--model", default=None, help="served model name (default: profile name)")
    parser.add_argument("--name", default=None, help=f"value of the {SERVED_BY_HEADER} header")
    parser.add_argument("--chars-per-token", type=positive_number,
                        default=DEFAULT_CHARS_PER_TOKEN)
    parser.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS)
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--kv-events-endpoint", default=None,
                        help="publish vLLM KV events here (ZMQ; bound if it has * or is ipc://, "
                             "else connected); vllm flavor only")
    parser.add_argument("--kv-events-replay", default=None, help="ZMQ replay endpoint (bound)")
    parser.add_argument("--kv-events-topic", default="")


def build_server(args: argparse.Namespace) -> EngineServer:
    tok = Tokenization(args.chars_per_token, args.block_tokens)
    profile = get_profile(args.profile)
    events = None
    if args.kv_events_endpoint is not None:
        if args.flavor != "vllm":
            raise ValueError("--kv-events-endpoint needs --flavor vllm")
        events = KVEventPublisher(args.kv_events_endpoint, args.kv_events_replay,
                                  args.kv_events_topic)
    return EngineServer(
        Engine(profile, tok, speed=args.speed, kv_events=events is not None),
        tok,
        args.model or profile.name,
        flavor=args.flavor,
        stream_interval=args.stream_interval,
        name=args.name,
        default_max_tokens=args.default_max_tokens,
        kv_events=events,
    )


async def _serve(server: EngineServer, host: str, port: int) -> None:
    done = asyncio.Event()
    shutdown.on_stop(done.set)
    try:
        bound = await server.start(host, port)
    except OSError as exc:
        await server.stop()
        raise bind_error(exc, f"the engine on {host}:{port}",
                         "free it or pick another --port (0 = any free port)") from None
    print(f"engine {server.name} ({server.flavor}, {server.engine.profile.name}) listening on "
          f"http://{host}:{bound}", flush=True)
    try:
        await done.wait()
    finally:
        await server.stop()


def main(args: argparse.Namespace) -> int:
    """Run one engine server until SIGINT/SIGTERM (0); a bad profile or port is a UserError."""
    try:
        server = build_server(args)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    asyncio.run(_serve(server, args.host, args.port))
    return 0
