"""Bookings shared between routers, so that each counts the whole fleet's traffic, not its share.

Several routers in front of one fleet (several Envoys, or a proxy per region) each see only the
requests they route: their in-flight accounting undercounts the others' and their approximate
prefix index misses what the others sent. Offline, K = 4 independent routers lost 35-98 % p95
TTFT against one, and the same four sharing one `FleetState` lost nothing (docs/results.md,
"Several routers"). So a router publishes a `Booking` when it routes a request and when the
request ends, and every other router applies them to its state as it applies its own: the
request in flight on its replica (prompt and uncached tokens, the backlog the queue term reads)
and its blocks in the prefix views. The transport is the driver's (`extproc/peers.py` over NATS;
the simulator delivers them one link delay later).

No bus delivers a booking in no time, and a burst that reaches every router at once (a load
balancer splitting one instant's requests) is routed by each before any of the others' bookings
arrive: each then sends its share to the replica that looks cheapest to all of them. So a router
that has live peers counts each of its own choices once more per live peer for ``ECHO_S``
(`Echoes`): the peers, seeing the state it sees, are likely making the same choice at the same
moment. The echo is gone, exactly, before their real bookings could be late; outside bursts it
has expired before the next decision. Offline, on Mooncake's same-instant bursts with K = 4, this
brought p95 TTFT from 1.62x one router's to about 1.2x (docs/results.md, "Several routers,
bookings shared"), and changed Azure and chat by no more than their noise.

Echoes only count what the peers are likely choosing; they cannot make them choose otherwise.
So the routers of one moment also take turns: a router ranked r among its live peers (by router
id) decides r x the fleet's ``sharing.stagger_ms`` later (`PeerBookings.rank`,
`Router.stagger_s`), by when the bookings of the peers ranked before it, made at that moment, have
arrived over the bus. Offline, K = 4 routers in one region on Mooncake went from 1.16x one
router's p95 TTFT to 0.92x (`e2e` objective) with a 2 ms stagger over a 1 ms bus.

A booking names its replica (routers may index the fleet differently); a replica this router does
not know is ignored. A peer that dies leaves its open bookings behind: they expire after the
fleet's request timeout, as a request that long would have been cut. A close without its open
(the open was lost, or arrived after the close) is a no-op, and a repeated open is applied once:
so a router may send a close again (to a peer back after a disconnection, `hello`).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gorgo.core.state import FleetState

OPENED, CLOSED = "open", "close"
FORMAT = 1  # of a bookings message: {"v": FORMAT, "router": id, "b": [[id, kind, replica, ...]]}
# A booking's row: [id, kind, replica, prompt, uncached, hashes], then [seqs, context] for one
# that decodes more than one sequence or over more context than its prompt (`n`, a batch of
# prompts: `RequestFeatures.choices`, `.context_tokens`). A row of six is a request of one
# sequence over its prompt, as every router before the longer row wrote and read (a message
# with a longer row is refused whole by those: they counted such a request as one sequence). So
# a close is always six (the receiver releases what its open booked), and the longer opens go in
# messages of their own: one of them no longer costs an older router the other rows' closes
# (their opens applied, their requests held until the request timeout).
MAX_BOOKINGS = 10_000  # per message: a burst's worth; a larger message is refused whole
MAX_BLOCKS = 1 << 20  # per booking (a 64M-token prompt at 64 tokens a block)
# A message's size, at most (NATS refuses a larger one: its default max_payload, 1 MiB). A loop
# turn's bookings go out in as many messages as they need; a close carries no hashes (its
# receiver releases what the open booked), and an open too long for one message goes without its
# last blocks (its peers count it in flight, and the rest of its prefix). One turn of 14 prompts
# of a megabyte once went out as one message the server refused: its closes with it, and the
# peers held those requests until the request timeout.
MAX_MESSAGE_BYTES = 1 << 20
_HASH_BYTES = 21  # a 64-bit hash in JSON, with its comma
_SEP = (",", ":")
# Whom this router believes, at most: the peers it tracks, and the other routers' open bookings.
# Past them a booking is ignored (a publisher of 30 messages of 10,000 never-closed opens once
# held 300,000 bookings, 157 MB, for the request timeout; 200 made-up router ids made every
# request wait out its turn behind them).
MAX_PEERS = 256
MAX_PEER_BOOKINGS = 200_000
RECENT_CLOSES = 4096  # closes remembered to tell a retry's re-open from an arrival
# How long a router's own choice is echoed for each live peer: longer than a booking takes over a
# bus within a region (about a millisecond), short against the gaps between decisions outside a
# burst. The offline result did not move between 1 ms and 200 ms.
ECHO_S = 0.005
# A peer counts as live while its bookings keep coming: one that sent none for this long is
# gone or idle, and idle peers make no simultaneous choices.
PEER_LIVE_S = 10.0


@dataclass(frozen=True, slots=True)
class Booking:
    router: str  # the publishing router's id (its decision ids' prefix)
    decision_id: str
    kind: str  # OPENED or CLOSED
    replica: str
    prompt_tokens: int = 0
    uncached_tokens: int = 0
    block_hashes: tuple[int, ...] = ()
    seqs: int = 1  # sequences it decodes ...
    context: int | None = None  # ... over these prompt tokens between them (None: the prompt)


def encode(router: str, bookings: Sequence[Booking],
           max_bytes: int = MAX_MESSAGE_BYTES) -> list[bytes]:
    """A router's bookings as messages to send in order (compact JSON: hashes are 64-bit
    integers), each within ``max_bytes`` and ``MAX_BOOKINGS``, and each of rows of one length
    (six fields, or the longer opens), in the bookings' own order: a retry's close and re-open of
    a request of several sequences once went out re-open first, which the peers took for a
    repeat, and then the close removed the request from their view while it ran."""
    return pack(router, rows(bookings, max_bytes), max_bytes)


Row = tuple[int, str]  # a booking's row: its number of fields, and its JSON text


def rows(bookings: Sequence[Booking], max_bytes: int = MAX_MESSAGE_BYTES) -> list[Row]:
    """Each booking's row, encoded once (a driver keeps a close's to send it again)."""
    keep = max((max_bytes - 1024) // _HASH_BYTES, 0)  # hashes of an open that fit a message
    out = []
    for b in bookings:
        row = [b.decision_id, b.kind, b.replica, b.prompt_tokens, b.uncached_tokens,
               list(b.block_hashes[:keep]) if b.kind == OPENED else [],
               *(_decode_batch(b) if b.kind == OPENED else ())]
        out.append((len(row), json.dumps(row, separators=_SEP)))
    return out


def pack(router: str, encoded: Sequence[Row], max_bytes: int = MAX_MESSAGE_BYTES) -> list[bytes]:
    """Rows as messages, in order, each within ``max_bytes`` and ``MAX_BOOKINGS`` and of rows
    of one length (see `encode`)."""
    head = len(json.dumps({"v": FORMAT, "router": router, "b": []}, separators=_SEP))
    out: list[bytes] = []
    batch: list[str] = []
    size, width = head, 0
    for n, text in encoded:
        if batch and (n != width or size + len(text) + 1 > max_bytes
                      or len(batch) >= MAX_BOOKINGS):
            out.append(_message(router, batch))
            batch, size = [], head
        batch.append(text)
        size += len(text) + 1
        width = n
    if batch:
        out.append(_message(router, batch))
    return out


def hello(router: str) -> bytes:
    """A message of no bookings: a router back on the bus after a disconnection says so with it
    (the driver sends it with a reply address, where the peers answer with their recent
    closes). Routers that do not ask or answer read it as a message with nothing to apply."""
    return _message(router, [])


def _message(router: str, rows: list[str]) -> bytes:
    return (f'{{"v":{FORMAT},"router":{json.dumps(router)},"b":[' + ",".join(rows)
            + "]}").encode()


def decode(data: bytes) -> list[Booking]:
    """The bookings of one message; ValueError for anything but a well-formed message of this
    format (a peer's bad message is refused whole, never half applied)."""
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"not JSON: {type(exc).__name__}: {str(exc)[:100]}") from None
    if not isinstance(msg, dict) or msg.get("v") != FORMAT:
        raise ValueError(f"not a bookings message of format {FORMAT}")
    router, rows = msg.get("router"), msg.get("b")
    if not isinstance(router, str) or not isinstance(rows, list) or len(rows) > MAX_BOOKINGS:
        raise ValueError("bad router id or bookings list")
    out = []
    for row in rows:
        if not (isinstance(row, list) and len(row) in (6, 8)):
            raise ValueError("a booking is [id, kind, replica, prompt, uncached, hashes"
                             "(, seqs, context)]")
        did, kind, replica, prompt, uncached, hashes, seqs, context = (
            row if len(row) == 8 else [*row, 1, row[3]])
        if not (isinstance(did, str) and kind in (OPENED, CLOSED) and isinstance(replica, str)
                and _count(prompt) and _count(uncached) and uncached <= prompt
                and _count(seqs) and seqs >= 1
                and _count(context) and prompt <= context <= seqs * prompt
                and isinstance(hashes, list)
                and len(hashes) <= MAX_BLOCKS
                and all(type(h) is int and 0 <= h < 1 << 64 for h in hashes)):
            raise ValueError(f"bad booking {str(row)[:80]}")
        out.append(Booking(router, did, kind, replica, prompt, uncached, tuple(hashes), seqs,
                           None if context == prompt else context))
    return out


