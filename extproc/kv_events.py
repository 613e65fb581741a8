"""KV-event subscriptions of the `cache: precise` replicas: the I/O half of the precise cache view.

For each such replica: find its publisher (the fleet's ``kv_events``, else the engine's
``/kv_event_sources``), subscribe (ZMQ SUB; connect where the engine binds, bind where it
connects, vLLM's rule), and feed every batch through the core's `EventStream`, which says when to
apply it, clear the block set, or ask the replay socket (a DEALER sending ``["", start_seq]``)
for what a gap or a restart lost. Decoded batches are applied to the router's state on the
router's loop, where every other writer runs; the sockets live on a thread of their own, so a
burst of events never delays a decision and a slow decision never drops events.

An engine restart: ZMQ reconnects by itself; the reconnection (seen on a socket monitor) replays
the engine's history, and a history shorter than what was applied, or a seq counting from 0
again, is a new process (`EventStream`). Any failure (no publisher yet, an
engine down, a bad payload) drops the replica back to its approximate view and starts over after
``RETRY_S``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from zmq.utils.monitor import parse_monitor_message

from extproc.bodies import read_capped
from extproc.loop_thread import LoopThread
from extproc.telemetry import REPLICA_LABELS, RepeatedFailures, RouterMetrics, log_event
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import KVEventsSpec, ReplicaSpec
from gorgo.core.kv_events import (
    APPLY,
    CLEAR,
    END_SEQ,
    REPLAY,
    Action,
    EventBatch,
    EventFormatError,
    EventStream,
    decode_batch,
    publisher_binds,
)
from gorgo.core.precise import PreciseCache
from gorgo.core.router import Router

log = logging.getLogger("gorgo.kv_events")
SOURCES_PATH = "/kv_event_sources"
RETRY_S = 1.0
REPLAY_TIMEOUT_S = 2.0
# Replays that time out in a row before the stream is taken as it comes (`EventStream.
# unreplayable`): a replay socket the router cannot reach (a firewall that lets the PUB port
# through) kept the replica on its approximate view for good, its live batches unread. The view
# then tracks what is published from there on; the next gap asks the replay socket again.
REPLAY_TRIES = 3
# The largest answer of /kv_event_sources read (a few hundred bytes), and the largest KV-event
# message taken from a socket (a batch of one step's stores; a peer past it is disconnected): a
# 400 MB frame on the subscriber's port was once received whole before it was refused.
MAX_SOURCES_BYTES = 64 * 1024
MAX_EVENT_MESSAGE_BYTES = 64 * 1024 * 1024
_WILDCARD_HOST = re.compile(r"^(tcp://)(\*|\[::\]|::|0\.0\.0\.0)(:\d+)$")


def subscriber_endpoint(endpoint: str, host: str) -> tuple[str, bool]:
    """(address, bind?) for the subscriber of a publisher at ``endpoint``: a wildcard the engine
    binds is reached at the replica's host; an endpoint the engine connects to is ours to bind."""
    if not publisher_binds(endpoint):
        return endpoint, True
    return _WILDCARD_HOST.sub(lambda m: f"{m[1]}{host}{m[3]}", endpoint), False


def replay_endpoint(endpoint: str, host: str) -> str:
    """The replay socket (always bound by the engine) as the subscriber connects to it."""
    return _WILDCARD_HOST.sub(lambda m: f"{m[1]}{host}{m[3]}", endpoint)


def parse_sources(body: Any) -> KVEventsSpec:
    """vLLM's /kv_event_sources answer (``{rank: KVEventsConfig}``): rank 0's publisher."""
    if not isinstance(body, dict) or not body:
        raise ValueError("no KV event publisher (is --kv-events-config set?)")
    cfg = body.get("0", next(iter(body.values())))
    if not isinstance(cfg, dict) or not cfg.get("enable_kv_cache_events") \
            or cfg.get("publisher") != "zmq" or not isinstance(cfg.get("endpoint"), str):
        raise ValueError(f"KV events not published over zmq: {cfg!r:.200}")
    replay = cfg.get("replay_endpoint")
    if cfg.get("buffer_steps") == 0:
        # A replay socket that keeps no batch answers every replay with nothing, which reads as
        # another process's history (`EventStream.replayed`): the stream is taken as it comes.
        replay = None
    return KVEventsSpec(cfg["endpoint"], replay if isinstance(replay, str) else None,
                        str(cfg.get("topic") or ""))


def decode_frames(frames: list[bytes]) -> EventBatch:
    """``[topic, seq, payload]`` as published (the replay's frames after its empty delimiter)."""
    if len(frames) != 3:
        raise EventFormatError(f"expected 3 frames, got {len(frames)}")
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        raw = msgpack.unpackb(frames[2], strict_map_key=False)
    except (ValueError, msgpack.ExtraData) as exc:
        raise EventFormatError(f"payload is not msgpack: {exc}") from None
    return decode_batch(seq, raw)


