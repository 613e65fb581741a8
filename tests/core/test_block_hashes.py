"""The router reproduces vLLM's block hashes: vectors computed by vLLM 0.32's own
``hash_block_tokens`` (tokens 1..16 in blocks of 4, each algorithm and seed)."""

from __future__ import annotations

import pytest

from gorgo.core.block_hashes import DEFAULT_SEED, BlockHasher

TOKENS = list(range(1, 20))  # 4 full blocks of 4, a partial tail the engine does not hash
VLLM = {
    ("sha256", DEFAULT_SEED): [1882140585328457242, 15284023028817948126, 6861639779391821457,
                               3148578060895441649],
    ("sha256", ""): [5065430595016313320, 2098517715065798048, 5065368898037750348,
                     13530788152670223534],
    ("sha256", "42"): [649359390096368487, 14757019014570657544, 844366801076949820,
                       3355723678711265293],
    ("sha256_cbor", DEFAULT_SEED): [9561501211280363793, 15292913576410714033,
                                    16642949654738151050, 15930164532976791386],
    ("sha256_cbor", ""): [3122812028340818358, 326515645919804222, 16686517327128142599,
                          6565212502880038572],
    ("sha256_cbor", "42"): [5988051177307384287, 11214766589215907092, 1500001339873974775,
                            723433938799715047],
}


@pytest.mark.parametrize(("algo", "seed"), list(VLLM))
def test_matches_vllm(algo: str, seed: str) -> None:
    assert BlockHasher(algo, 4, seed).hashes(TOKENS) == VLLM[algo, seed]


def test_lazy_chunks_equal_whole_and_stop_early() -> None:
    h = BlockHasher("sha256_cbor", 4)
    chunks = [TOKENS[:3], TOKENS[3:10], [], TOKENS[10:]]
    assert list(h.iter_hashes(chunks)) == h.hashes(TOKENS)
    consumed = []

    def gen():
        for c in chunks:
            consumed.append(c)
            yield c

    it = h.iter_hashes(gen())
    next(it)  # the first block needs only the first two chunks
    assert len(consumed) == 2


def test_unsupported_algorithm() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        BlockHasher("xxhash", 16)
