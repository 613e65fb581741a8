"""Trace sources: exact prompt lengths, prefix sharing from keys, spec parsing, chat statistics."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from gorgo.core.tokens import Tokenization
from gorgo.sim import traces
from gorgo.sim.traces import (
    DESCRIPTION,
    TraceRequest,
    azure_trace,
    chat_trace,
    load_trace,
    mooncake_trace,
    parse_spec,
    reuse_stats,
    traces_dir,
)

TOK = Tokenization()


def _common_blocks(a: str, b: str, tok: Tokenization) -> int:
    ha, hb = tok.block_hashes(a), tok.block_hashes(b)
    n = 0
    while n < min(len(ha), len(hb)) and ha[n] == hb[n]:
        n += 1
    return n


@pytest.mark.parametrize("cpt", [4.0, 3.7, 1.0, 2.5])
def test_prompt_has_exact_token_count(cpt: float) -> None:
    tok = Tokenization(chars_per_token=cpt)
    for tokens in [0, 1, 2, 3, 63, 64, 65, 511, 512, 513, 5000]:
        parts = (("sys", min(tokens, 700)), ("tail", max(0, tokens - 700)))
        req = TraceRequest(0, 0.0, tokens, 10, parts=parts)
        assert tok.count_tokens(len(req.prompt(tok))) == tokens
    # Parts that do not add up are cut or padded to the declared length.
    for declared in (100, 1000):
        req = TraceRequest(3, 0.0, declared, 1, parts=(("x", 400),))
        assert tok.count_tokens(len(req.prompt(tok))) == declared
    assert tok.count_tokens(len(TraceRequest(9, 0.0, 77, 1).prompt(tok))) == 77


@pytest.mark.parametrize("cpt", [4.0, 3.7])
def test_shared_leading_parts_share_a_text_prefix(cpt: float) -> None:
    tok = Tokenization(chars_per_token=cpt)
    a = TraceRequest(0, 0.0, 1200, 1, parts=(("s", 512), ("a", 512), ("x", 176)))
    b = TraceRequest(1, 0.0, 1100, 1, parts=(("s", 512), ("a", 512), ("y", 76)))
    c = TraceRequest(2, 0.0, 1024, 1, parts=(("s", 512), ("b", 512)))
    pa, pb, pc = a.prompt(tok), b.prompt(tok), c.prompt(tok)
    shared = traces.chars_for_tokens(tok, 1024)
    assert pa[:shared] == pb[:shared]
    assert pa[shared : shared + 8] != pb[shared : shared + 8]
    # Different keys diverge within the first router block after the shared part.
    first = traces.chars_for_tokens(tok, 512)
    assert pa[:first] == pc[:first]
    assert pa[first : first + tok.block_chars] != pc[first : first + tok.block_chars]
    # Same request, same text, every time.
    assert a.prompt(tok) == pa
    assert pa.isascii()


def test_chat_body_holds_the_prompt_in_one_user_message() -> None:
    req = TraceRequest(4, 1.5, 300, 42, session="user-7", parts=(("k", 300),))
    body = req.chat_body(TOK, "m1")
    assert body["model"] == "m1"
    assert body["messages"] == [{"role": "user", "content": req.prompt(TOK)}]
    assert body["max_tokens"] == 42
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["user"] == "user-7"
    plain = TraceRequest(5, 0.0, 10, 1).chat_body(TOK, "m", stream=False)
    assert "stream_options" not in plain and "user" not in plain
    comp = req.completion_body(TOK, "m1")
    assert comp["prompt"] == req.prompt(TOK) and comp["max_tokens"] == 42
    json.dumps(body)


def test_mooncake_hash_ids_map_to_shared_blocks(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 1300, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [0, 4]},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reqs = mooncake_trace(path)
    assert [r.arrival_s for r in reqs] == [0.0, 1.5, 3.0]
    assert [r.output_tokens for r in reqs] == [5, 6, 7]
    assert all(r.session is None for r in reqs)
    assert reqs[0].parts == (("mc0", 512), ("mc1", 512), ("mc2", 276))
    p = [r.prompt(TOK) for r in reqs]
    assert [TOK.count_tokens(len(x)) for x in p] == [1300, 1100, 600]
    per_block = 512 // TOK.block_tokens
    assert _common_blocks(p[0], p[1], TOK) == 2 * per_block
    assert _common_blocks(p[0], p[2], TOK) == per_block
    assert len(load_trace(f"mooncake:{path}")) == 3
    assert len(load_trace(f"mooncake:path={path},limit=2")) == 2


def test_real_mooncake_slice_reuses_prefixes_as_the_trace_says() -> None:
    reqs = mooncake_trace(limit=400)
    assert len(reqs) == 400
    assert reqs[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    per_block = 512 // TOK.block_tokens
    seen_ids: set[str] = set()
    seen_hashes: set[int] = set()
    for r in reqs[:150]:
        text = r.prompt(TOK)
        assert TOK.count_tokens(len(text)) == r.input_tokens
        hashes = TOK.block_hashes(text)
        # A leading run of known hash ids is exactly a leading run of known router blocks.
        known = 0
        for key, tokens in r.parts:
            if key not in seen_ids or tokens != 512:
                break
            known += 1
        cached = 0
        while cached < len(hashes) and int(hashes[cached]) in seen_hashes:
            cached += 1
        assert cached == known * per_block
        seen_ids.update(k for k, t in r.parts if t == 512)
        seen_hashes.update(int(h) for h in hashes)


def test_azure_slice_has_times_lengths_and_only_the_system_prefix_shared() -> None:
    reqs = azure_trace(limit=200)
    assert len(reqs) == 200
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(4.3145789, abs=1e-5)
    assert (reqs[0].input_tokens, reqs[0].output_tokens) == (374, 44)
    texts = [r.prompt(TOK) for r in reqs]
    assert all(TOK.count_tokens(len(t)) == r.input_tokens for t, r in zip(texts, reqs, strict=True))
    long = [t for t, r in zip(texts, reqs, strict=True) if r.input_tokens >= 1024]
    shared = traces.chars_for_tokens(TOK, traces.AZURE_SYSTEM_TOKENS)
    assert len({t[:shared] for t in long}) == 1
    assert len({t[shared : shared + TOK.block_chars] for t in long}) == len(long)
    assert "ASSUMPTION" in DESCRIPTION["azure"]


@pytest.mark.parametrize(("kind", "rows", "error"), [
    ("azure", ["2023-11-16 18:15:46.0,374,44", "2023-11-16 18:15:36.0,300,9"],
     "record 2 arrives 10 s before record 1; sort the file"),
    ("azure", ["2023-11-16 18:15:46.0,0,44"], "record 1 has 0 prompt and 44 output tokens"),
    ("azure", ["2023-11-16 18:15:46.0,374,0"], "record 1 has 374 prompt and 0 output tokens"),
    ("mooncake", [{"timestamp": 5000, "input_length": 10, "output_length": 5, "hash_ids": [0]},
                  {"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1]}],
     "record 2 arrives 5 s before record 1"),
    ("mooncake", [{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}],
     "record 1 has 0 prompt"),
])
def test_a_trace_out_of_time_order_or_with_an_empty_request_is_refused(
        tmp_path: Path, kind: str, rows: list, error: str) -> None:
    # Out of order, arrivals went negative and the mean rate (so the load) was off 3x; an empty
    # prompt or output died later with a traceback.
    path = tmp_path / "t"
    if kind == "azure":
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(traces.TraceError, match=error):
        load_trace(f"{kind}:{path}")


def test_azure_parses_csv_and_system_size_option(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:48.1805900,2000,9\n"
    )
    reqs = load_trace(f"azure:path={path},system_tokens=100")
    assert [r.arrival_s for r in reqs] == [0.0, pytest.approx(1.5)]
    assert reqs[1].parts[0] == ("az-system", 100)
    assert reqs[0].parts[0] == ("az-system", 100)
    assert azure_trace(path)[0].parts[0] == ("az-system", 187)  # at most half the prompt


def test_chat_generator_matches_art_chat_statistics() -> None:
    reqs = chat_trace(seed=11, users=600, rate=20.0)
    stats = reuse_stats(reqs, TOK)
    assert stats["sessions"] == 600
    assert stats["requests_per_session"] == pytest.approx(13.0, rel=0.1)
    assert stats["continuation_fraction"] == pytest.approx(0.74, abs=0.03)
    assert stats["session_reuse_fraction"] == pytest.approx(0.89, abs=0.03)
    # Contexts grow along a conversation and every prompt is exact.
    by_user: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_user.setdefault(r.session or "", []).append(r)
    longest = max(max(r.input_tokens for r in rs) for rs in by_user.values())
    assert longest > 3 * stats["mean_input_tokens"] / 2
    for r in reqs[:300]:
        assert TOK.count_tokens(len(r.prompt(TOK))) == r.input_tokens
    # Poisson arrivals at the configured rate.
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    assert len(reqs) / span == pytest.approx(20.0, rel=0.05)
    assert [r.index for r in reqs] == list(range(len(reqs)))


def test_chat_generator_is_seeded_and_configurable() -> None:
    a = load_trace("chat:seed=5,users=30,rate=4,limit=50")
    b = chat_trace(seed=5, users=30, rate=4.0, limit=50)
    assert a == b and len(a) == 50
    c = chat_trace(seed=6, users=30, rate=4.0, limit=50)
    assert a != c
    assert a[3].prompt(TOK) != c[3].prompt(TOK)
    single = chat_trace(seed=1, users=50, multi_turn=0.0, reuse=0.0, limit=300)
    stats = reuse_stats(single, TOK)
    assert stats["continuation_fraction"] == 0.0
    assert stats["session_reuse_fraction"] == 0.0
    with pytest.raises(ValueError):
        chat_trace(multi_turn=0.99)


def test_spec_parsing() -> None:
    assert parse_spec("mooncake") == ("mooncake", {})
    assert parse_spec("mooncake:/x/y.jsonl") == ("mooncake", {"path": "/x/y.jsonl"})
    assert parse_spec("azure:path=a.csv,limit=10") == ("azure", {"path": "a.csv", "limit": 10})
    assert parse_spec("chat:seed=3,users=9,rate=1.5") == (
        "chat",
        {"seed": 3, "users": 9, "rate": 1.5},
    )
    for bad in ("sharegpt", "chat:users", "chat:colour=red", "azure:limit=x", "mooncake:seed=1"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    assert set(DESCRIPTION) == set(traces.SOURCES)


def test_traces_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(traces.TRACES_ENV, raising=False)
    repo = Path(__file__).resolve().parents[2]
    assert traces_dir() == repo / "data" / "traces"
    monkeypatch.setenv(traces.TRACES_ENV, os.fspath(tmp_path))
    assert traces_dir() == tmp_path
    assert traces_dir("/elsewhere") == Path("/elsewhere")
    (tmp_path / "mooncake").mkdir()
    (tmp_path / traces.MOONCAKE_FILE).write_text(
        json.dumps({"timestamp": 7, "input_length": 3, "output_length": 1, "hash_ids": [9]}) + "\n"
    )
    assert load_trace("mooncake")[0].arrival_s == pytest.approx(0.007)


def test_a_missing_trace_file_is_a_one_line_error_naming_the_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(traces.TRACES_ENV, os.fspath(tmp_path))
    for spec, file in (("mooncake", traces.MOONCAKE_FILE), ("azure", traces.AZURE_FILE)):
        with pytest.raises(traces.TraceNotFound) as info:
            load_trace(spec)
        message = str(info.value)
        assert "\n" not in message
        assert os.fspath(tmp_path / file) in message
    # An explicit path that is not there says so too, and it is a ValueError like any bad spec.
    with pytest.raises(ValueError, match=r"nope\.jsonl"):
        load_trace(f"mooncake:{tmp_path / 'nope.jsonl'}")
