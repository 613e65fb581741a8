"""Open-loop trace replay against an OpenAI-compatible endpoint (``gorgo replay``).

Open loop means every request is sent at its trace time (times ``--time-scale``) whatever happened
to earlier ones: one task per request, started by its own timer, no worker pool and no connection
cap, so a slow fleet shows up as latency instead of silently lowering the offered load. Each
record keeps its slip (actual send time minus scheduled time) to prove the client kept up.
With ``turns=closed`` (`--trace chat:...,turns=closed`) a follow-up turn is held until the
answer it continues has ended, as a person in a chat waits; its record keeps how long
(``held_ms``), and its slip counts from when it was let go.

Request bodies are built ``PREBUILD_S`` before their send time so long prompts do not delay the
send itself. Failures are recorded, never raised; Ctrl-C/SIGTERM cancels in-flight requests
(recorded as ``cancelled``) and still writes everything measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import aiohttp

from gorgo import shutdown
from gorgo.core.contract import SIM_OUTPUT_KEY
from gorgo.core.tokens import Tokenization
from gorgo.errors import UserError, at_least, header_pair, output_file, url_arg
from gorgo.progress import StatusLine
from gorgo.sim.stats import percentile, rate_per_s, summarize
from gorgo.sim.traces import DESCRIPTION, TraceRequest, load_trace, parse_spec
from gorgo.sim.workload import (
    EXACT,
    ClientBound,
    generated,
    require_marked_turns,
    split_client,
    with_client_bound,
)

ENDPOINT_PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
REPLICA_HEADERS: tuple[str, ...] = ("x-gorgo-replica", "x-gorgo-served-by")
DEFAULT_MODEL = "gorgo-sim"
DEFAULT_TIMEOUT_S = 300.0
PREBUILD_S = 0.02
START_DELAY_S = 0.05
PROGRESS_PERIOD_S = 0.5
EXIT_INTERRUPTED = 130
_ERROR_TEXT_CHARS = 300


@dataclass(slots=True)
class RequestRecord:
    """What one replayed request measured; ``*_ms`` in ms, ``*_s`` in seconds from replay start.

    ``outcome`` is ok, http_error (see ``status``), connection_error, timeout, stream_error (an
    unreadable stream, an error event, or a stream that ended before ``[DONE]``), cancelled
    (stopped in flight) or error (anything else).
    TTFT is the first chunk with non-empty content, measured from the send. ITL is per token,
    (E2E - TTFT) / (completion tokens - 1), as the offline simulation and docs/results.md define
    it; ``chunk_gap_*`` are the gaps between streamed chunks, several tokens each under an
    engine's stream interval (reported as ITL, they read 217 ms for a 30 ms ITL at 8 per chunk).
    """

    index: int
    session: str | None
    input_tokens: int
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    slip_ms: float | None = None
    held_ms: float | None = None  # closed turns: how long it waited past its time for its answer
    status: int | None = None
    outcome: str = "pending"
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: float | None = None
    chunk_gap_mean_ms: float | None = None
    chunk_gap_max_ms: float | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def first_answer_ms(self) -> float | None:
        """For an answer that came whole: its TTFT, or without a token (an empty completion) its
        E2E, when the client had all of it; None for a failed request (the tables count it as
        unbounded: a stream cut after its first token is no fast answer). The live tables rank
        by this; a missing first token counted as infinitely slow made an empty answer the
        slowest request."""
        if self.outcome != "ok":
            return None
        return self.ttft_ms if self.ttft_ms is not None else self.e2e_ms

    @property
    def error_key(self) -> str | None:
        """How the summary groups this failure (HTTP status or outcome); ``None`` when ok."""
        if self.outcome == "ok":
            return None
        if self.outcome == "http_error" and self.status is not None:
            return str(self.status)
        return self.outcome


@dataclass(slots=True)
class ReplayResult:
    records: list[RequestRecord]
    summary: dict[str, Any]
    interrupted: bool = False
    wall_s: float = 0.0


def endpoint_url(url: str, endpoint: str) -> str:
    """``url`` as given when it has a path, else the base URL plus the endpoint's path."""
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINT_PATHS)}, got {endpoint!r}")
    if urlsplit(url).path not in ("", "/"):
        return url
    return url.rstrip("/") + ENDPOINT_PATHS[endpoint]


