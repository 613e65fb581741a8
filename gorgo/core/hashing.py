"""64-bit hashing on numpy arrays: the splitmix64 mixer and chained prefix-block hashes.

Block hashes sit on the request path (a 256 KB prompt has a thousand blocks), so they are computed
without a Python call per block: each block's bytes are read as little-endian 64-bit words,
combined with fixed random odd multipliers (a multiply-add universal hash, then splitmix64 to
spread the bits), and the chain "block k covers blocks 0..k" is the polynomial
H_k = H_{k-1} * P + b_k (mod 2^64), which numpy evaluates at once as
H_k = P^k * sum_{j<=k} b_j * P^-j (P is odd, so it is invertible mod 2^64). These are routing hints,
not a security boundary: a crafted collision only makes a router believe a prefix is cached.
"""

from __future__ import annotations

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_P = 0x100000001B3  # odd: the FNV-64 prime
_P_INV = pow(_P, -1, 1 << 64)
_WORDS = 512  # multipliers for blocks of up to 4 KiB; longer blocks reuse them cyclically
_MULT = np.random.default_rng(0x6060).integers(0, 2**63, size=_WORDS, dtype=np.uint64)
_MULT = _MULT * np.uint64(2) + np.uint64(1)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic, no warnings)."""
    z = x + _GAMMA  # a new array: the rest works in place on it
    z ^= z >> _S30
    z *= _MUL1
    z ^= z >> _S27
    z *= _MUL2
    z ^= z >> _S31
    return z


def _powers(base: int, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.uint64)
    if n:
        out[0] = 1
        out[1:] = np.uint64(base)
        np.multiply.accumulate(out, out=out)
    return out


# The powers of P and P^-1 for up to this many blocks, computed once (a 256 KB prompt has about
# a thousand blocks); a longer chain computes its own.
_CACHED_POWERS = 4096
_POW_P, _POW_P_INV = _powers(_P, _CACHED_POWERS), _powers(_P_INV, _CACHED_POWERS)
_POW_P.flags.writeable = _POW_P_INV.flags.writeable = False


def block_digests(blocks: np.ndarray, lengths: np.ndarray | int) -> np.ndarray:
    """One 64-bit digest per row of a zero-padded ``(n, 8*w)`` uint8 array of block bytes, of
    the given byte ``lengths`` (one for all rows, or one per row)."""
    words = blocks.view("<u8")
    w = words.shape[1]
    mult = _MULT[:w] if w <= _WORDS else np.resize(_MULT, w)
    # The same wrapping multiply-add as (words * mult).sum(axis=1), without the (n, w) product
    # array: 1.6 against 4.2 us for an 8 KB prompt.
    mixed = words @ mult
    mixed += lengths if isinstance(lengths, int) else lengths.astype(np.uint64, copy=False)
    return splitmix64(mixed)


def chain(digests: np.ndarray) -> np.ndarray:
    """Chained hashes: element k depends on digests 0..k in order."""
    n = len(digests)
    if n <= _CACHED_POWERS:
        pow_inv, pow_p = _POW_P_INV[:n], _POW_P[:n]
    else:
        pow_inv, pow_p = _powers(_P_INV, n), _powers(_P, n)
    scaled = np.cumsum(digests * pow_inv, dtype=np.uint64)
    scaled *= pow_p
    return splitmix64(scaled)


def chain_hashes(data: bytes, block_len: int) -> np.ndarray:
    """Chained hashes of the full ``block_len``-byte blocks of ``data`` (partial tail ignored)."""
    n = len(data) // block_len
    if n == 0:
        return np.empty(0, dtype=np.uint64)
    arr = np.frombuffer(data, dtype=np.uint8, count=n * block_len).reshape(n, block_len)
    width = -(-block_len // 8) * 8
    if width != block_len:
        arr = np.pad(arr, ((0, 0), (0, width - block_len)))
    return chain(block_digests(np.ascontiguousarray(arr), block_len))


def chain_hashes_of(blocks: list[bytes]) -> np.ndarray:
    """Chained hashes of blocks of any lengths; equal to `chain_hashes` on equal blocks."""
    if not blocks:
        return np.empty(0, dtype=np.uint64)
    lengths = np.array([len(b) for b in blocks])
    width = max(8, -(-int(lengths.max()) // 8) * 8)
    arr = np.zeros((len(blocks), width), dtype=np.uint8)
    for k, b in enumerate(blocks):
        arr[k, : len(b)] = np.frombuffer(b, dtype=np.uint8)
    return chain(block_digests(arr, lengths))
