"""vLLM's KV-cache events as plain data, and the sequence logic that keeps a subscriber's copy of
an engine's block set whole.

Wire format (vLLM's ``ZmqEventPublisher``, also what the simulated engine publishes): a ZMQ
message ``[topic, seq, payload]`` with ``seq`` an 8-byte big-endian batch number (0, 1, 2, ...
per engine process) and ``payload`` msgpack of ``[ts, events, dp_rank]``; each event is a map
tagged ``type``: ``BlockStored`` (``block_hashes`` as 64-bit ints, ``parent_block_hash``,
``token_ids`` of whole blocks, ``block_size``, ``medium`` ...), ``BlockRemoved``
(``block_hashes``) or ``AllBlocksCleared``. A replay socket (ROUTER) answers ``["", start_seq]``
with every buffered batch from ``start_seq`` on, then an end marker whose seq is -1.

This module knows the schema (`decode_batch`, `encode_batch`) on already-unpacked objects and
decides what a subscriber must do (`EventStream`); sockets and msgpack live in the drivers
(extproc/kv_events.py, the simulator).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
END_SEQ = -1  # the replay's end marker
MEDIUM = "GPU"
# Bounds on an engine's cache geometry (KV events and `cache_config_info`): far above any real
# engine's, low enough that tokens = blocks x block size stays exact in int64 arithmetic.
MAX_BLOCK_SIZE = 1 << 16
MAX_GPU_BLOCKS = 1 << 40
# Batches whose publication time a subscriber keeps, the newest: a live batch behind them is told
# apart from a repeat (the same seq and time: it was queued on the socket while a replay answered
# it too) by that time. Above the SUB and PUB sockets' default queues (1,000 messages each).
RECENT_BATCHES = 4096


def block_size_ok(size: object) -> bool:
    return isinstance(size, int) and not isinstance(size, bool) and 1 <= size <= MAX_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One event: ``kind`` is STORED, REMOVED or CLEARED (which has no hashes)."""

    kind: str
    block_hashes: tuple[int, ...] = ()
    parent: int | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[KVEvent, ...]


def publisher_binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: it binds wildcard (``*``, ``::``) and ipc/inproc
    endpoints and connects to any other, where the subscriber must bind. (Its replay socket
    always binds.)"""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventFormatError(ValueError):
    """A payload that is not a KV-event batch."""


def _hash(value: Any) -> int:
    """A published block hash: vLLM sends a 64-bit int (bytes before 0.11; kept as their low 64
    bits, big-endian, which is what the int form is)."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big") & (2**64 - 1)
    if isinstance(value, int) and not isinstance(value, bool):
        return value & (2**64 - 1)
    raise EventFormatError(f"block hash {value!r:.40} is neither an int nor bytes")


def decode_event(raw: Any) -> KVEvent | None:
    """One unpacked event, or None for an event type this router does not use."""
    if not isinstance(raw, dict):
        raise EventFormatError("an event must be a map")
    kind = raw.get("type")
    if kind == CLEARED:
        return KVEvent(CLEARED)
    if kind not in (STORED, REMOVED):
        return None
    if raw.get("medium", MEDIUM) not in (MEDIUM, None):
        return None  # another tier (vLLM's CPU offloading): other block sizes, not GPU blocks
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list):
        raise EventFormatError(f"{kind}.block_hashes must be a list")
    if kind == REMOVED:
        return KVEvent(REMOVED, tuple(map(_hash, hashes)))
    parent = raw.get("parent_block_hash")
    size = raw.get("block_size")
    if not block_size_ok(size):
        raise EventFormatError(f"BlockStored.block_size must be an int in [1, {MAX_BLOCK_SIZE}], "
                               f"got {size!r:.40}")
    tokens = raw.get("token_ids") or []
    if not isinstance(tokens, list):
        raise EventFormatError(f"BlockStored.token_ids must be a list, got {tokens!r:.40}")
    return KVEvent(STORED, tuple(map(_hash, hashes)), None if parent is None else _hash(parent),
                   tuple(tokens), size)


def decode_batch(seq: int, raw: Any) -> EventBatch:
    """A batch from its seq and unpacked payload ``[ts, events, dp_rank]``."""
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list):
        raise EventFormatError("a batch must be [ts, events, ...]")
    if isinstance(raw[0], bool) or not isinstance(raw[0], int | float):
        raise EventFormatError(f"a batch's ts must be a number, got {raw[0]!r:.40}")
    events = (decode_event(e) for e in raw[1])
    return EventBatch(seq, float(raw[0]), tuple(e for e in events if e is not None))


