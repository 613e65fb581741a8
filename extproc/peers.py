"""Shared bookings over NATS (fleet ``sharing:``): each router publishes what it routes and what
ends, and applies the other routers' bookings as its own (`gorgo.core.peers`).

The bookings of one turn of the router's loop go out in as few messages as the server's
`max_payload` allows on the fleet's subject (core NATS: at most once, in order per publisher).
Delivery is best effort by design: a lost open leaves the peers undercounting, as they would
without sharing; a lost close is expired after the fleet's request timeout. While the server is
unreachable the router routes on what it has and keeps reconnecting; what it opened meanwhile is
not replayed (those requests are mostly over by then), but what it closed is, once back (a
blip of seconds once left every peer counting the requests that ended during it for the whole
request timeout). A message that does not decode is counted and dropped whole; one the server
refuses is counted (`direction="failed"`) and logged. Who may publish on the subject is the NATS
server's to decide (credentials in the URL, or TLS): a publisher there can make the routers
believe replicas busier, or caching more, than they are, up to the bounds of `gorgo.core.peers`
(peers and bookings believed), never route a request itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from extproc.telemetry import RepeatedFailures, RouterMetrics, log_event
from gorgo.core.peers import CLOSED, Booking, decode, encode
from gorgo.core.router import Router

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger("gorgo.peers")
RECONNECT_S = 1.0  # between attempts while the server is unreachable
# Closes kept while the server is unreachable, to send once back (the oldest go first past it).
MAX_UNSENT_CLOSES = 100_000


class PeerLink:
    """The router's NATS connection: its publisher and its subscription."""

    def __init__(self, router: Router, metrics: RouterMetrics) -> None:
        sharing = router.spec.sharing
        assert sharing is not None
        self.router = router
        self.url, self.subject = sharing.nats, sharing.subject
        self._nc: Client | None = None
        self._task: asyncio.Task[None] | None = None
        self._flush_due = False
        self._unsent: deque[Booking] = deque(maxlen=MAX_UNSENT_CLOSES)
        self.sent = 0
        self.received = 0
        self.bad = 0
        self.failed = 0
        self._failures = RepeatedFailures(log, "peers_publish_failed")
        router.share(self._wake)
        metrics.registry.register(_PeerCollector(self))

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def start(self) -> None:
        """Connect in the background: the router serves (on its own bookings) until it is."""
        self._task = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        import nats  # about 0.1 s: only a fleet with sharing: pays it

        while True:
            try:
                nc = await nats.connect(
                    self.url, name=f"gorgo-{self.router.router_id}", connect_timeout=2,
                    allow_reconnect=True, max_reconnect_attempts=-1, no_echo=True,
                    reconnect_time_wait=RECONNECT_S, error_cb=self._error,
                    reconnected_cb=self._reconnected, disconnected_cb=self._disconnected)
            except Exception as exc:  # unreachable or refused: keep trying
                log.debug("nats %s: %s", self.url, exc)
                await asyncio.sleep(RECONNECT_S)
                continue
            await nc.subscribe(self.subject, cb=self._on_message)
            self._nc = nc
            log_event(log, "peers_connected", url=_redacted(self.url), subject=self.subject)
            self._wake()  # what was booked while connecting
            return

    def _wake(self) -> None:
        """A booking was made: publish it, and any others of this loop turn, right after."""
        if not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        messages = self._take()
        if messages:
            # Buffered by the client and flushed by its own task.
            asyncio.get_running_loop().create_task(self._publish(messages))

    def _take(self) -> list[bytes]:
        """The messages of what is booked and unsent (none while unreachable: the closes wait)."""
        outbox = self.router.outbox
        if outbox is None or not (outbox or self._unsent):
            return []
        if not self.connected:
            # Opens are not replayed after a reconnection; closes are (see the module docstring).
            self._unsent.extend(b for b in outbox if b.kind == CLOSED)
            outbox.clear()
            return []
        assert self._nc is not None
        bookings = [*self._unsent, *outbox]
        self._unsent.clear()
        outbox.clear()
        return encode(self.router.router_id, bookings, self._nc.max_payload)

    async def _publish(self, messages: list[bytes]) -> None:
        for data in messages:  # in order: an open before its close
            try:
                assert self._nc is not None
                await self._nc.publish(self.subject, data)
                self.sent += 1
            except Exception as exc:  # refused, closed or draining: these bookings are lost
                self.failed += 1
                self._failures(exc, bytes=len(data))

    async def flush(self) -> None:
        """Send what is booked now and wait until the server has it (a stop's last closes)."""
        await self._publish(self._take())
        if self.connected:
            assert self._nc is not None
            try:
                await self._nc.flush(timeout=2)
            except Exception as exc:
                log.debug("nats flush: %s", exc)

    async def _on_message(self, msg: Any) -> None:
        try:
            bookings = decode(msg.data)
        except ValueError as exc:
            self.bad += 1
            log_event(log, "peers_bad_message", logging.WARNING, error=str(exc)[:200])
            return
        self.received += 1
        now = time.monotonic()
        for b in bookings:
            self.router.apply_peer(b, now)

    async def _error(self, exc: Exception) -> None:
        log.debug("nats: %s", exc)

    async def _disconnected(self) -> None:
        log_event(log, "peers_disconnected", logging.WARNING, url=_redacted(self.url))

    async def _reconnected(self) -> None:
        log_event(log, "peers_reconnected", url=_redacted(self.url), closes=len(self._unsent))
        self._wake()  # the closes kept while it was unreachable

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._nc is not None:
            try:
                await self._nc.drain()
            except Exception as exc:  # already closed
                log.debug("nats drain: %s", exc)
            self._nc = None


def _redacted(url: str) -> str:
    """The URL without credentials, for logs."""
    head, at, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if at else url


class _PeerCollector:
    def __init__(self, link: PeerLink) -> None:
        self.link = link

    def collect(self) -> Any:
        link, peers = self.link, self.link.router.peers
        up = GaugeMetricFamily("gorgo_peers_connected",
                               "1 while the router is connected to the fleet's NATS server")
        up.add_metric([], float(link.connected))
        held = GaugeMetricFamily("gorgo_peer_open_bookings",
                                 "Other routers' requests this router counts in flight")
        held.add_metric([], float(len(peers)))
        msgs = CounterMetricFamily("gorgo_peer_messages", "Bookings messages by direction",
                                   labels=["direction"])
        for direction, n in (("sent", link.sent), ("received", link.received),
                             ("bad", link.bad), ("failed", link.failed)):
            msgs.add_metric([direction], n)
        books = CounterMetricFamily("gorgo_peer_bookings",
                                    "Other routers' bookings: applied, ignored (unknown replica, "
                                    "a repeat, a close without its open, a prompt longer than "
                                    "this router admits), expired",
                                    labels=["outcome"])
        for outcome, n in (("applied", peers.applied), ("ignored", peers.ignored),
                           ("expired", peers.expired)):
            books.add_metric([outcome], n)
        yield from (up, held, msgs, books)
