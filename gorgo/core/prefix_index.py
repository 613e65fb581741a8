"""Which prompt prefixes each replica has been sent, as the router's model of its KV cache.

Per replica, an LRU of chained block hashes bounded in blocks (to approximate KV capacity); across
replicas, one map from block hash to a bitmask of holders, so a lookup walks the prompt's blocks
once for the whole fleet instead of once per replica. Because block k's hash covers blocks 0..k, a
replica that holds block k's hash holds that prefix: matching stops for a replica at its first
missing block. Blocks of a request are touched leaf first and root last, so LRU evicts leaves
before the shared roots, as a radix cache does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import numpy as np


class PrefixIndex:
    """Bounded per-replica prefix-block sets with a fleet-wide hash -> holders map."""

    def __init__(self, n_replicas: int, capacity_blocks: list[int] | None) -> None:
        """``capacity_blocks[i]`` bounds replica i; None means unbounded (the paper's trie)."""
        self.n = n_replicas
        self.capacity = capacity_blocks
        self._lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(n_replicas)]
        self._holders: dict[int, int] = {}

    def blocks_held(self, replica: int) -> int:
        return len(self._lru[replica])

    def holders(self, block_hash: int) -> int:
        """Bitmask of the replicas holding the block."""
        return self._holders.get(block_hash, 0)

    def sizes(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self._lru), dtype=np.int64, count=self.n)

    def match(self, hashes: np.ndarray | Iterable[int], among: int | None = None) -> np.ndarray:
        """Matched prefix length in blocks, per replica (int64 array of length n).

        ``hashes`` may be lazy (the precise view computes them as it goes): the walk stops at the
        first block no replica holds. ``among`` (a bitmask) limits it to those replicas.
        """
        depth = np.zeros(self.n, dtype=np.int64)
        alive = (1 << self.n) - 1 if among is None else among
        if not self._holders or not alive:
            return depth
        get = self._holders.get
        k = 0
        for k, h in enumerate(hashes.tolist() if isinstance(hashes, np.ndarray) else hashes, 1):
            nxt = alive & get(h, 0)
            lost = alive & ~nxt
            while lost:
                low = lost & -lost
                depth[low.bit_length() - 1] = k - 1
                lost ^= low
            alive = nxt
            if not alive:
                return depth
        while alive:  # matched every block
            low = alive & -alive
            depth[low.bit_length() - 1] = k
            alive ^= low
        return depth

    def reindexed(self, rows: list[int | None], capacity: list[int] | None) -> PrefixIndex:
        """A new index whose replica j holds old replica ``rows[j]``'s blocks (None: none), with
        that replica's capacity where it had one (its engine may have said); ``capacity``
        bounds the rest. Its blocks move, so this index is not to be used afterwards."""
        new = PrefixIndex(len(rows), capacity)
        for j, i in enumerate(rows):
            if i is None:
                continue
            new._lru[j] = self._lru[i]
            if new.capacity is not None and self.capacity is not None:
                new.capacity[j] = self.capacity[i]
            bit = 1 << j
            for h in new._lru[j]:
                new._holders[h] = new._holders.get(h, 0) | bit
        return new

    def insert(self, replica: int, hashes: np.ndarray | list[int]) -> None:
        """Record that ``replica`` now caches these blocks, evicting its LRU blocks if full."""
        lru = self._lru[replica]
        bit = 1 << replica
        holders = self._holders
        for h in reversed(hashes.tolist() if isinstance(hashes, np.ndarray) else hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        self._trim(replica)

    def set_capacity(self, replica: int, blocks: int) -> None:
        """Bound the replica to ``blocks`` (its engine said how many it has); no-op unbounded."""
        if self.capacity is not None:
            self.capacity[replica] = max(1, blocks)
            self._trim(replica)

    def _trim(self, replica: int) -> None:
        """Evict the replica's LRU blocks down to its capacity."""
        lru = self._lru[replica]
        bit = 1 << replica
        holders = self._holders
        if self.capacity is not None:
            cap = self.capacity[replica]
            while len(lru) > cap:
                old, _ = lru.popitem(last=False)
                rest = holders[old] & ~bit
                if rest:
                    holders[old] = rest
                else:
                    del holders[old]

    def remove(self, replica: int, hashes: Iterable[int]) -> None:
        """The replica no longer holds these blocks (its engine evicted them)."""
        lru = self._lru[replica]
        bit = 1 << replica
        holders = self._holders
        for h in hashes:
            if h in lru:
                del lru[h]
                rest = holders[h] & ~bit
                if rest:
                    holders[h] = rest
                else:
                    del holders[h]

    def clear(self, replica: int) -> None:
        """Forget a replica's cache (its engine restarted: `FleetState._count_outputs`)."""
        bit = 1 << replica
        holders = self._holders
        for h in self._lru[replica]:
            rest = holders[h] & ~bit
            if rest:
                holders[h] = rest
            else:
                del holders[h]
        self._lru[replica].clear()
