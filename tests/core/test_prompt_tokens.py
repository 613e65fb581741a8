"""Prompt token ids as the engine runs them: the simulated tokenizer, and a served model's
tokenizer and chat template (`tests.support.tokenizer`: a small byte-level BPE, no download)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gorgo.core.features import extract_features
from gorgo.core.fleet import FleetError
from gorgo.core.prompt_tokens import HFTokenizer, SimTokenizer, load_tokenizer
from gorgo.core.tokens import Tokenization
from tests.support.tokenizer import words

TOK = Tokenization()


def features(body: dict, path: str = "/v1/chat/completions"):
    return extract_features(path, {}, json.dumps(body).encode(), TOK)


def ids(tokenizer, f) -> list[int]:
    return [t for chunk, _, _ in tokenizer.token_chunks(f) for t in chunk]


def test_sim_tokenizer_counts_as_the_router_and_shares_prefixes() -> None:
    sim = SimTokenizer(4.0)
    a, b = words(400), words(400) + " more text"
    fa = features({"messages": [{"role": "user", "content": a}]})
    fb = features({"messages": [{"role": "user", "content": b}]})
    ia, ib = ids(sim, fa), ids(sim, fb)
    assert len(ia) == fa.prompt_tokens and len(ib) == fb.prompt_tokens
    assert ib[: len(ia) - 1] == ia[:-1]  # all but a partial last token
    assert max(ia) < 2**17 and ia == sim.ids(a).tolist()


@pytest.mark.parametrize("cpt", [0.5, 0.7, 1.0, 2.5])
def test_sim_tokenizer_ids_in_chunks_equal_whole_text(cpt: float) -> None:
    # Below one character per token a chunk's last tokens may share one character: every
    # chunk still has as many ids as tokens (a chunk of them raised IndexError).
    sim, text = SimTokenizer(cpt), "漢字" * 1500
    n = sim.count(len(text))
    whole = sim.ids(text)
    chunks = np.concatenate([sim.ids(text, k, k + 1024) for k in range(0, n, 1024)])
    assert len(whole) == n and chunks.tolist() == whole.tolist()


def test_hf_chunks_count_the_prompts_characters_not_the_templates(model_dir: Path) -> None:
    # The precise view converts engine tokens to the router's at these characters: counted
    # with the template's markup, a conversation of short turns looked cached past its end.
    hf = HFTokenizer(str(model_dir))
    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": "route the cache"}
             for k in range(40)]
    f = features({"messages": turns})
    chunks = list(hf.token_chunks(f))
    assert len(hf.render(f.body, "chat") or "") > 1.5 * f.prompt_chars  # mostly markup
    assert abs(sum(chars for _, chars, _ in chunks) - f.prompt_chars) <= len(chunks)


def test_hf_chunks_equal_whole_text(model_dir: Path) -> None:
    hf = HFTokenizer(str(model_dir), chunk_chars=64)
    assert hf.chunked
    raw = hf._tok
    for seed in range(5):
        messages = [{"role": "system", "content": words(50, seed)},
                    {"role": "user", "content": words(300, seed + 10)}]
        got = ids(hf, features({"messages": messages}))
        # What vLLM runs: the template rendered to text, tokenized without special tokens.
        text = raw.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        want = raw.encode(text, add_special_tokens=False)
        assert got == want
        assert got[0] == raw.bos_token_id  # the template's BOS: the engine hashes it too
    text = words(200, 99)
    f = features({"prompt": text}, "/v1/completions")
    assert ids(hf, f) == raw.encode(text, add_special_tokens=True)
    assert ids(hf, features({"prompt": [5, 6, 7]}, "/v1/completions")) == [5, 6, 7]


def test_hf_memo_repeats_no_work(model_dir: Path) -> None:
    hf = HFTokenizer(str(model_dir), chunk_chars=64)
    f = features({"messages": [{"role": "user", "content": words(400)}]})
    first = ids(hf, f)
    calls = spy(hf)
    assert ids(hf, f) == first and calls == []


def spy(hf: HFTokenizer) -> list[str]:
    """The texts ``hf`` tokenizes from now on."""
    calls: list[str] = []
    encode = hf._encode
    hf._encode = lambda text, special: calls.append(text) or encode(text, special)
    return calls


def test_hf_stops_early_when_the_caller_does(model_dir: Path) -> None:
    hf = HFTokenizer(str(model_dir), chunk_chars=64)
    f = features({"messages": [{"role": "user", "content": words(4000)}]})
    calls = spy(hf)
    first = next(iter(hf.token_chunks(f)))
    assert len(calls) == 1 and len(calls[0]) < 64 and first[2] == len(first[0])  # one piece
    assert not hf._memo  # a chunk is memoised once tokenized to its end
    ids(hf, f)
    assert len(hf._memo) > 1


def test_hf_next_turn_tokenizes_only_what_is_new(model_dir: Path) -> None:
    hf = HFTokenizer(str(model_dir), chunk_chars=64)
    turn = words(1500, 3)
    ids(hf, features({"messages": [{"role": "user", "content": turn}]}))  # the warm-up
    calls = spy(hf)
    more = " and then some more words of the next turn"
    messages = [{"role": "user", "content": turn + more}]
    got = ids(hf, features({"messages": messages}))
    text = hf._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert got == hf._tok.encode(text, add_special_tokens=False)
    # The earlier prompt's last chunk came back longer: only its last quarter-chunk piece and
    # what follows is tokenized again (the new words and the template's closing tokens).
    # (Re-tokenizing that chunk would cost at least 64 characters more than the new text.)
    assert sum(map(len, calls)) < len(more) + 48, calls


def test_unrenderable_and_missing() -> None:
    assert load_tokenizer("sim", 4.0).name == "sim"
    with pytest.raises(FleetError, match="cannot load"):
        HFTokenizer("/nonexistent/model")
    assert list(SimTokenizer(4.0).token_chunks(features({"messages": []}))) == []
    assert SimTokenizer(3.5).ids("").size == 0 and np.all(SimTokenizer(3.5).ids("abcdefg") >= 0)