def select_window(
    requests: Sequence[TraceRequest],
    offset_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    time_scale: float = 1.0,
) -> list[TraceRequest]:
    """Requests at or after trace time ``offset_s``, rebased so the offset is time 0.

    ``duration_s`` is in replay (scaled) seconds: a request is kept when
    ``(arrival - offset) * time_scale < duration_s``. ``max_requests`` keeps the first N.
    """
    out: list[TraceRequest] = []
    for r in sorted(requests, key=lambda r: r.arrival_s):
        if r.arrival_s < offset_s:
            continue
        rebased = r.arrival_s - offset_s
        if duration_s is not None and rebased * time_scale >= duration_s:
            break
        out.append(replace(r, arrival_s=rebased))
        if max_requests is not None and len(out) >= max_requests:
            break
    return out


def summarize_records(records: Sequence[RequestRecord], wall_s: float) -> dict[str, Any]:
    """Counts, errors by status/outcome, rates and latency percentiles of a replay."""
    sent = sorted(r.sent_s for r in records if r.sent_s is not None)
    ok = [r for r in records if r.outcome == "ok"]
    errors = Counter(k for r in records if (k := r.error_key) is not None)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return {
        "count": len(records),
        "ok": len(ok),
        "errors": dict(sorted(errors.items())),
        "wall_s": wall_s,
        "req_per_s": rate_per_s(len(sent), sent[-1] - sent[0]) if len(sent) > 1 else None,
        "ok_per_s": rate_per_s(len(ok), wall_s),
        "ttft_ms": summarize(r.ttft_ms for r in ok).to_dict(),
        "e2e_ms": summarize(r.e2e_ms for r in ok).to_dict(),
        "itl_ms": summarize(r.itl_ms for r in ok).to_dict(),
        "slip_ms": summarize(r.slip_ms for r in records).to_dict(),
        "held": sum(r.held_ms is not None for r in records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_ratio": cached / prompt if prompt else None,
        "replicas": dict(sorted(Counter(r.replica for r in ok if r.replica).items())),
    }


class _Progress:
    """One stderr line refreshed while the replay runs."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.sent = 0
        self.done = 0
        self.errors = 0
        self.ttfts: list[float] = []

    def line(self) -> str:
        p50 = percentile(self.ttfts, 50)
        p95 = percentile(self.ttfts, 95)
        ttft = "-" if p50 is None or p95 is None else f"{p50:.0f}/{p95:.0f} ms"
        return (
            f"sent {self.sent}  done {self.done}  errors {self.errors}  ttft p50/p95 {ttft}"
        )

    async def run(self) -> None:
        status = StatusLine(self.stream)
        try:
            while True:
                status.update(self.line())
                await asyncio.sleep(PROGRESS_PERIOD_S)
        finally:
            status.done(self.line())


def check_bound(endpoint: str, bound: ClientBound) -> None:
    """ValueError for a client bound the endpoint cannot replay: a completion without max_tokens
    gets the API's 16 tokens (the router prices it so, the engine generates it), not the
    trace's output."""
    if endpoint == "completions" and bound is None:
        raise ValueError("max_tokens=none cannot be replayed on the completions endpoint: a "
                         "completion without max_tokens gets the API's 16 tokens; use a cap")


async def replay(
    requests: Sequence[TraceRequest],
    url: str,
    time_scale: float = 1.0,
    *,
    tok: Tokenization | None = None,
    model: str = DEFAULT_MODEL,
    endpoint: str = "chat",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    headers: dict[str, str] | None = None,
    extra_body: dict[str, Any] | None = None,
    bound: ClientBound = EXACT,
    on_result: Callable[[RequestRecord], None] | None = None,
    progress: IO[str] | None = None,
    stop: asyncio.Event | None = None,
    closed: bool = False,
) -> ReplayResult:
    """Send ``requests`` open-loop at ``arrival_s * time_scale`` seconds from now; ``closed``
    (`gorgo.sim.workload.CLOSED`): a turn that continues another of ``requests``
    (`TraceRequest.follows`) waits for that one's answer to end (or fail) first.

    ``on_result`` is called with every finished record (ok, failed or cancelled). Setting
    ``stop`` ends the replay early: unsent requests are dropped, in-flight ones cancelled.
    ``bound``: what each client sends as max_tokens (`gorgo.sim.workload.EXACT`); where it is not
    the output, `SIM_OUTPUT_KEY` in the body's metadata tells a simulated engine where the
    request stops.
    """
    if time_scale < 0:
        raise ValueError("time_scale must be >= 0")
    check_bound(endpoint, bound)
    loop = asyncio.get_running_loop()
    target = endpoint_url(url, endpoint)
    tok = tok or Tokenization()
    stop = stop or asyncio.Event()
    records: list[RequestRecord] = []
    inflight: set[asyncio.Task[None]] = set()
    tracker = _Progress(progress) if progress is not None else None
    # Simultaneous requests (Mooncake's timestamps are quantised to ~3 s: up to 28 share one)
    # go out in the offline simulation's order, shortest prompt first (`offline.arrival_order`),
    # each group from one timer: a timer per request woke them in an order set by its own
    # microseconds of noise (mostly shortest first: the larger bodies took longer to build), and
    # that order, read at the router, was once taken for Envoy's.
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.input_tokens, r.index))
    # closed turns: the answers some turn waits for, set once each has ended
    indexes = {r.index for r in ordered}
    answered = {r.follows: asyncio.Event() for r in ordered
                if closed and r.follows is not None and r.follows in indexes}

    def finish(rec: RequestRecord) -> None:
        records.append(rec)
        if tracker is not None:
            tracker.done += 1
            tracker.errors += rec.outcome != "ok"
            if rec.ttft_ms is not None:
                tracker.ttfts.append(rec.ttft_ms)
        if on_result is not None:
            try:
                on_result(rec)
            except Exception as exc:  # a broken callback must not end the run
                print(f"replay: on_result failed: {exc!r}", file=sys.stderr)

    def build(req: TraceRequest) -> bytes:
        if endpoint == "chat":
            body = req.chat_body(tok, model, stream=True)
        else:
            body = req.completion_body(tok, model, stream=True)
        if extra_body:
            body.update(extra_body)
        if bound != EXACT:  # a client's own tags kept (OpenAI allows a null metadata)
            tags = body.get("metadata")
            body["metadata"] = {**(tags if isinstance(tags, dict) else {}),
                                SIM_OUTPUT_KEY: str(generated(req.output_tokens, bound))}
        return json.dumps(with_client_bound(body, bound)).encode()

    if ordered:
        # The first build generates the shared text pool; do it now, not on the schedule.
        with contextlib.suppress(Exception):
            build(ordered[0])
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s if timeout_s > 0 else None)
    base_headers = {"content-type": "application/json", **(headers or {})}
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=base_headers
    ) as session:
        t0 = loop.time() + START_DELAY_S
        gates: dict[float, asyncio.Event] = {}

        def gate(at: float) -> asyncio.Event:
            """The one timer of every request sent at ``at``; its waiters wake in the order
            they began to wait, the order they were dispatched. Kept once it fired: a request
            of that time dispatched later goes at once, behind the ones it woke (a request that
            found the clock past ``at`` skipped the gate and went ahead of them: when building
            a burst's bodies overran the prebuild, the largest went first)."""
            g = gates.get(at)
            if g is None:
                g = gates[at] = asyncio.Event()
                loop.call_at(at, g.set)
            return g

        async def one(req: TraceRequest, at: float) -> None:
            try:
                await send_one(req, at)
            finally:  # answered, failed, unbuilt or cancelled: a turn waiting for it goes
                if req.index in answered:
                    answered[req.index].set()

        async def send_one(req: TraceRequest, at: float) -> None:
            rec = RequestRecord(
                index=req.index,
                session=req.session,
                input_tokens=req.input_tokens,
                max_tokens=generated(req.output_tokens, bound),
                scheduled_s=at - t0,
            )
            try:
                payload = build(req)
            except Exception as exc:
                rec.outcome, rec.error = "error", f"building the request failed: {exc!r}"
                finish(rec)
                return
            before = answered.get(req.follows) if req.follows is not None else None
            if before is not None and not before.is_set():
                await before.wait()
                now = loop.time()
                if now > at:  # held past its time: it leaves now, its slip measured from now
                    rec.held_ms = (now - at) * 1000.0
                    at = now
            opened = gate(at)
            if not opened.is_set():
                await opened.wait()
            sent = loop.time()
            rec.sent_s = sent - t0
            rec.slip_ms = (sent - at) * 1000.0
            if tracker is not None:
                tracker.sent += 1
            try:
                await _send(session, target, payload, rec, sent, endpoint)
            except asyncio.CancelledError:
                rec.outcome, rec.error = "cancelled", "cancelled before completion"
                finish(rec)
                raise
            finish(rec)

        idle = asyncio.Event()
        dispatched = False

        def task_done(task: asyncio.Task[None]) -> None:
            inflight.discard(task)
            if dispatched and not inflight:
                idle.set()

        async def dispatch() -> None:
            nonlocal dispatched
            for req in ordered:
                at = t0 + req.arrival_s * time_scale
                wait = at - PREBUILD_S - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                task = loop.create_task(one(req, at))
                inflight.add(task)
                task.add_done_callback(task_done)
            dispatched = True
            if not inflight:
                idle.set()

        progress_task = loop.create_task(tracker.run()) if tracker is not None else None
        dispatcher = loop.create_task(dispatch())
        waiters = {loop.create_task(idle.wait()), loop.create_task(stop.wait())}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            interrupted = not idle.is_set()
            dispatcher.cancel()
            pending = list(inflight)
            for task in pending:
                task.cancel()
            await asyncio.gather(dispatcher, *pending, return_exceptions=True)
            for waiter in waiters:
                waiter.cancel()
            if progress_task is not None:
                progress_task.cancel()
                await asyncio.gather(progress_task, return_exceptions=True)
        wall = max(0.0, loop.time() - t0)
    records.sort(key=lambda r: r.index)
    return ReplayResult(
        records=records,
        summary=summarize_records(records, wall),
        interrupted=interrupted,
        wall_s=wall,
    )


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    payload: bytes,
    rec: RequestRecord,
    sent: float,
    endpoint: str,
) -> None:
    """Post one request and fill ``rec``; every failure ends up in ``rec``, never raised."""
    loop = asyncio.get_running_loop()
    try:
        async with session.post(url, data=payload) as resp:
            rec.status = resp.status
            rec.replica = _replica(resp.headers)
            if resp.status != 200:
                text = await resp.text(errors="replace")
                rec.outcome, rec.error = "http_error", text[:_ERROR_TEXT_CHARS] or resp.reason
                rec.e2e_ms = (loop.time() - sent) * 1000.0
                return
            if "text/event-stream" in resp.headers.get("content-type", ""):
                await _read_stream(resp, rec, sent, endpoint)
            else:
                _read_whole(json.loads(await resp.read()), rec, endpoint)
                rec.ttft_ms = rec.e2e_ms = (loop.time() - sent) * 1000.0
                rec.outcome = "ok" if rec.outcome == "pending" else rec.outcome
    except TimeoutError:
        rec.outcome, rec.error = "timeout", "request timed out"
    except (aiohttp.ClientError, OSError) as exc:
        rec.outcome, rec.error = "connection_error", f"{type(exc).__name__}: {exc}"
    except ValueError as exc:
        rec.outcome, rec.error = "stream_error", f"unreadable response: {exc}"
    except Exception as exc:
        rec.outcome, rec.error = "error", f"{type(exc).__name__}: {exc}"
    if rec.e2e_ms is None and rec.outcome != "ok":
        rec.e2e_ms = (loop.time() - sent) * 1000.0