def _count(v: object) -> bool:
    return type(v) is int and 0 <= v < 1 << 40


def _decode_batch(b: Booking) -> list[int]:
    """A row's [seqs, context]: none for one sequence over its prompt (the six-field row)."""
    context = b.prompt_tokens if b.context is None else b.context
    return [] if b.seqs == 1 and context == b.prompt_tokens else [b.seqs, context]


@dataclass(slots=True)
class _Held:
    replica: int
    prompt_tokens: int
    uncached: int
    block_hashes: np.ndarray
    expires_at: float
    seqs: int
    context: int | None


class PeerBookings:
    """The other routers' open bookings, applied to this router's state."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._open: OrderedDict[tuple[str, str], _Held] = OrderedDict()  # by expiry (FIFO)
        self.applied = 0
        self.ignored = 0
        self.expired = 0
        self._heard: dict[str, float] = {}  # peer router id -> when its last booking came
        # The latest closes applied: a re-open of one of them is a retry's move (its close and
        # re-open go out together, in order), booked without counting a second arrival.
        self._closed: OrderedDict[tuple[str, str], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._open)

    @property
    def seqs(self) -> int:
        """The decode sequences the open bookings hold (as many as bookings for n = 1)."""
        return sum(h.seqs for h in self._open.values())

    def live_peers(self, now: float) -> int:
        """Peers whose last booking came within ``PEER_LIVE_S``."""
        return sum(1 for at in self._heard.values() if at > now - PEER_LIVE_S)

    def rank(self, me: str, now: float) -> int:
        """How many live peers have a router id below ``me``: this router's place in the order
        in which the routers of one moment decide (`Router.stagger_s`)."""
        return sum(1 for r, at in self._heard.items() if at > now - PEER_LIVE_S and r < me)

    def apply(self, s: FleetState, b: Booking, now: float) -> None:
        key = (b.router, b.decision_id)
        if b.kind == CLOSED:
            held = self._open.pop(key, None)
            if held is None:
                self.ignored += 1
                return
            self._heard[b.router] = now
            self._release(s, held)
            self._closed[key] = None
            if len(self._closed) > RECENT_CLOSES:
                self._closed.popitem(last=False)
            self.applied += 1
            return
        i = s.index.get(b.replica)
        # A prompt longer than any this router admits (its prompt limit counts characters, and a
        # token holds at least one) is no request: its tokens would sit in the replica's queue
        # average long after it closed, pricing the replica out.
        # Likewise a decode batch wider than this router admits in one request (`n` choices of
        # each prompt of a batch).
        limits = s.spec.limits
        too_long = (b.prompt_tokens > limits.max_prompt_chars
                    or b.seqs > limits.max_choices * limits.max_messages)
        # Peers and bookings are only believed up to a bound: a flood is ignored, not held.
        full = (len(self._open) >= MAX_PEER_BOOKINGS
                or (b.router not in self._heard and len(self._heard) >= MAX_PEERS))
        if b.kind != OPENED or i is None or key in self._open or too_long or full:
            self.ignored += 1
            return
        self._heard[b.router] = now
        hashes = np.asarray(b.block_hashes, dtype=np.uint64)
        s.now = max(s.now, now)
        moved = key in self._closed
        if moved:
            del self._closed[key]
        s.book(i, hashes, b.prompt_tokens, b.uncached_tokens, b.seqs, b.context,
               arrival=not moved)
        self._open[key] = _Held(i, b.prompt_tokens, b.uncached_tokens, hashes, now + self.ttl_s,
                                b.seqs, b.context)
        self.applied += 1

    def expire(self, s: FleetState, now: float) -> None:
        """Release the bookings whose router never closed them, and forget the peers long silent
        (the tick)."""
        for router in [r for r, at in self._heard.items() if at <= now - self.ttl_s]:
            del self._heard[router]
        while self._open:
            key, held = next(iter(self._open.items()))
            if held.expires_at > now:
                break
            del self._open[key]
            self._release(s, held)
            self.expired += 1

    def reindexed(self, old_names: list[str], index: dict[str, int], kept: set[str]) -> None:
        """A reload re-indexed the fleet (the new state carried the kept replicas' in-flight
        counts over): follow it, forgetting the bookings on removed replicas."""
        for key, held in list(self._open.items()):
            name = old_names[held.replica]
            if name in kept and name in index:
                held.replica = index[name]
            else:
                del self._open[key]

    @staticmethod
    def _release(s: FleetState, held: _Held) -> None:
        s.unbook(held.replica, held.block_hashes, held.prompt_tokens, held.uncached,
                 seqs=held.seqs, context=held.context)


class Echoes:
    """This router's own recent choices counted again, once per live peer, until ``ECHO_S``
    after each (see the module docstring): requests in flight and uncached tokens in the backlog
    only, never blocks in the prefix views (the peers' prompts are not this one)."""

    def __init__(self) -> None:
        # until, i, prompt, uncached, copies, and replica i's scrape time when echoed
        self._due: deque[tuple[float, int, int, int, int, float]] = deque()

    def __len__(self) -> int:
        return len(self._due)

    def add(self, s: FleetState, i: int, prompt_tokens: int, uncached: int, copies: int,
            now: float) -> None:
        """Echo a choice made at ``now`` (the router expired the echoes due by then first)."""
        if copies > 0:
            s.echo(i, prompt_tokens, uncached, copies)
            self._due.append((now + ECHO_S, i, prompt_tokens, uncached, copies,
                              float(s.eng_scraped_at[i])))

    def expire(self, s: FleetState, now: float) -> None:
        """Take back the echoes due by ``now``; what a scrape since has already counted afresh
        (the engine view of what was sent since it) is not taken back again."""
        due = self._due
        while due and due[0][0] <= now:
            _, i, prompt_tokens, uncached, copies, scraped_at = due.popleft()
            s.echo(i, prompt_tokens, uncached, -copies,
                   engine_view=float(s.eng_scraped_at[i]) == scraped_at)

    def clear(self, s: FleetState) -> None:
        """Undo every echo (a reload re-indexes the fleet)."""
        self.expire(s, math.inf)
