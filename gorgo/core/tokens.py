"""Token estimates and chained prefix-block hashes.

The router has no tokenizer, so it estimates tokens from characters with a fixed ratio. The
simulated engines use the very same ratio as their pseudo-tokenizer, which makes the router's
estimate exact on the simulated fleet and a documented approximation on real engines.

A prompt is cut into blocks of ``block_tokens`` tokens (``block_tokens * chars_per_token``
characters). Block k's hash covers blocks 0..k, so two prompts share a hash at position k exactly
when they share their first k+1 blocks: a prefix match is a run of equal hashes from the start.
Only full blocks are hashed, as engines only cache full pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gorgo.core.hashing import chain_hashes, chain_hashes_of

DEFAULT_CHARS_PER_TOKEN = 4.0
DEFAULT_BLOCK_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Tokenization:
    """How characters map to tokens and blocks; one instance is shared by router and engines."""

    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    # Tokens a media part of a chat or Responses prompt counts for (the fleet's `media_tokens`;
    # 0 for a text-only model, as the simulated engines are)
    media_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.chars_per_token > 0:
            raise ValueError("chars_per_token must be > 0")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        if self.media_tokens < 0:
            raise ValueError("media_tokens must be >= 0")

    @property
    def block_chars(self) -> int:
        return max(1, round(self.block_tokens * self.chars_per_token))

    def count_tokens(self, n_chars: int) -> int:
        """Estimated tokens for ``n_chars`` characters (ceil: a partial token is a token)."""
        if n_chars <= 0:
            return 0
        return int(-(-n_chars // self.chars_per_token))

    def chars_for_tokens(self, n_tokens: int) -> int:
        return round(n_tokens * self.chars_per_token)

    def id_block_hashes(self, ids: list[int]) -> np.ndarray:
        """Chained hashes of the full blocks of a prompt of token ids: ``block_tokens`` ids a
        block, as the engine pages them (blocks of their decimal text held 8-11 ids at 4
        characters a token and six-digit ids, so the router priced 1.5x the cached tokens
        uncached). Ids are below 2**64 (checked with the prompt)."""
        return chain_hashes(np.asarray(ids, dtype="<u8").tobytes(), 8 * self.block_tokens)

    def block_hashes(self, text: str) -> np.ndarray:
        """Chained 64-bit hashes of the full blocks of ``text`` (uint64 array).

        Blocks are cut on characters. ASCII text (the common case) is hashed straight from its
        bytes; other text is encoded block by block so a block is still ``block_chars`` characters.
        """
        bc = self.block_chars
        if text.isascii():
            return chain_hashes(text.encode("ascii"), bc)
        n = len(text) // bc
        blocks = [text[k * bc : (k + 1) * bc].encode("utf-8", "surrogatepass") for k in range(n)]
        return chain_hashes_of(blocks)