async def _read_stream(
    resp: aiohttp.ClientResponse, rec: RequestRecord, sent: float, endpoint: str
) -> None:
    loop = asyncio.get_running_loop()
    first = last = None
    gap_sum = gap_max = 0.0
    finished = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            finished = True
            break
        event = json.loads(data)
        if not isinstance(event, dict):
            continue
        if "error" in event:
            rec.outcome = "stream_error"
            rec.error = json.dumps(event["error"])[:_ERROR_TEXT_CHARS]
        _read_usage(event.get("usage"), rec)
        if _content(event, endpoint):
            now = loop.time()
            if first is None:
                first = now
            elif last is not None:
                gap = now - last
                gap_sum += gap
                gap_max = max(gap_max, gap)
            last = now
            rec.chunks += 1
    done = loop.time()
    rec.e2e_ms = (done - sent) * 1000.0
    tokens = rec.completion_tokens or 0
    if first is not None:
        rec.ttft_ms = (first - sent) * 1000.0
        if tokens > 1:  # E2E - TTFT over the gaps between tokens
            rec.itl_ms = (done - first) * 1000.0 / (tokens - 1)
    if rec.chunks > 1:
        rec.chunk_gap_mean_ms = gap_sum / (rec.chunks - 1) * 1000.0
        rec.chunk_gap_max_ms = gap_max * 1000.0
    if rec.outcome == "pending" and not finished:
        # A server that stops mid-answer may still close the stream cleanly: without the final
        # [DONE] the answer is cut, not complete.
        rec.outcome, rec.error = "stream_error", "stream ended before [DONE]"
    if rec.outcome == "pending":
        rec.outcome = "ok"


