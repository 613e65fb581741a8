"""Token estimates and chained block hashes: the prefix-match contract the router relies on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gorgo.core import hashing
from gorgo.core.hashing import chain_hashes, chain_hashes_of
from gorgo.core.tokens import (
    DEFAULT_BLOCK_TOKENS,
    DEFAULT_CHARS_PER_TOKEN,
    Tokenization,
)

TOK = Tokenization(chars_per_token=1.0, block_tokens=4)  # a block is 4 characters


def test_defaults_and_block_chars() -> None:
    tok = Tokenization()
    assert tok.chars_per_token == DEFAULT_CHARS_PER_TOKEN
    assert tok.block_tokens == DEFAULT_BLOCK_TOKENS
    assert tok.block_chars == 256
    assert Tokenization(chars_per_token=3.5, block_tokens=10).block_chars == 35
    assert Tokenization(chars_per_token=0.1, block_tokens=1).block_chars == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chars_per_token": 0.0}, "chars_per_token"),
        ({"chars_per_token": -1.0}, "chars_per_token"),
        ({"chars_per_token": float("nan")}, "chars_per_token"),
        ({"block_tokens": 0}, "block_tokens"),
    ],
)
def test_invalid_tokenization(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tokenization(**kwargs)


@pytest.mark.parametrize(
    ("cpt", "chars", "tokens"),
    [(4.0, 0, 0), (4.0, -3, 0), (4.0, 1, 1), (4.0, 4, 1), (4.0, 5, 2), (4.0, 8, 2),
     (3.5, 7, 2), (3.5, 8, 3), (1.0, 13, 13)],
)
def test_count_tokens_is_ceil(cpt: float, chars: int, tokens: int) -> None:
    got = Tokenization(chars_per_token=cpt).count_tokens(chars)
    assert got == tokens
    assert isinstance(got, int)


def test_chars_for_tokens() -> None:
    assert Tokenization(chars_per_token=4.0).chars_for_tokens(10) == 40
    assert Tokenization(chars_per_token=3.5).chars_for_tokens(3) == 10  # round(10.5) -> 10


def test_hashes_are_uint64_one_per_full_block() -> None:
    h = TOK.block_hashes("abcdefgh")
    assert h.dtype == np.uint64
    assert len(h) == 2
    assert len(TOK.block_hashes("")) == 0
    assert len(TOK.block_hashes("abc")) == 0


def test_partial_tail_is_not_hashed() -> None:
    base = TOK.block_hashes("abcdefgh")
    for tail in ("x", "xy", "xyz"):
        np.testing.assert_array_equal(TOK.block_hashes("abcdefgh" + tail), base)
    assert len(TOK.block_hashes("abcdefgh" + "wxyz")) == 3


def test_chain_equal_prefix_then_divergence() -> None:
    a = TOK.block_hashes("aaaabbbbccccdddd")
    b = TOK.block_hashes("aaaabbbbXcccdddd")  # differs in block 2 only
    assert len(a) == len(b) == 4
    np.testing.assert_array_equal(a[:2], b[:2])
    # Block 3 is identical text, but its hash covers block 2 as well.
    assert all(a[k] != b[k] for k in range(2, 4))


def test_hash_covers_earlier_blocks() -> None:
    a = TOK.block_hashes("aaaazzzz")
    b = TOK.block_hashes("bbbbzzzz")
    assert a[0] != b[0]
    assert a[1] != b[1]


def test_same_text_same_hashes_across_instances() -> None:
    text = "the quick brown fox jumps over"
    np.testing.assert_array_equal(
        Tokenization(1.0, 4).block_hashes(text), Tokenization(1.0, 4).block_hashes(text)
    )


def test_block_size_changes_hashes() -> None:
    text = "abcdefghijklmnop"
    assert len(Tokenization(1.0, 8).block_hashes(text)) == 2
    assert Tokenization(1.0, 8).block_hashes(text)[0] != TOK.block_hashes(text)[0]


def test_non_ascii_is_cut_on_characters() -> None:
    # 4 characters per block, but each "é" is 2 UTF-8 bytes and each "漢" is 3.
    text = "éééé漢漢漢漢ab"
    h = TOK.block_hashes(text)
    assert len(h) == 2
    other = TOK.block_hashes("éééé字字字字")
    assert h[0] == other[0]
    assert h[1] != other[1]


def test_ascii_prefix_matches_across_ascii_and_non_ascii_prompts() -> None:
    ascii_only = TOK.block_hashes("abcdefgh")
    mixed = TOK.block_hashes("abcdefghé中文字")
    assert len(mixed) == 3
    np.testing.assert_array_equal(mixed[:2], ascii_only)


def test_lone_surrogates_do_not_raise() -> None:
    assert len(TOK.block_hashes("ab\ud800cdefg")) == 2


def test_chain_hashes_cut_and_listed_agree() -> None:
    for block in (4, 8, 13):
        data = bytes(range(3 * block))
        cut = chain_hashes(data, block)
        listed = chain_hashes_of([data[k * block:(k + 1) * block] for k in range(3)])
        np.testing.assert_array_equal(cut, listed)
    assert len(chain_hashes(b"0123456", 4)) == 1
    assert len(chain_hashes(b"", 4)) == 0
    assert len(chain_hashes_of([])) == 0


def test_block_hash_sees_every_byte_and_the_length() -> None:
    base = bytes(64)
    seen = {int(chain_hashes_of([base])[0])}
    for k in range(64):
        flipped = bytearray(base)
        flipped[k] = 1
        seen.add(int(chain_hashes_of([bytes(flipped)])[0]))
    seen.add(int(chain_hashes_of([bytes(63)])[0]))  # shorter, same zero bytes
    assert len(seen) == 66


@settings(max_examples=60, deadline=None)
@given(
    prefix=st.text(max_size=24),
    a_tail=st.text(min_size=1, max_size=12),
    b_tail=st.text(min_size=1, max_size=12),
)
def test_chain_property(prefix: str, a_tail: str, b_tail: str) -> None:
    """Hashes agree on the blocks both texts share and on none after the first difference."""
    a, b = prefix + a_tail, prefix + b_tail
    ha, hb = TOK.block_hashes(a), TOK.block_hashes(b)
    first_diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first_diff is None:
        first_diff = min(len(a), len(b))
    shared = first_diff // TOK.block_chars
    n = min(len(ha), len(hb))
    assert all(ha[k] == hb[k] for k in range(min(shared, n)))
    assert all(ha[k] != hb[k] for k in range(shared, n))


def _digests_by_definition(blocks: np.ndarray, lengths: list[int]) -> list[int]:
    """`block_digests` spelt out in Python integers: each block's little-endian 64-bit words
    times the fixed multipliers (cyclic past the table), summed, plus its length, mod 2**64,
    then splitmix64."""
    mask = (1 << 64) - 1
    mult = [int(m) for m in hashing._MULT]
    out = []
    for row, length in zip(blocks, lengths, strict=True):
        words = [int(w) for w in row.view("<u8")]
        z = (sum(w * mult[k % len(mult)] for k, w in enumerate(words)) + length) & mask
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


@pytest.mark.parametrize("width", [8, 256, 8 * hashing._WORDS + 64])
def test_block_digests_are_the_multiply_add_hash_they_were_defined_as(width: int) -> None:
    """The digests stay what the routers, the simulated engines and the peers' bookings
    agree on, whatever numpy calls compute them (one length for all rows, or one per row)."""
    rng = np.random.default_rng(width)
    blocks = rng.integers(0, 256, size=(5, width), dtype=np.uint8)
    one = hashing.block_digests(blocks, width)
    assert one.tolist() == _digests_by_definition(blocks, [width] * 5)
    lengths = [width - k for k in range(5)]
    each = hashing.block_digests(blocks, np.array(lengths))
    assert each.tolist() == _digests_by_definition(blocks, lengths)
