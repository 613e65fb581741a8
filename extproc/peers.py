"""Shared bookings over NATS (fleet ``sharing:``): each router publishes what it routes and what
ends, and applies the other routers' bookings as its own (`gorgo.core.peers`).

The bookings of one turn of the router's loop go out in as few messages as the server's
`max_payload` allows on the fleet's subject (core NATS: at most once, in order per publisher).
Delivery is best effort by design: a lost open leaves the peers undercounting, as they would without
sharing; a lost close is expired after the fleet's request timeout. While the server is unreachable
the router routes on what it has and keeps reconnecting; what it opened meanwhile is not replayed
(those requests are mostly over by then), but what it closed is, once back (a blip of seconds once
left every peer counting the requests that ended during it for the whole request timeout). Routers
come back in no set order, and core NATS keeps nothing for one not yet subscribed: so a router back
on the bus also sends a hello (`gorgo.core.peers.hello`) with its own reply address, and every peer
answers there with the closes it sent over the last ``RESEND_S`` (after a server restart, a router
whose replay went out before its peer had resubscribed once left that peer holding the requests for
the request timeout; the same answer covers a router cut off alone for a while). A repeated close is
a no-op for its receiver. A message that does not decode is counted and dropped whole; one the
server refuses is counted (`direction="failed"`) and logged. Who may publish on the subject is the
NATS server's to decide (credentials in the URL, or TLS): a publisher there can make the routers
believe replicas busier, or caching more, than they are, up to the bounds of `gorgo.core.peers`
(peers and bookings believed), never route a request itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from extproc.telemetry import RepeatedFailures, RouterMetrics, log_event
from gorgo.core.peers import CLOSED, MAX_PEERS, Booking, Row, decode, hello, pack, rows
from gorgo.core.router import Router

if TYPE_CHECKING:
    from nats.aio.client import Client

log = logging.getLogger("gorgo.peers")
RECONNECT_S = 1.0  # between attempts while the server is unreachable
# Closes kept while the server is unreachable, to send once back (the oldest go first past it),
# and the closes sent, kept for a peer that comes back to ask for them (the same bound).
MAX_UNSENT_CLOSES = 100_000
# How far back a peer's hello is answered: well past the seconds routers take to come back after
# a server restart (they retry every RECONNECT_S), and a router cut off alone for less.
RESEND_S = 30.0
INBOX_PREFIX = "_INBOX."  # nats-py's new_inbox(): where a hello's answer may go
# Closes re-sent a second, over every answer: a router at 100 req/s held 3,000 closes, and 256
# hellos a second from one publisher held its loop about 3 s of every 4 re-encoding them. Above
# what K = 8 routers at 1,000 req/s each ask of one another after a server restart (7 x 30,000).
MAX_RESENT_PER_S = 300_000


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
        # The closes sent, by decision id, oldest first; a re-open (a retry) takes its close out:
        # re-sent after it, that close would end the retried request in the peer's view.
        self._recent: OrderedDict[str, tuple[float, Row]] = OrderedDict()
        self._answer_messages: list[bytes] | None = None  # the answer to the last hello, while
        # no close came or went since
        self._inbox = ""
        # When this router answered hellos over the last second, and how many closes each.
        self._answers: list[tuple[float, int]] = []
        self.sent = 0
        self.resent = 0
        self.unanswered = 0
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
            self._inbox = nc.new_inbox()
            await nc.subscribe(self._inbox, cb=self._on_message)
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
        encoded = rows(bookings, self._nc.max_payload)
        self._remember(bookings, encoded, time.monotonic())
        return pack(self.router.router_id, encoded, self._nc.max_payload)

    def _remember(self, bookings: list[Booking], encoded: list[Row], now: float) -> None:
        """Keep the closes sent, encoded, for a peer's hello: those of the last ``RESEND_S``, at
        most ``MAX_UNSENT_CLOSES``; a re-open takes its request's close out."""
        if bookings:
            self._answer_messages = None
        for b, row in zip(bookings, encoded, strict=True):
            if b.kind == CLOSED:
                self._recent[b.decision_id] = (now, row)
                self._recent.move_to_end(b.decision_id)
            else:
                self._recent.pop(b.decision_id, None)
        while self._recent and (len(self._recent) > MAX_UNSENT_CLOSES
                                or now - next(iter(self._recent.values()))[0] > RESEND_S):
            self._recent.popitem(last=False)
            self._answer_messages = None

    async def _publish(self, messages: list[bytes], subject: str = "", reply: str = "") -> None:
        for data in messages:  # in order: an open before its close
            try:
                assert self._nc is not None
                await self._nc.publish(subject or self.subject, data, reply=reply)
                if subject:
                    self.resent += 1
                else:
                    self.sent += 1
            except Exception as exc:  # refused, closed or draining: these bookings are lost
                self.failed += 1
                self._failures(exc, bytes=len(data))

    def _answer(self, reply: str) -> None:
        """A peer came back and asks, at ``reply``, for what it may have missed: the closes sent
        over the last ``RESEND_S``, packed once for every hello until a close comes or goes. At
        most ``MAX_PEERS`` answers and ``MAX_RESENT_PER_S`` closes a second (the others counted
        unanswered): whoever publishes hellos cannot make the router re-send without end."""
        now = time.monotonic()
        self._answers = [(t, n) for t, n in self._answers if now - t < 1.0]
        self._remember([], [], now)
        if not self._recent or not self.connected:
            return
        if (len(self._answers) >= MAX_PEERS
                or sum(n for _, n in self._answers) + len(self._recent) > MAX_RESENT_PER_S):
            self.unanswered += 1
            return
        self._answers.append((now, len(self._recent)))
        assert self._nc is not None
        if self._answer_messages is None:
            self._answer_messages = pack(self.router.router_id,
                                         [row for _, row in self._recent.values()],
                                         self._nc.max_payload)
        asyncio.get_running_loop().create_task(
            self._publish(self._answer_messages, subject=reply))

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
        if not bookings:
            if msg.subject == self.subject and msg.reply:
                # To the asker's inbox only: answers to the fleet's subject (or any subject a
                # router reads) made every router decode them, 300,000 closes a second each.
                if msg.reply.startswith(INBOX_PREFIX) and msg.reply != self.subject:
                    self._answer(msg.reply)
                else:
                    self.unanswered += 1
            return
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
        # And ask the peers for theirs (subscriptions are back before this callback runs).
        await self._publish([hello(self.router.router_id)], reply=self._inbox)

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
                             ("resent", link.resent), ("unanswered", link.unanswered),
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