class KVEventsClient:
    """Every precise replica's subscription (see module docstring)."""

    def __init__(self, router: Router, metrics: RouterMetrics) -> None:
        self.router = router
        self.metrics = metrics
        self.replicas = [i for i, r in enumerate(router.spec.replicas) if r.precise is not None]
        self.streams: dict[int, EventStream] = {i: EventStream() for i in self.replicas}
        self.batches: dict[int, int] = dict.fromkeys(self.replicas, 0)
        # failures, by kind: "format" (what the engine sent could not be read) and "subscribe"
        # (no publisher, engine down, a bind refused), which drop a replica to its approximate
        # view until it resubscribes, and "replay" (a replay unanswered for REPLAY_TIMEOUT_S)
        self.errors: dict[int, dict[str, int]] = {
            i: {"format": 0, "subscribe": 0, "replay": 0} for i in self.replicas}
        self._log_failure = RepeatedFailures(log, "kv_events_failed")
        self._loop: asyncio.AbstractEventLoop | None = None  # the router's
        self._thread = LoopThread("gorgo-kv-events")
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[None]] = []
        metrics.registry.register(_KVCollector(self))

    async def start(self) -> None:
        if not self.replicas:
            return
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        await self._thread.run(self._start_thread())

    async def _start_thread(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._tasks = [asyncio.create_task(self._follow(i)) for i in self.replicas]

    async def stop(self) -> None:
        if not self._thread.running:
            return
        await self._thread.run(self._stop_thread())
        await self._thread.stop()

    async def _stop_thread(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()

    # --- on the router's loop ------------------------------------------------------------------

    def _post(self, i: int, actions: list[Action], synced: bool) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._apply, i, actions, synced)

    def _apply(self, i: int, actions: list[Action], synced: bool) -> None:
        state = self.router.state
        for a in actions:
            if a.kind == CLEAR:
                state.set_kv_synced(i, False, clear=True)
            elif a.kind == APPLY and a.batch is not None:
                state.apply_kv_events(i, a.batch.events)
        state.set_kv_synced(i, synced)

    # --- on the subscription thread --------------------------------------------------------------

    async def _follow(self, i: int) -> None:
        replica = self.router.spec.replicas[i]
        while True:
            try:
                await self._subscribe(i, replica)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no publisher yet, engine down, bad payload: start over
                self._failed(i, replica, exc)
            old = self.streams[i]
            self.streams[i] = EventStream(gaps=old.gaps, restarts=old.restarts, lost=old.lost,
                                          repeats=old.repeats, stale=old.stale)
            self._post(i, [], False)
            await asyncio.sleep(RETRY_S)

    def _failed(self, i: int, replica: ReplicaSpec, exc: Exception) -> None:
        """Counted always; logged once per distinct failure (`RepeatedFailures`: a publisher
        that is not up yet retries every second)."""
        kind = "format" if isinstance(exc, EventFormatError) else "subscribe"
        self.errors[i][kind] += 1
        self._log_failure(exc, i, replica=replica.name, kind=kind, retry_s=RETRY_S)

    async def _sources(self, replica: ReplicaSpec) -> KVEventsSpec:
        assert replica.precise is not None
        if replica.precise.kv_events is not None:
            return replica.precise.kv_events
        timeout = aiohttp.ClientTimeout(total=REPLAY_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                session.get(f"http://{replica.address}{SOURCES_PATH}") as resp:
            if resp.status != 200:
                raise ValueError(f"{SOURCES_PATH}: status {resp.status}")
            return parse_sources(json.loads(await read_capped(resp.content, MAX_SOURCES_BYTES,
                                                              SOURCES_PATH)))

    async def _subscribe(self, i: int, replica: ReplicaSpec) -> None:
        assert self._ctx is not None
        src = await self._sources(replica)
        address, bind = subscriber_endpoint(src.endpoint, replica.host)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        # Each (re)connection of the engine: connected where we connect, accepted where we bind.
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        try:
            (sub.bind if bind else sub.connect)(address)
            log_event(log, "kv_events_subscribed", replica=replica.name, endpoint=address,
                      bound=bind, replay=src.replay_endpoint or "none")
            replay = None if src.replay_endpoint is None else replay_endpoint(
                src.replay_endpoint, replica.host)
            stream = self.streams[i]
            await self._act(i, stream, stream.start(), replay)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            connections = 0
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    parse_monitor_message(await monitor.recv_multipart())
                    connections += 1
                    if connections > 1:  # back after a disconnection: a new engine process?
                        await self._act(i, stream, stream.reconnected(), replay)
                if sub in ready:
                    batch = decode_frames(await sub.recv_multipart())
                    self.batches[i] += 1
                    await self._act(i, stream, stream.live(batch), replay)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _act(self, i: int, stream: EventStream, actions: list[Action],
                   replay: str | None) -> None:
        """Carry out ``actions``: replays on this thread (their answers may ask for more), state
        changes posted to the router's loop in one batch."""
        state_ops: list[Action] = []
        pending = list(actions)
        unanswered = 0
        while pending:
            a = pending.pop(0)
            if a.kind != REPLAY:
                state_ops.append(a)
                continue
            self._post(i, state_ops, False)
            state_ops = []
            if replay is None or unanswered >= REPLAY_TRIES:
                pending += stream.unreplayable()  # nothing to replay from: as it comes
                continue
            try:
                batches = await self._replay(replay, a.seq)
            except TimeoutError:
                unanswered += 1
                self.errors[i]["replay"] += 1
                silent = TimeoutError(f"no answer from {replay} in {REPLAY_TIMEOUT_S:g} s")
                self._log_failure(silent, i, replica=self.router.spec.replicas[i].name,
                                  kind="replay", tries=unanswered, retry_s=RETRY_S)
                await asyncio.sleep(RETRY_S)
                pending += stream.replay_failed()
                continue
            unanswered = 0
            pending += stream.replayed(batches)
        self._post(i, state_ops, stream.synced)

    async def _replay(self, endpoint: str, seq: int) -> list[EventBatch]:
        """Every buffered batch from ``seq`` on, up to the end marker (TimeoutError: none)."""
        assert self._ctx is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_EVENT_MESSAGE_BYTES)
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", max(seq, 0).to_bytes(8, "big")])
            out = []
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) == 4 and int.from_bytes(frames[2], "big",
                                                           signed=True) == END_SEQ:
                        return out
                    out.append(decode_frames(frames[1:]))
        finally:
            dealer.close(linger=0)


