"""A prefix KV cache keyed by chained block hashes, with reference counts and LRU eviction.

Capacity is counted in tokens. Full prompt blocks live in the cache under their chained hash
(block k's hash covers blocks 0..k, so the longest cached prefix is the longest run of cached
hashes from position 0) and are shared between requests through reference counts. Everything a
request holds outside the cache (the uncached part of its prompt until it is computed, its partial
tail block, its generated tokens) is "private" capacity. Only unreferenced blocks can be evicted,
least recently released first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class PrefixKVCache:
    """Block-hash prefix cache over a token budget; all operations are O(blocks touched)."""

    __slots__ = ("_lru", "_private", "_refs", "block_tokens", "capacity_tokens", "evicted_blocks",
                 "on_remove")

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        if block_tokens < 1 or capacity_tokens < block_tokens:
            raise ValueError("need block_tokens >= 1 and capacity_tokens >= block_tokens")
        self.capacity_tokens = capacity_tokens
        self.block_tokens = block_tokens
        self._refs: dict[int, int] = {}  # every cached block -> number of requests holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks, oldest first
        self._private = 0
        self.evicted_blocks = 0
        # Called with each block hash that leaves the cache (the engine's KV events).
        self.on_remove: Callable[[int], None] | None = None

    # -- accounting ---------------------------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        return len(self._refs)

    @property
    def evictable_tokens(self) -> int:
        return len(self._lru) * self.block_tokens

    @property
    def private_tokens(self) -> int:
        return self._private

    @property
    def used_tokens(self) -> int:
        """Tokens of capacity taken, evictable cache included."""
        return len(self._refs) * self.block_tokens + self._private

    @property
    def pinned_tokens(self) -> int:
        """Tokens held by requests: referenced blocks and private tokens."""
        return (len(self._refs) - len(self._lru)) * self.block_tokens + self._private

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    def refcount(self, block_hash: int) -> int:
        return self._refs.get(block_hash, 0)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs

    # -- prefix lookup and pinning ------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` that are cached."""
        refs = self._refs
        n = 0
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    def unreferenced_tokens(self, hashes: Sequence[int]) -> int:
        """Tokens of the cached, currently evictable blocks among ``hashes``."""
        lru = self._lru
        return sum(self.block_tokens for h in hashes if h in lru)

    def pin(self, hashes: Sequence[int]) -> None:
        """Take a reference on cached blocks (all of ``hashes`` must be cached)."""
        refs, lru = self._refs, self._lru
        for h in hashes:
            r = refs[h]
            if r == 0:
                del lru[h]
            refs[h] = r + 1

    def unpin(self, hashes: Sequence[int]) -> None:
        """Drop a reference on each block; blocks left unreferenced become evictable.

        Blocks are released deepest first, so a prefix's tail is evicted before its head and the
        head stays matchable as long as possible.
        """
        refs, lru = self._refs, self._lru
        for h in reversed(hashes):
            r = refs[h] - 1
            refs[h] = r
            if r == 0:
                lru[h] = None

    def commit_block(self, block_hash: int) -> bool:
        """Turn one computed block of private tokens into a cached block held by the caller.

        Returns False when the block was already cached (another request computed it first): the
        caller then shares that copy and its own private tokens are simply freed.
        """
        self._private -= self.block_tokens
        r = self._refs.get(block_hash)
        if r is None:
            self._refs[block_hash] = 1
            return True
        if r == 0:
            del self._lru[block_hash]
        self._refs[block_hash] = r + 1
        return False

    # -- private capacity and eviction ----------------------------------------------------------
    def can_reserve(self, tokens: int, keep_unreferenced: int = 0) -> bool:
        """Whether ``tokens`` fit after evicting, sparing ``keep_unreferenced`` evictable tokens."""
        return self.free_tokens + self.evictable_tokens - keep_unreferenced >= tokens

    def reserve(self, tokens: int) -> bool:
        """Take ``tokens`` of private capacity, evicting LRU blocks as needed."""
        if not self.can_reserve(tokens):
            return False
        self._evict_until_free(tokens)
        self._private += tokens
        return True

    def release(self, tokens: int) -> None:
        if tokens > self._private:
            raise ValueError("releasing more private tokens than held")
        self._private -= tokens

    def _evict_until_free(self, tokens: int) -> None:
        lru, refs = self._lru, self._refs
        missing = tokens - self.free_tokens
        while missing > 0:
            h, _ = lru.popitem(last=False)
            del refs[h]
            self.evicted_blocks += 1
            if self.on_remove is not None:
                self.on_remove(h)
            missing -= self.block_tokens

    def clone(self) -> PrefixKVCache:
        """An independent copy without the removal callback (a rollout's cache, thrown away)."""
        c = PrefixKVCache(self.capacity_tokens, self.block_tokens)
        c._refs = self._refs.copy()
        c._lru = self._lru.copy()
        c._private = self._private
        c.evicted_blocks = self.evicted_blocks
        return c

    def clear(self) -> None:
        """Drop every unreferenced block (what a cache flush does on a real engine)."""
        for h in self._lru:
            del self._refs[h]
            if self.on_remove is not None:
                self.on_remove(h)
        self._lru.clear()