def _read_whole(body: Any, rec: RequestRecord, endpoint: str) -> None:
    """A non-streamed answer (some servers ignore ``stream``): one chunk, TTFT = E2E."""
    if not isinstance(body, dict):
        raise ValueError("response body is not a JSON object")
    if "error" in body:
        rec.outcome = "stream_error"
        rec.error = json.dumps(body["error"])[:_ERROR_TEXT_CHARS]
    _read_usage(body.get("usage"), rec)
    choices = body.get("choices") or [{}]
    first = choices[0] if isinstance(choices[0], dict) else {}
    message = first.get("message") if isinstance(first.get("message"), dict) else {}
    text = message.get("content") if endpoint == "chat" else first.get("text")
    rec.chunks = 1 if text else 0


def _replica(headers: Any) -> str | None:
    for name in REPLICA_HEADERS:
        value = headers.get(name)
        if value:
            return str(value)
    return None


# What a chat delta's generated tokens come in: the answer, a reasoning model's thinking (vLLM's
# and SGLang's `reasoning_content`, the newer `reasoning`) and tool calls. Counting the answer alone
# put a reasoning model's TTFT at its first answer token (661 ms against 100), made its ITL about 0
# (the thinking's tokens over the answer's time) and left a tool-call-only answer with no TTFT.
_DELTA_TOKENS = ("content", "reasoning_content", "reasoning", "tool_calls")