class PromptWarmer:
    """`PreciseCache.warm` on one worker thread, at most ``MAX_PENDING`` prompts queued (a burst
    beyond that is not warmed: warming is an optimisation, never a backlog)."""

    MAX_PENDING = 8

    def __init__(self, precise: PreciseCache) -> None:
        self.precise = precise
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gorgo-precise-warm")
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, f: RequestFeatures) -> None:
        with self._lock:
            if self._pending >= self.MAX_PENDING:
                return
            self._pending += 1
        self._pool.submit(self._run, f)

    def _run(self, f: RequestFeatures) -> None:
        try:
            self.precise.warm(f)
        except Exception:  # a tokenizer failure costs only the warm-up
            log.debug("warming the prompt memo failed", exc_info=True)
        finally:
            with self._lock:
                self._pending -= 1


class _KVCollector(Collector):
    def __init__(self, client: KVEventsClient) -> None:
        self.client = client

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        c = self.client
        s = c.router.state
        synced = GaugeMetricFamily("gorgo_kv_events_synced", "1 while a precise replica's view "
                                   "is live (events synced, hashing known)", labels=REPLICA_LABELS)
        blocks = GaugeMetricFamily("gorgo_kv_cached_blocks", "Blocks a precise replica's engine "
                                   "reports cached", labels=REPLICA_LABELS)
        batches = CounterMetricFamily("gorgo_kv_event_batches", "KV event batches received live",
                                      labels=REPLICA_LABELS)
        gaps = CounterMetricFamily("gorgo_kv_event_gaps", "Sequence gaps filled by replay "
                                   "(gap), engine restarts, gaps the replay could not fill "
                                   "(lost), live batches dropped as repeats of replayed ones "
                                   "(repeat), batches of an earlier engine process dropped "
                                   "(stale)",
                                   labels=[*REPLICA_LABELS, "kind"])
        errors = CounterMetricFamily(
            "gorgo_kv_event_errors", "Failures of a precise replica's events: format (an event "
            "that could not be read) and subscribe (no publisher, engine down, bind refused), "
            "which drop it to its approximate view until the next subscription; replay (a "
            "replay unanswered; after 3 in a row the stream is taken as it comes)",
            labels=[*REPLICA_LABELS, "kind"])
        config = GaugeMetricFamily(
            "gorgo_kv_cache_config_info", "A precise replica's cache as its engine reports it "
            "(cache_config_info): block size, hash algorithm, capacity in tokens",
            labels=[*REPLICA_LABELS, "block_size", "hash_algo", "capacity_tokens"])
        precise = s.precise
        assert precise is not None  # a client exists only for a fleet with precise replicas
        cap = s.prefix.capacity
        for i in c.replicas:
            r = precise.replicas[i]
            tokens = "" if cap is None else str(cap[i] * s.spec.block_tokens)
            config.add_metric([*c.metrics.replica(i), str(r.block_size or ""),
                               r.algorithm or "", tokens], 1.0)
            st = c.streams[i]
            where = list(c.metrics.replica(i))
            synced.add_metric(where, float(precise.live(i)))
            blocks.add_metric(where, float(precise.blocks_held(i)))
            batches.add_metric(where, c.batches[i])
            for kind, n in (("gap", st.gaps), ("restart", st.restarts), ("lost", st.lost),
                            ("repeat", st.repeats), ("stale", st.stale)):
                gaps.add_metric([*where, kind], n)
            for kind, n in c.errors[i].items():
                errors.add_metric([*where, kind], n)
        yield from (synced, blocks, batches, gaps, errors, config)
