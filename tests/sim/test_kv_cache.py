import pytest

from gorgo.sim.kv_cache import PrefixKVCache

B = 4


def filled(capacity: int, *prefixes: list[int]) -> PrefixKVCache:
    """A cache holding each prefix's blocks, computed and released by one request each."""
    cache = PrefixKVCache(capacity, B)
    for hashes in prefixes:
        assert cache.reserve(len(hashes) * B)
        for h in hashes:
            cache.commit_block(h)
        cache.unpin(hashes)
    return cache


def test_match_is_the_longest_cached_run_from_the_start():
    cache = filled(100, [1, 2, 3])
    assert cache.match([1, 2, 3, 4]) == 3
    assert cache.match([1, 2, 9]) == 2
    assert cache.match([9, 1, 2]) == 0
    assert cache.match([]) == 0


def test_accounting_of_private_and_cached_tokens():
    cache = PrefixKVCache(64, B)
    assert cache.reserve(10)
    assert (cache.private_tokens, cache.used_tokens, cache.pinned_tokens) == (10, 10, 10)
    assert cache.commit_block(7) is True
    assert (cache.private_tokens, cache.cached_blocks, cache.pinned_tokens) == (6, 1, 10)
    cache.unpin([7])
    assert cache.pinned_tokens == 6
    assert cache.evictable_tokens == B
    cache.release(6)
    assert (cache.used_tokens, cache.free_tokens) == (B, 64 - B)
    with pytest.raises(ValueError):
        cache.release(1)


def test_committing_a_block_already_cached_shares_it_and_frees_the_copy():
    cache = PrefixKVCache(64, B)
    assert cache.reserve(2 * B)
    assert cache.commit_block(5) is True
    assert cache.commit_block(5) is False  # a second request computed the same block
    assert cache.refcount(5) == 2
    assert cache.used_tokens == B
    cache.unpin([5])
    cache.unpin([5])
    assert cache.refcount(5) == 0 and cache.evictable_tokens == B


def test_lru_eviction_takes_the_least_recently_released_blocks_first():
    cache = filled(6 * B, [1, 2], [3, 4], [5, 6])
    assert cache.free_tokens == 0
    assert cache.reserve(2 * B)
    assert 1 not in cache and 2 not in cache
    assert all(h in cache for h in (3, 4, 5, 6))
    assert cache.evicted_blocks == 2


def test_a_prefix_tail_is_evicted_before_its_head():
    cache = filled(4 * B, [1, 2, 3, 4])
    assert cache.reserve(B)
    assert cache.match([1, 2, 3, 4]) == 3  # block 4 (deepest) went first


def test_pinning_refreshes_and_protects_blocks():
    cache = filled(4 * B, [1, 2], [3, 4])
    cache.pin([1, 2])  # a running request now holds the older prefix
    assert cache.reserve(2 * B)
    assert 1 in cache and 2 in cache
    assert 3 not in cache and 4 not in cache


def test_referenced_blocks_are_never_evicted():
    cache = filled(4 * B, [1, 2, 3, 4])
    cache.pin([1, 2, 3, 4])
    assert not cache.can_reserve(1)
    assert not cache.reserve(1)
    assert cache.match([1, 2, 3, 4]) == 4
    cache.unpin([1, 2, 3, 4])
    assert cache.reserve(B)


def test_can_reserve_spares_blocks_about_to_be_pinned():
    cache = filled(4 * B, [1, 2, 3, 4])
    assert cache.can_reserve(4 * B)
    spared = cache.unreferenced_tokens([1, 2])
    assert spared == 2 * B
    assert not cache.can_reserve(3 * B, keep_unreferenced=spared)
    assert cache.can_reserve(2 * B, keep_unreferenced=spared)


def test_clear_drops_only_unreferenced_blocks():
    cache = filled(8 * B, [1, 2], [3, 4])
    cache.pin([3, 4])
    cache.clear()
    assert cache.match([1]) == 0
    assert cache.match([3, 4]) == 2


def test_rejects_bad_geometry():
    with pytest.raises(ValueError):
        PrefixKVCache(2, 4)
    with pytest.raises(ValueError):
        PrefixKVCache(16, 0)
