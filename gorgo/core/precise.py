"""The precise cache view: each `cache: precise` replica's real block set, from its KV events.

The approximate view (`prefix_index`) guesses what a replica caches from what this router sent it,
bounded by a capacity; it cannot see evictions, other routers' traffic or a flush. A precise
replica's engine publishes every block it stores and removes (`kv_events`); this view applies them
to a `PrefixIndex` without capacity (the engine bounds it), keyed by the engine's own block hashes.
A request is looked up by tokenizing its prompt with the served model's tokenizer and chat
template (`prompt_tokens`) and hashing its blocks as the engine does (`block_hashes`), lazily, up
to the first block no live replica holds; the driver fills the memos with each routed prompt
afterwards (`warm`), so a conversation's next turn walks its cached part from them.

A cached prefix this router never saw (another router sent it, or this one restarted) would have
to be tokenized on the request path: 10-25 ms at 32 KB with a byte-level BPE on the dev machine.
``limits.precise_lookup_tokens`` (256) bounds that work per lookup (tokens tokenized or hashed
afresh), and a match the bound cuts short is carried on along the engine's own chain of blocks:
the events name each stored block's parent, so from the last block walked, the replica's
unbranched run of children (a conversation's later turns, as that engine stored them) stands in
for the rest of the prompt, up to the prompt's length; a branch (a shared system prompt that
many conversations continue) ends it. The result is also never below the approximate view's
guess. Offline, with four routers that do not share bookings (every turn another router routed
is a first sight), this routed within noise of walking everything (real prefix hits within
0.4 points on every trace); stopping at what was walked instead took chat's hit from 76 % to 67 %.

Events lag: a replica reports a prompt's blocks only once it has prefilled them, so the requests
this router sent it that are still open count as cached there too (`PendingBlocks`, in the
router's own block hashes): without them a burst of requests sharing a new prefix would be spread
over the fleet before the first one's blocks were reported. A closed request's blocks stay
pending for ``CLOSED_HOLD_S`` more (expired by the router's tick): its events can arrive after
its answer does, and an agent's next turn, sent the moment the answer ends, would otherwise be
priced as if nothing were cached (seen on real vLLM on a loaded machine). The view of a live
replica is the longer of the two matches.

A replica's view is live once its engine's block size and hash algorithm are known (scraped from
``vllm:cache_config_info`` or the events themselves) and its event stream is synced; until then,
and while a gap is being filled, the router keeps using its approximate view of that replica.
Loading a `tokenizer:` reads its files once, when the view is built (as `load_fleet` reads the
fleet file); lookups do no I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from gorgo.core.block_hashes import ALGORITHMS, BlockHasher
from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec
from gorgo.core.kv_events import CLEARED, REMOVED, STORED, KVEvent
from gorgo.core.prefix_index import PrefixIndex
from gorgo.core.prompt_tokens import Chunk, PromptTokenizer, load_tokenizer

# How long a closed request's blocks still count as pending on its replica: far beyond the event
# lag of an engine on the same network (milliseconds; a second or so on a loaded machine), short
# against how long a block stays cached, so an eviction in that window misleads only briefly.
CLOSED_HOLD_S = 2.0
BRANCH = -1  # a parent block with more than one child seen (block hashes are >= 0)


class _Walk:
    """One lookup's walk along a prompt's blocks: the characters and engine tokens it passed
    (to convert engine tokens to the router's), the fresh work it spent, the blocks it yielded,
    and whether it stopped on the budget rather than at a miss or the prompt's end."""

    __slots__ = ("blocks", "chars", "cut", "last", "spent", "tokens")

    def __init__(self) -> None:
        self.chars = self.tokens = self.blocks = 0
        self.spent = [0]
        self.cut = False
        self.last = 0  # the last block hash yielded

    def chunks(self, chunks: Iterator[Chunk]) -> Iterator[Sequence[int]]:
        for ids, chars, fresh in chunks:
            self.chars += chars
            self.tokens += len(ids)
            self.spent[0] += fresh
            yield ids

    def hashes(self, hashes: Iterator[int], budget: int) -> Iterator[int]:
        for h in hashes:
            self.blocks += 1
            self.last = h
            yield h
            if self.spent[0] >= budget:  # resumed: the match wants more than the budget buys
                self.cut = True
                return


class PendingBlocks:
    """Router-hash blocks of the open requests per replica, counted (two open requests may share
    blocks), with a `PrefixIndex` of those held at least once for the lookup."""

    def __init__(self, n: int) -> None:
        self.index = PrefixIndex(n, None)
        self._counts: list[dict[int, int]] = [{} for _ in range(n)]
        self._closed: list[tuple[int, list[int]]] = []  # closed since the last tick
        self._held: deque[tuple[float, int, list[int]]] = deque()  # (until, replica, hashes)

    def add(self, i: int, hashes: list[int]) -> None:
        counts = self._counts[i]
        new = []
        for h in hashes:
            c = counts.get(h, 0)
            if not c:
                new.append(h)
            counts[h] = c + 1
        self.index.insert(i, new)

    def remove(self, i: int, hashes: list[int]) -> None:
        counts = self._counts[i]
        gone = []
        for h in hashes:
            c = counts.get(h, 0) - 1
            if c > 0:
                counts[h] = c
            elif c == 0:
                del counts[h]
                gone.append(h)
        self.index.remove(i, gone)

    def hold(self, i: int, hashes: list[int]) -> None:
        """A request closed: remove its blocks at the first tick ``CLOSED_HOLD_S`` from now."""
        self._closed.append((i, hashes))

    def expire(self, now: float) -> bool:
        """The router's tick: start the hold of the requests closed since the last one, end the
        holds that are over (True if any was)."""
        until = now + CLOSED_HOLD_S
        self._held.extend((until, i, hashes) for i, hashes in self._closed)
        self._closed.clear()
        ended = False
        while self._held and self._held[0][0] <= now:
            _, i, hashes = self._held.popleft()
            self.remove(i, hashes)
            ended = True
        return ended


@dataclass(slots=True)
class _Replica:
    tokenizer: PromptTokenizer
    seed: str
    block_size: int | None = None
    algorithm: str | None = None
    hasher: BlockHasher | None = None
    synced: bool = False


class PreciseCache:
    """Block sets of the fleet's precise replicas and the lookup over them."""

    def __init__(self, spec: FleetSpec) -> None:
        self.n = len(spec.replicas)
        self.router_block_tokens = spec.block_tokens
        self.chars_per_token = spec.chars_per_token
        tokenizers: dict[str, PromptTokenizer] = {}
        self.replicas: dict[int, _Replica] = {}
        for i, r in enumerate(spec.replicas):
            if r.precise is None:
                continue
            name = r.precise.tokenizer
            if name not in tokenizers:
                tokenizers[name] = load_tokenizer(name, spec.chars_per_token)
            self.replicas[i] = _Replica(tokenizers[name], r.precise.hash_seed)
        self.index = PrefixIndex(self.n, None)
        # parent block -> its one child seen in the events, or BRANCH once a second one came
        self._child: dict[int, int] = {}
        self.pending = PendingBlocks(self.n)
        self.events_applied = np.zeros(self.n, dtype=np.int64)

    def live(self, i: int) -> bool:
        r = self.replicas.get(i)
        return r is not None and r.synced and r.hasher is not None

    def live_mask(self) -> int:
        return sum(1 << i for i in self.replicas if self.live(i))

    def blocks_held(self, i: int) -> int:
        return self.index.blocks_held(i)

    # --- writers -------------------------------------------------------------------------------

    def configure(self, i: int, block_size: int | None = None,
                  algorithm: str | None = None) -> None:
        """What the engine says of its cache (either may be None: unchanged). An algorithm this
        view cannot reproduce leaves the replica approximate."""
        r = self.replicas.get(i)
        if r is None:
            return
        r.block_size = block_size or r.block_size
        r.algorithm = algorithm or r.algorithm
        if r.block_size and r.algorithm in ALGORITHMS:
            if r.hasher is None or r.hasher.key != (r.algorithm, r.block_size, r.seed):
                r.hasher = BlockHasher(r.algorithm, r.block_size, r.seed)
        else:
            r.hasher = None

    def set_synced(self, i: int, synced: bool) -> None:
        if i in self.replicas:
            self.replicas[i].synced = synced

    def apply(self, i: int, events: tuple[KVEvent, ...] | list[KVEvent]) -> None:
        """Apply one batch of replica i's events, in order."""
        if i not in self.replicas:
            return
        index, child = self.index, self._child
        for e in events:
            if e.kind == STORED:
                if e.block_size and e.block_size != self.replicas[i].block_size:
                    self.configure(i, block_size=e.block_size)
                index.insert(i, list(e.block_hashes))
                parent = e.parent
                for h in e.block_hashes:
                    if parent is not None and child.setdefault(parent, h) != h:
                        child[parent] = BRANCH
                    parent = h
            elif e.kind == REMOVED:
                index.remove(i, e.block_hashes)
                for h in e.block_hashes:
                    if not index.holders(h):
                        child.pop(h, None)
            elif e.kind == CLEARED:
                self.clear(i)
        self.events_applied[i] += len(events)

    def clear(self, i: int) -> None:
        self.index.clear(i)
        held = self.index.holders
        self._child = {p: c for p, c in self._child.items() if held(p)}

    def _chain(self, h: int, i: int, cap: int) -> int:
        """Blocks replica i holds along the unbranched run of children after block ``h``, at
        most ``cap``."""
        bit, child, held = 1 << i, self._child, self.index.holders
        n = 0
        while n < cap:
            c = child.get(h)
            if c is None or c == BRANCH or not held(c) & bit:
                break
            n += 1
            h = c
        return n

    def sent(self, i: int, block_hashes: np.ndarray) -> None:
        """A request was routed to replica i: its blocks count as cached there while it is open."""
        if i in self.replicas:
            self.pending.add(i, block_hashes.tolist())

    def closed(self, i: int, block_hashes: np.ndarray, served: bool = True) -> None:
        """A request to replica i ended: its blocks stay pending there for ``CLOSED_HOLD_S``, as
        its events may still be on their way; at once if replica i did not serve it (a retry
        moved it elsewhere)."""
        if i in self.replicas:
            if served:
                self.pending.hold(i, block_hashes.tolist())
            else:
                self.pending.remove(i, block_hashes.tolist())

    def tick(self, now: float) -> bool:
        return self.pending.expire(now)

    # --- lookup --------------------------------------------------------------------------------

    def cached_tokens(self, f: RequestFeatures, budget: int) -> tuple[int, np.ndarray, int]:
        """(bitmask of the live replicas looked up, prompt tokens each of them caches, bitmask of
        those whose match the budget cut short: they cache at least that much).

        Tokens are the router's estimate (characters / chars_per_token, what ``prompt_tokens``
        counts), converted from the engine's tokens at the characters-per-token ratio of the part
        of the prompt tokenized (characters of the prompt, not of its chat template's markup:
        `PromptTokenizer.token_chunks`), at most the prompt, so cached and uncached add up to
        it."""
        tokens = np.zeros(self.n, dtype=np.int64)
        groups: dict[tuple, tuple[_Replica, int]] = {}
        for i, r in self.replicas.items():
            if self.live(i):
                assert r.hasher is not None
                key = (id(r.tokenizer), r.hasher.key)
                first, mask = groups.get(key, (r, 0))
                groups[key] = (first, mask | 1 << i)
        live = short = 0
        for r, mask in groups.values():
            assert r.hasher is not None
            walk = _Walk()
            hashes = r.hasher.iter_hashes(walk.chunks(r.tokenizer.token_chunks(f)), walk.spent)
            blocks = self.index.match(walk.hashes(hashes, budget), among=mask)
            scale = walk.chars / walk.tokens / self.chars_per_token \
                if walk.chars and walk.tokens else 1.0
            tokens += (blocks * r.hasher.block_size * scale).astype(np.int64)
            live |= mask
            if walk.cut:
                cut = [i for i in range(self.n) if mask >> i & 1 and blocks[i] == walk.blocks]
                # The prompt's blocks beyond the walk, at the tokens per character tokenized
                # (token ids: the prompt's tokens are its ids).
                total = (f.prompt_chars * walk.tokens // walk.chars if walk.chars
                         else f.prompt_tokens) // r.hasher.block_size
                cap = max(total - walk.blocks, 0)
                for i in cut:
                    more = self._chain(walk.last, i, cap) * r.hasher.block_size * scale
                    tokens[i] += int(more)
                    short |= 1 << i
        return live, np.minimum(tokens, f.prompt_tokens), short

    def warm(self, f: RequestFeatures) -> None:
        """Tokenize and hash the whole prompt for every live replica's tokenizer, filling the
        memos, so the next request that extends it (the conversation's next turn, whose prefix
        the engine has cached by then) is looked up at memo speed. The lookup stopped at the
        first miss; the driver calls this off the request path (extproc: a worker thread, as
        tokenizers release the GIL), and it reads no state the router's loop writes but the
        memos, which tolerate it."""
        seen: set[tuple] = set()
        for r in list(self.replicas.values()):
            hasher = r.hasher
            if hasher is None or (id(r.tokenizer), hasher.key) in seen:
                continue
            seen.add((id(r.tokenizer), hasher.key))
            for _ in hasher.iter_hashes(ids for ids, _, _ in r.tokenizer.token_chunks(f)):
                pass

    def overlay(self, f: RequestFeatures, matched: np.ndarray, budget: int) -> np.ndarray:
        """``matched`` (router blocks per replica, the approximate view) with each live precise
        replica's entry replaced by what its engine really caches, in router blocks; where the
        lookup's ``budget`` cut the match short, by the larger of that and the approximate
        guess."""
        live, tokens, short = self.cached_tokens(f, budget)
        if not live:
            return matched
        pending = self.pending.index.match(f.block_hashes, among=live)
        out = matched.copy()
        for i in range(self.n):
            if live >> i & 1:
                known = max(tokens[i] // self.router_block_tokens, pending[i])
                out[i] = max(known, matched[i]) if short >> i & 1 else known
        return out
