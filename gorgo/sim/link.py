"""Userspace network-link emulator: one delaying TCP proxy per replica.

Kernel netem needs privileges that containers and CI lack, so a replica's WAN link is emulated by
an asyncio proxy: it accepts on a front address, opens one backend connection per accepted
connection and forwards bytes both ways, each chunk after a sampled one-way delay.

Timing model:

- one-way delay = RTT/2 + jitter, with the jitter's sd set to ``jitter_sd_ms / sqrt(2)`` so that a
  round trip (two independent one-way delays) has the configured RTT mean and sd;
- a direction draws its delay when it is idle; chunks sent while one is still in flight share
  that delay, so a stream keeps its spacing (each chunk drawing its own, a chunk waited for the
  latest of several draws: a far region's streamed TTFT came out 13 % over its RTT, and a
  stream's tokens arrived bunched), and a chunk is never delivered before an earlier one;
- an end travels like a byte, one delay after the last: a close or a half-close as a FIN, a
  reset as a reset, and a backend that refuses the connection as a reset after the handshake's
  round trip (it was passed on at once: a far dead replica was seen dead in 5 ms);
- a new connection pays one sampled RTT for the handshake before its first byte leaves, so a new
  connection plus a request costs about 2 RTT and a keep-alive request about 1 RTT.

Each direction keeps one FIFO and at most one ``call_at`` timer (for its head chunk), which keeps
many links with long-lived SSE streams cheap in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import socket
import struct
from collections import deque
from typing import cast

from gorgo.core.fleet import LINK_PRESETS

PARTITION_MODES: tuple[str | None, ...] = (None, "drop", "stall")
DISTRIBUTIONS: tuple[str, ...] = ("normal", "lognormal")

# Timers are armed this early, and chunks due up to this far ahead go out: the selector rounds its
# timeout up to whole milliseconds, so without the lead every delivery would run ~0.5 ms late.
_TIMER_LEAD_S = 5e-4


class Link:
    """A delaying TCP proxy from ``front`` to ``backend``; one per emulated replica link."""

    def __init__(
        self,
        front_host: str,
        front_port: int,
        backend_host: str,
        backend_port: int,
        rtt_ms: float,
        jitter_sd_ms: float,
        dist: str = "normal",
        seed: int = 0,
    ) -> None:
        if dist not in DISTRIBUTIONS:
            raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
        self.front_host = front_host
        self.front_port = front_port
        self.backend_host = backend_host
        self.backend_port = backend_port
        self.dist = dist
        self._rng = random.Random(seed)
        self._partition: str | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._port = 0
        self._epoch = 0  # bumped by set_rtt: a burst in flight then draws afresh
        self.set_rtt(rtt_ms, jitter_sd_ms)

    @classmethod
    def from_preset(
        cls,
        preset: str,
        front_host: str,
        front_port: int,
        backend_host: str,
        backend_port: int,
        dist: str = "normal",
        seed: int = 0,
    ) -> Link:
        try:
            rtt, sd = LINK_PRESETS[preset]
        except KeyError:
            known = sorted(LINK_PRESETS)
            raise ValueError(f"unknown link preset {preset!r}; known: {known}") from None
        return cls(front_host, front_port, backend_host, backend_port, rtt, sd, dist, seed)

    @property
    def port(self) -> int:
        """The bound front port (0 before ``start``)."""
        return self._port

    @property
    def rtt_ms(self) -> float:
        return self._rtt_ms

    @property
    def jitter_sd_ms(self) -> float:
        return self._sd_ms

    @property
    def partition(self) -> str | None:
        return self._partition

    @property
    def connections(self) -> int:
        """Live proxied connections."""
        return len(self._conns)

    def set_rtt(self, mean_ms: float, sd_ms: float) -> None:
        """Change the delay distribution; applies to chunks received from now on."""
        if mean_ms < 0 or sd_ms < 0:
            raise ValueError("RTT mean and sd must be >= 0")
        self._rtt_ms = float(mean_ms)
        self._sd_ms = float(sd_ms)
        self._epoch += 1
        self._ow_mean = mean_ms / 2000.0
        self._ow_sd = sd_ms / 1000.0 / math.sqrt(2.0)
        if self.dist == "lognormal" and self._ow_mean > 0 and self._ow_sd > 0:
            sigma2 = math.log1p((self._ow_sd / self._ow_mean) ** 2)
            self._ln_mu = math.log(self._ow_mean) - sigma2 / 2
            self._ln_sigma = math.sqrt(sigma2)

    def set_partition(self, mode: str | None) -> None:
        """``None`` heals; ``"drop"`` resets live and new connections; ``"stall"`` holds bytes.

        Bytes held by a stall are delivered (in order) once the link is healed.
        """
        if mode not in PARTITION_MODES:
            raise ValueError(f"partition mode must be one of {PARTITION_MODES}, got {mode!r}")
        self._partition = mode
        if mode == "drop":
            for conn in list(self._conns):
                conn.close(abort=True)
        elif mode is None:
            for conn in list(self._conns):
                conn.up.kick()
                conn.down.kick()

    def one_way_s(self) -> float:
        """Sample one one-way delay in seconds (never negative)."""
        if self._ow_sd <= 0:
            return self._ow_mean
        if self.dist == "lognormal":
            if self._ow_mean <= 0:
                return 0.0
            return self._rng.lognormvariate(self._ln_mu, self._ln_sigma)
        return max(0.0, self._rng.gauss(self._ow_mean, self._ow_sd))

    async def start(self) -> int:
        """Listen on the front address; returns the bound port (useful with port 0)."""
        if self._server is not None:
            raise RuntimeError("link already started")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ClientSide(self), self.front_host, self.front_port
        )
        self._port = self._server.sockets[0].getsockname()[1]
        return self._port

    async def stop(self) -> None:
        """Close the listener and every live connection."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for conn in list(self._conns):
            conn.close(abort=True)
        if server is not None:
            await server.wait_closed()

    async def __aenter__(self) -> Link:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class _Pipe:
    """One direction of a proxied connection: a delay line feeding ``dst``."""

    __slots__ = ("_abort_dst", "_close_dst", "_conn", "_delay", "_dst", "_ending", "_epoch",
                 "_last_due", "_link", "_loop", "_not_before", "_queue", "_timer", "done")

    def __init__(self, conn: _Conn, not_before: float) -> None:
        self._conn = conn
        self._link = conn.link
        self._loop = conn.loop
        self._queue: deque[tuple[float, bytes]] = deque()
        self._last_due = 0.0
        self._not_before = not_before
        self._timer: asyncio.TimerHandle | None = None
        self._dst: asyncio.Transport | None = None
        self._ending = False
        self._close_dst = False
        self._abort_dst = False
        self._delay = 0.0
        self._epoch = -1
        self.done = False

    def attach(self, dst: asyncio.Transport) -> None:
        self._dst = dst
        self.kick()

    def push(self, data: bytes) -> None:
        if self._ending or self.done:
            return
        self._enqueue(data)

    def _enqueue(self, data: bytes) -> None:
        link = self._link
        if not self._queue or self._epoch != link._epoch:  # idle (or re-timed): a fresh draw
            self._delay = link.one_way_s()
            self._epoch = link._epoch
        due = max(max(self._loop.time(), self._not_before) + self._delay, self._last_due)
        self._last_due = due
        self._queue.append((due, data))
        if self._timer is None:
            self.kick()

    def finish(self, close: bool, abort: bool = False) -> None:
        """The source ended: one delay after the queued bytes, half-close (or close, or reset)
        the destination."""
        if self.done:
            return
        self._close_dst = self._close_dst or close
        self._abort_dst = self._abort_dst or abort
        if not self._ending:
            self._ending = True
            self._enqueue(b"")  # the end's own place in the line

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._queue.clear()
        self.done = True

    def kick(self) -> None:
        """(Re)arm the timer for the head chunk, or end the stream when drained."""
        if self.done or self._dst is None or self._link.partition == "stall":
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._queue:
            self._timer = self._loop.call_at(self._queue[0][0] - _TIMER_LEAD_S, self._flush)
        elif self._ending:
            self._end()

    def _flush(self) -> None:
        self._timer = None
        dst = self._dst
        if self.done or dst is None or self._link.partition == "stall":
            return
        if dst.is_closing():
            self.cancel()
            return
        limit = self._loop.time() + _TIMER_LEAD_S
        queue = self._queue
        while queue and queue[0][0] <= limit:
            dst.write(queue.popleft()[1])
        self.kick()

    def _end(self) -> None:
        self.done = True
        dst = self._dst
        if dst is not None and not dst.is_closing():
            try:
                if self._abort_dst:
                    _reset(dst)
                elif not self._close_dst and dst.can_write_eof():
                    dst.write_eof()
                else:
                    dst.close()
            except OSError:  # the peer is already gone
                dst.abort()
        self._conn.pipe_done()


