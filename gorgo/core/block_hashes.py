"""The block hashes a vLLM engine computes for its prefix cache, reproduced outside it.

vLLM (v1, 0.32) hashes each full block of ``block_size`` prompt tokens chained on its parent:
``h_k = H((h_{k-1}, tuple(tokens of block k), extra_keys))`` with ``h_{-1} = NONE = H(seed)``,
where ``H`` is ``sha256`` of the pickled tuple (``prefix_caching_hash_algo: sha256``, the default)
or of its canonical CBOR (``sha256_cbor``, reproducible outside Python, recommended), and the seed
is the engine's ``PYTHONHASHSEED`` when it is set (even to the empty string), else
``"vllm-none-hash"``. The chain runs on the full 32-byte digests; KV events publish the low 64
bits (the digest read big-endian, masked). ``extra_keys`` is None for a plain text request (LoRA,
multimodal inputs and ``cache_salt`` add keys; a router cannot see those, so such requests are
looked up as plain ones and simply miss).

The xxhash algorithms are not supported: without ``PYTHONHASHSEED`` their seed is random per
engine process, so no router can reproduce them.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

DEFAULT_SEED = "vllm-none-hash"
MEMO_BLOCKS = 65536  # digests memoised per hasher (about 10 MB)
ALGORITHMS = ("sha256", "sha256_cbor")
MASK64 = 2**64 - 1


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only precise-cache replicas need it

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def hash_function(algorithm: str) -> Callable[[Any], bytes]:
    if algorithm == "sha256":
        return _sha256_pickle
    if algorithm == "sha256_cbor":
        return _sha256_cbor
    raise ValueError(f"unsupported prefix_caching_hash_algo {algorithm!r} "
                     f"(supported: {', '.join(ALGORITHMS)})")


class BlockHasher:
    """One engine's hashing: algorithm, seed and block size."""

    __slots__ = ("_fn", "_memo", "_none", "algorithm", "block_size", "seed")

    def __init__(self, algorithm: str, block_size: int, seed: str = DEFAULT_SEED) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self._fn = hash_function(algorithm)
        self.algorithm = algorithm
        self.block_size = block_size
        self.seed = seed
        self._none = self._fn(seed)
        # (parent digest, Python's hash of the block's tokens) -> digest: a block seen before
        # costs a tuple hash (0.5 us for 128 tokens) instead of CBOR and SHA-256 (6 us). Like
        # every hash here a routing hint: a collision only misleads the lookup.
        self._memo: OrderedDict[tuple[bytes, int], bytes] = OrderedDict()

    @property
    def key(self) -> tuple[str, int, str]:
        """Engines with equal keys (and tokenizers) publish equal hashes for equal prompts."""
        return self.algorithm, self.block_size, self.seed

    def iter_hashes(self, token_chunks: Iterable[Sequence[int]],
                    spent: list[int] | None = None) -> Iterator[int]:
        """The published (64-bit) hash of each full block, lazily: a caller that stops at its
        first miss never tokenizes or hashes the rest of the prompt. ``spent[0]`` grows by the
        tokens of each block hashed afresh (not memoised)."""
        fn, bs, memo = self._fn, self.block_size, self._memo
        parent = self._none
        buf: list[int] = []
        for chunk in token_chunks:
            buf.extend(chunk)
            start = 0
            while len(buf) - start >= bs:
                block = tuple(buf[start:start + bs])
                key = (parent, hash(block))
                digest = memo.get(key)
                if digest is None:
                    digest = memo[key] = fn((parent, block, None))
                    if spent is not None:
                        spent[0] += bs
                    if len(memo) > MEMO_BLOCKS:
                        # The oldest, in O(1): a plain dict's first key, after many deletions
                        # at its front, is found by scanning their tombstones (50 us here).
                        with contextlib.suppress(KeyError):  # another thread may race
                            memo.popitem(last=False)
                parent = digest
                start += bs
                yield int.from_bytes(parent, "big") & MASK64
            del buf[:start]

    def hashes(self, token_ids: list[int]) -> list[int]:
        return list(self.iter_hashes([token_ids]))
