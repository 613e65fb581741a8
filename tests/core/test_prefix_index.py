"""The router's model of each replica's KV cache: prefix match depths and LRU eviction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gorgo.core.prefix_index import PrefixIndex


def h(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.uint64)


def test_empty_index_matches_nothing() -> None:
    idx = PrefixIndex(3, None)
    np.testing.assert_array_equal(idx.match(h(1, 2, 3)), [0, 0, 0])
    idx.insert(0, h(1))
    np.testing.assert_array_equal(idx.match(h()), [0, 0, 0])
    assert idx.match(h()).dtype == np.int64


def test_match_depth_per_replica() -> None:
    idx = PrefixIndex(4, None)
    idx.insert(0, h(1, 2, 3))
    idx.insert(1, h(1, 2))
    idx.insert(2, h(1, 2, 3, 4, 5))
    np.testing.assert_array_equal(idx.match(h(1, 2, 3, 4)), [3, 2, 4, 0])
    np.testing.assert_array_equal(idx.match(h(1, 9)), [1, 1, 1, 0])


def test_replica_missing_block_zero_matches_zero() -> None:
    idx = PrefixIndex(2, None)
    idx.insert(0, h(1, 2, 3))
    idx.insert(1, h(2, 3))  # holds later blocks only
    np.testing.assert_array_equal(idx.match(h(1, 2, 3)), [3, 0])


def test_match_stops_at_first_missing_block() -> None:
    idx = PrefixIndex(1, [10])
    idx.insert(0, h(1, 3))  # a hole where block 2 would be
    np.testing.assert_array_equal(idx.match(h(1, 2, 3)), [1])


def test_blocks_held_and_sizes() -> None:
    idx = PrefixIndex(3, None)
    idx.insert(0, h(1, 2, 3))
    idx.insert(2, h(1))
    idx.insert(0, h(1, 2))  # already held: no growth
    assert idx.blocks_held(0) == 3
    assert idx.blocks_held(1) == 0
    np.testing.assert_array_equal(idx.sizes(), [3, 0, 1])


def test_lru_evicts_leaves_before_roots() -> None:
    idx = PrefixIndex(1, [4])
    idx.insert(0, h(1, 2, 3))  # request A: root 1, leaf 3
    idx.insert(0, h(1, 7, 8))  # request B shares root 1; one block over capacity
    assert idx.blocks_held(0) == 4
    # A's leaf went, A's older root stayed because B touched it last.
    np.testing.assert_array_equal(idx.match(h(1, 2, 3)), [2])
    np.testing.assert_array_equal(idx.match(h(1, 7, 8)), [3])


def test_lru_evicts_least_recently_used_request() -> None:
    idx = PrefixIndex(1, [4])
    idx.insert(0, h(1, 2))
    idx.insert(0, h(3, 4))
    idx.insert(0, h(1, 2))  # refresh the first request
    idx.insert(0, h(5, 6))  # evicts the second one, leaf first
    np.testing.assert_array_equal(idx.match(h(1, 2)), [2])
    np.testing.assert_array_equal(idx.match(h(3, 4)), [0])
    np.testing.assert_array_equal(idx.match(h(5, 6)), [2])


def test_request_longer_than_capacity_keeps_its_root() -> None:
    idx = PrefixIndex(1, [2])
    idx.insert(0, h(1, 2, 3, 4, 5))
    assert idx.blocks_held(0) == 2
    np.testing.assert_array_equal(idx.match(h(1, 2, 3, 4, 5)), [2])


def test_eviction_on_one_replica_leaves_others() -> None:
    idx = PrefixIndex(2, [2, 10])
    idx.insert(0, h(1, 2))
    idx.insert(1, h(1, 2))
    idx.insert(0, h(3, 4))
    np.testing.assert_array_equal(idx.match(h(1, 2)), [0, 2])
    np.testing.assert_array_equal(idx.match(h(3, 4)), [2, 0])


def test_unbounded_mode_never_evicts() -> None:
    idx = PrefixIndex(1, None)
    for k in range(1000):
        idx.insert(0, h(10_000 + k, k))
    assert idx.blocks_held(0) == 2000
    np.testing.assert_array_equal(idx.match(h(10_000, 0)), [2])


def test_clear_forgets_one_replica() -> None:
    idx = PrefixIndex(3, None)
    idx.insert(0, h(1, 2))
    idx.insert(1, h(1, 2))
    idx.insert(2, h(5))
    idx.clear(1)
    assert idx.blocks_held(1) == 0
    np.testing.assert_array_equal(idx.match(h(1, 2)), [2, 0, 0])
    idx.clear(0)
    np.testing.assert_array_equal(idx.match(h(1, 2)), [0, 0, 0])
    np.testing.assert_array_equal(idx.match(h(5)), [0, 0, 1])
    idx.insert(1, h(1))
    np.testing.assert_array_equal(idx.match(h(1, 2)), [0, 1, 0])


def test_large_hash_values_and_many_replicas() -> None:
    n = 70  # more replicas than bits in a machine word
    idx = PrefixIndex(n, None)
    big = h(2**64 - 1, 2**63)
    idx.insert(n - 1, big)
    idx.insert(0, big[:1])
    depth = idx.match(big)
    assert depth[n - 1] == 2 and depth[0] == 1
    assert depth[1 : n - 1].sum() == 0


@pytest.mark.parametrize("capacity", [None, [3, 5, 8]])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_match_agrees_with_brute_force(capacity: list[int] | None, data: st.DataObject) -> None:
    """Depth = first position whose hash the replica does not hold (chained hashes make it so)."""
    idx = PrefixIndex(3, capacity)
    held: list[dict[int, None]] = [{}, {}, {}]  # insertion-ordered LRU mirror
    for _ in range(data.draw(st.integers(0, 8))):
        i = data.draw(st.integers(0, 2))
        blocks = data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=6, unique=True))
        idx.insert(i, h(*blocks))
        for b in reversed(blocks):
            held[i].pop(b, None)
            held[i][b] = None
        while capacity is not None and len(held[i]) > capacity[i]:
            del held[i][next(iter(held[i]))]
    query = data.draw(st.lists(st.integers(0, 12), max_size=6, unique=True))
    expected = []
    for i in range(3):
        d = 0
        while d < len(query) and query[d] in held[i]:
            d += 1
        expected.append(d)
    np.testing.assert_array_equal(idx.match(h(*query)), expected)
    np.testing.assert_array_equal(idx.sizes(), [len(x) for x in held])