class _Conn:
    """An accepted client connection and its backend connection."""

    def __init__(self, link: Link, client: asyncio.Transport) -> None:
        self.link = link
        self.loop = asyncio.get_running_loop()
        self.client = client
        self.backend: asyncio.Transport | None = None
        self.closed = False
        handshake = link.one_way_s() + link.one_way_s()
        self.up = _Pipe(self, not_before=self.loop.time() + handshake)
        self.down = _Pipe(self, not_before=0.0)
        self.down.attach(client)
        self._connector = self.loop.create_task(self._connect())

    async def _connect(self) -> None:
        try:
            transport, _ = await self.loop.create_connection(
                lambda: _BackendSide(self), self.link.backend_host, self.link.backend_port
            )
        except OSError:  # refused: the client learns it after the handshake's round trip
            self.loop.call_at(self.up._not_before, self.close, True)
            return
        if self.closed:
            transport.abort()
            return
        self.backend = transport
        self.up.attach(transport)

    def pipe_done(self) -> None:
        if self.up.done and self.down.done:
            self.close(abort=False)

    def close(self, abort: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.link._conns.discard(self)
        self.up.cancel()
        self.down.cancel()
        if not self._connector.done():
            self._connector.cancel()
        for transport in (self.client, self.backend):
            if transport is None:
                continue
            if abort:
                _reset(transport)
            elif not transport.is_closing():
                transport.close()

    # Events from either side; ``from_client`` tells which side they happened on.

    def data(self, from_client: bool, data: bytes) -> None:
        (self.up if from_client else self.down).push(data)

    def eof(self, from_client: bool) -> None:
        (self.up if from_client else self.down).finish(close=False)

    def lost(self, from_client: bool, exc: Exception | None) -> None:
        if self.closed:
            return
        out, back = (self.up, self.down) if from_client else (self.down, self.up)
        back.cancel()
        if from_client and self.backend is None:
            self.close(abort=True)
            return
        # A reset goes on as a reset (it reached the other side as a clean close)
        out.finish(close=True, abort=isinstance(exc, ConnectionResetError))
        self.pipe_done()

    def pause(self, client_full: bool) -> None:
        other = self.backend if client_full else self.client
        if other is not None and not other.is_closing():
            other.pause_reading()

    def resume(self, client_full: bool) -> None:
        other = self.backend if client_full else self.client
        if other is not None and not other.is_closing():
            other.resume_reading()


def _reset(transport: asyncio.Transport) -> None:
    """Close ``transport`` with a TCP reset, not a FIN: ``abort`` alone sends a FIN."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _ClientSide(asyncio.Protocol):
    def __init__(self, link: Link) -> None:
        self.link = link
        self.conn: _Conn | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.link.partition == "drop" or self.link._server is None:
            _reset(cast(asyncio.Transport, transport))
            return
        self.conn = _Conn(self.link, cast(asyncio.Transport, transport))
        self.link._conns.add(self.conn)

    def data_received(self, data: bytes) -> None:
        if self.conn is not None:
            self.conn.data(True, data)

    def eof_received(self) -> bool:
        if self.conn is not None:
            self.conn.eof(True)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if self.conn is not None:
            self.conn.lost(True, exc)

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.pause(client_full=True)

    def resume_writing(self) -> None:
        if self.conn is not None:
            self.conn.resume(client_full=True)


class _BackendSide(asyncio.Protocol):
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn

    def data_received(self, data: bytes) -> None:
        self.conn.data(False, data)

    def eof_received(self) -> bool:
        self.conn.eof(False)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.lost(False, exc)

    def pause_writing(self) -> None:
        self.conn.pause(client_full=False)

    def resume_writing(self) -> None:
        self.conn.resume(client_full=False)