def _content(event: dict[str, Any], endpoint: str) -> bool:
    """Whether a stream event carries generated tokens."""
    choices = event.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return False
    if endpoint == "chat":
        delta = choices[0].get("delta")
        return isinstance(delta, dict) and any(delta.get(k) for k in _DELTA_TOKENS)
    return bool(choices[0].get("text"))


def _read_usage(usage: Any, rec: RequestRecord) -> None:
    if not isinstance(usage, dict):
        return
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]
    if isinstance(usage.get("completion_tokens"), int):
        rec.completion_tokens = usage["completion_tokens"]
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]


# ------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", required=True, metavar="SPEC",
        help="mooncake[:PATH] | azure[:PATH] | chat[:seed=S,users=U,rate=R,...] "
        "(options as k=v; limit=N keeps the first N requests; max_tokens=exact|none|N: what "
        "each client sends as max_tokens, the simulated engine still told each output; "
        "turns=open|closed: closed holds a chat turn until the answer it continues ended)",
    )
    parser.add_argument("--url", required=True, type=url_arg,
                        help="base URL (endpoint path added) or full URL")
    parser.add_argument(
        "--time-scale", type=at_least(0.0, float), default=1.0,
        help="multiply trace times by this (0.5 = twice the rate)",
    )
    parser.add_argument(
        "--duration", type=float, default=None, metavar="S",
        help="replay only requests scheduled in the first S (scaled) seconds",
    )
    parser.add_argument("--max-requests", type=at_least(1), default=None, metavar="N")
    parser.add_argument(
        "--offset", type=float, default=0.0, metavar="S",
        help="skip the first S seconds of the trace (trace time)",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--endpoint", choices=sorted(ENDPOINT_PATHS), default="chat")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S,
        help="per-request total timeout in seconds (0 = none)",
    )
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.jsonl")
    parser.add_argument("--summary", type=Path, default=None, metavar="FILE.json")
    parser.add_argument(
        "--header", action="append", type=header_pair, default=[], metavar="K:V",
        help="extra request header (repeatable)",
    )
    parser.add_argument(
        "--progress", action="store_true", help="show the progress line even when not a tty"
    )
    parser.add_argument(
        "--traces-dir", default=None,
        help="folder holding the trace files (default: $GORGO_TRACES, else the repo's data/traces)",
    )
    parser.add_argument(
        "--chars-per-token", type=float, default=Tokenization().chars_per_token,
        help="synthetic text density; must match the router/engines",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true",
        help="add ignore_eos=true so engines (vLLM/SGLang) produce the trace's output lengths",
    )