def encode_event(e: KVEvent) -> dict[str, Any]:
    """An event as vLLM's msgspec encoder writes it (fields at their defaults left out)."""
    if e.kind == CLEARED:
        return {"type": CLEARED}
    if e.kind == REMOVED:
        return {"type": REMOVED, "block_hashes": list(e.block_hashes), "medium": MEDIUM}
    return {"type": STORED, "block_hashes": list(e.block_hashes),
            "parent_block_hash": e.parent, "token_ids": list(e.token_ids),
            "block_size": e.block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}


def encode_batch(ts: float, events: list[KVEvent] | tuple[KVEvent, ...]) -> list[Any]:
    """A batch's payload, ready for msgpack: ``[ts, events, dp_rank]``."""
    return [ts, [encode_event(e) for e in events], 0]


# --- a subscriber's sequence logic ----------------------------------------------------------------

APPLY, CLEAR, REPLAY = "apply", "clear", "replay"


@dataclass(frozen=True, slots=True)
class Action:
    """What the subscriber does next: APPLY ``batch`` to the block set, CLEAR it, or ask the
    replay socket for every batch from ``seq`` on."""

    kind: str
    batch: EventBatch | None = None
    seq: int = 0


@dataclass
class EventStream:
    """One engine's batches in order, whatever the network did to them.

    A subscriber starts by replaying from 0 (the engine's buffered history: a warm engine's blocks
    are known at once). Live batches are applied while their seq is the next one; a jump ahead is
    a gap, filled from the replay socket (the batch that showed it held for the answer); a seq
    behind (a fresh count) is an engine restart: its blocks are gone, so the set is cleared and
    filled from 0.
    A replay that no longer holds the first missing batch (its buffer moved on) cannot make the
    set whole: it is cleared and rebuilt from what the replay still has, so blocks stored before
    that and never removed stay unknown (under-counted, never invented).

    A reconnection (the engine process went away and came back, or the network did) replays from
    0: a history that ends before the batches already applied, or whose batch at the last seq
    applied was published at another time, is a new process, whose first batches were published
    before the subscription was back, so the set is rebuilt from it.

    A live batch behind the next seq that repeats one applied (same seq, same time) is dropped:
    it was queued on the socket while a replay answered it (one lost batch and a burst after it
    once read as nine engine restarts, each clearing the set).

    A batch of the process before a restart can still wait on the socket when its successor's
    history has been applied. Live, it is published before the newest batch applied (one process
    publishes in time order), so it is dropped (``stale``) wherever its seq falls: at the next
    seq it would have been applied as the new process's (an engine clock stepped back drops
    batches until one past it, whose gap the replay fills). Held while a replay is asked, it is
    missing from the answer or stamped otherwise there (an engine buffers each batch as it
    publishes it), so it is dropped and the history replayed from 0 decides, as after a
    reconnection, whether the batches applied are the answering process's: an empty answer had
    cleared the set and applied that batch. (An empty answer proves another process only where
    the engine keeps a history: a replay socket of vLLM's ``buffer_steps`` 0 is no replay socket,
    `extproc.kv_events.parse_sources`.) With no batch applied since the set was last cleared (an
    empty history), a live batch has nothing to be compared with, even at the next seq: it is
    held and checked against the replay like the batch of a gap, so a late batch of a process
    between two restarts is not applied as the first of the one answering.

    ``synced`` is False until the first replay answered and while a gap is open: the router uses
    its approximate view of the replica then.
    """

    expected: int | None = None  # the next seq to apply; None before the first sync
    replaying: bool = False
    held: list[EventBatch] = field(default_factory=list)
    gaps: int = 0  # gaps filled (or found unfillable)
    restarts: int = 0
    lost: int = 0  # replays that could not fill their gap
    resyncing: bool = False
    repeats: int = 0  # live batches dropped as repeats of applied ones
    stale: int = 0  # batches of an earlier engine process dropped
    # Publication times of the newest batches applied: seqs expected - len(recent) .. expected - 1.
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_BATCHES))

    @property
    def synced(self) -> bool:
        return self.expected is not None and not self.replaying

    def start(self) -> list[Action]:
        """(Re)subscribe: replay the whole buffered history."""
        self.replaying = True
        return [Action(REPLAY, seq=0 if self.expected is None else self.expected)]

    def reconnected(self) -> list[Action]:
        """The subscription reconnected: replay the whole history to tell a new engine process
        from the same one."""
        if self.expected is None or self.replaying:
            return []
        self.replaying = self.resyncing = True
        return [Action(REPLAY, seq=0)]

    def live(self, batch: EventBatch) -> list[Action]:
        """A batch from the socket; one that asks for a replay is held until its answer (the
        driver asks it before it reads the socket again)."""
        if self.replaying:
            self.held.append(batch)
            return []
        assert self.expected is not None, "start() first"
        if batch.seq < self.expected and self._applied_at(batch.seq) == batch.ts:
            self.repeats += 1
            return []
        if self.recent and batch.ts < self.recent[-1]:
            self.stale += 1
            return []
        if batch.seq == self.expected and self.recent:
            self.expected += 1
            self.recent.append(batch.ts)
            return [Action(APPLY, batch)]
        self.held.append(batch)
        self.replaying = True
        if batch.seq < self.expected:
            self.restarts += 1
            self.expected = 0
            self.recent.clear()
            return [Action(CLEAR), Action(REPLAY, seq=0)]
        if batch.seq > self.expected:
            self.gaps += 1
        return [Action(REPLAY, seq=self.expected)]

    def replayed(self, batches: list[EventBatch]) -> list[Action]:
        """The replay's answer (in seq order, end marker excluded), asked after every held batch
        was read: the answering engine holds each from the answer's first seq on, unless it is
        another process than the one that published it (see the class)."""
        first = batches[0].seq if batches else None
        answered = {b.seq: b.ts for b in batches}
        stale = sum(1 for h in self.held
                    if (first is None or h.seq >= first) and answered.get(h.seq) != h.ts)
        self.held.clear()
        if stale:
            self.stale += stale
            if not self.resyncing:
                self.resyncing = True
                return [Action(REPLAY, seq=0)]
        return self._sync(batches)

    def unreplayable(self) -> list[Action]:
        """No replay socket: the held live batches are all there is."""
        return self._sync([])

    def _sync(self, batches: list[EventBatch]) -> list[Action]:
        """Apply a history (``batches``, then the held live batches) from the next seq on."""
        want = 0 if self.expected is None else self.expected
        out: list[Action] = []
        if self.resyncing and self._new_process(batches, want):
            self.restarts += 1
            want = 0
            out.append(Action(CLEAR))
        self.resyncing = False
        if self.expected is None:
            out.append(Action(CLEAR))  # a first sync replaces whatever the set held
        if batches and batches[0].seq > want:
            self.lost += 1
            out.append(Action(CLEAR))
            want = batches[0].seq
        elif not batches and self.held and self.held[0].seq > want:
            self.lost += 1  # nothing buffered, yet live batches are past what we have
            out.append(Action(CLEAR))
            want = self.held[0].seq
        if out:
            self.recent.clear()
        for b in sorted([*batches, *self.held], key=lambda b: b.seq):
            if b.seq == want:
                out.append(Action(APPLY, b))
                self.recent.append(b.ts)
                want += 1
        self.expected = want
        self.held.clear()
        self.replaying = False
        return out

    def _applied_at(self, seq: int) -> float | None:
        """The publication time of the applied batch ``seq``, if still kept."""
        assert self.expected is not None
        k = seq - (self.expected - len(self.recent))
        return self.recent[k] if 0 <= k < len(self.recent) else None

    def _new_process(self, batches: list[EventBatch], want: int) -> bool:
        """Whether a history replayed from 0 is another process's than the batches applied: it
        ends before them, or its batch at the last seq applied was published at another time,
        or that batch cannot be compared (the buffer moved past it, or its time is no longer
        kept): then the set is rebuilt from the history, under-counted rather than keeping
        another process's blocks (a new process that had published exactly as many batches as
        its buffer holds past the last seq applied was taken for the same one)."""
        if want == 0:
            return False
        if (batches[-1].seq if batches else -1) < want - 1:
            return True
        last = self._applied_at(want - 1)
        same = next((b for b in batches if b.seq == want - 1), None)
        return last is None or same is None or same.ts != last

    def replay_failed(self) -> list[Action]:
        """No answer from the replay socket: try again; live batches stay held meanwhile."""
        seq = 0 if self.expected is None or self.resyncing else self.expected
        return [Action(REPLAY, seq=seq)]