def main(args: argparse.Namespace) -> int:
    """Run ``gorgo replay``; 0 when the replay finished, 130 when interrupted; bad input raises
    UserError (a bad trace: its TraceError)."""
    headers = dict(args.header)
    try:
        tok = Tokenization(chars_per_token=args.chars_per_token)
        target = endpoint_url(args.url, args.endpoint)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    for path in (args.out, args.summary):  # before the replay, not after it
        if path is not None:
            output_file(path)
    try:
        trace, bound, closed = split_client(args.trace)
        check_bound(args.endpoint, bound)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.ignore_eos and bound != EXACT:
        raise UserError("--ignore-eos needs the trace's exact max_tokens: an engine told to "
                        "ignore end of sequence generates the whole bound (or, with none, "
                        "up to its context)")
    source, _ = parse_spec(trace)
    requests = load_trace(trace, root=args.traces_dir)
    if closed:
        try:
            require_marked_turns(args.trace, requests)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    selected = select_window(
        requests, args.offset, args.duration, args.max_requests, args.time_scale
    )
    show_progress = args.progress or sys.stderr.isatty()
    extra = {"ignore_eos": True} if args.ignore_eos else None
    print(
        f"replay: {len(selected)} of {len(requests)} requests from {args.trace} -> {target} "
        f"(time scale {args.time_scale})",
        file=sys.stderr,
    )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    out_file: IO[str] | None = None

    def write(rec: RequestRecord) -> None:
        if out_file is not None:
            out_file.write(json.dumps(rec.to_dict()) + "\n")

    async def run() -> ReplayResult:
        stop = asyncio.Event()
        undo = shutdown.on_stop(stop.set)
        try:
            return await replay(
                selected, args.url, args.time_scale, tok=tok, model=args.model,
                endpoint=args.endpoint, timeout_s=args.timeout, headers=headers,
                extra_body=extra, bound=bound, on_result=write,
                progress=sys.stderr if show_progress else None, stop=stop, closed=closed,
            )
        finally:
            undo()

    t_start = time.monotonic()
    with contextlib.ExitStack() as files:
        if args.out:
            out_file = files.enter_context(open(args.out, "w", encoding="utf-8"))
        result = asyncio.run(run())
    summary = {
        **result.summary,
        "interrupted": result.interrupted,
        "trace": args.trace,
        "trace_description": DESCRIPTION[source],
        "url": target,
        "time_scale": args.time_scale,
        "offset_s": args.offset,
        "duration_s": args.duration,
        "max_requests": args.max_requests,
        "selected": len(selected),
        "started_at": started,
        "elapsed_s": time.monotonic() - t_start,
    }
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    _print_summary(summary)
    return EXIT_INTERRUPTED if result.interrupted else 0


def _print_summary(summary: dict[str, Any]) -> None:
    errors = ", ".join(f"{k}: {v}" for k, v in summary["errors"].items()) or "none"
    rate = summary["req_per_s"]
    head = f"requests {summary['count']}  ok {summary['ok']}  errors {errors}"
    print(head + (f"  rate {rate:.2f} req/s" if rate is not None else ""))
    for name in ("ttft_ms", "e2e_ms", "itl_ms", "slip_ms"):
        s = summary[name]
        if s["count"]:
            print(
                f"{name[:-3]:>5}  p50 {s['p50']:.1f}  p90 {s['p90']:.1f}  p95 {s['p95']:.1f}  "
                f"p99 {s['p99']:.1f} ms  (n={s['count']})"
            )
