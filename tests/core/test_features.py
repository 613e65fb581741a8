"""Request features: prompt order per endpoint, session keys, typed fields and client errors."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from gorgo.core.features import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_DEPTH,
    POLICY_HEADER,
    PRIORITY_BOUNDS,
    PRIORITY_HEADER,
    SESSION_HEADER,
    RequestError,
    RequestFeatures,
    endpoint_for_path,
    extract_features,
    parse_json_body,
    prompt_text,
)
from gorgo.core.fleet import Limits
from gorgo.core.tokens import Tokenization

TOK = Tokenization(chars_per_token=1.0, block_tokens=4)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"


def feats(path: str, body: Any, headers: dict[str, str] | None = None) -> RequestFeatures:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return extract_features(path, headers or {}, raw, TOK)


def error(path: str, body: Any, headers: dict[str, str] | None = None) -> RequestError:
    with pytest.raises(RequestError) as info:
        feats(path, body, headers)
    return info.value


def tool_json(tool: dict) -> str:
    return json.dumps(tool, sort_keys=True, separators=(",", ":"))


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


# --- paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "endpoint"),
    [
        (CHAT, "chat"),
        (COMPLETIONS, "completions"),
        (RESPONSES, "responses"),
        (CHAT + "/", "chat"),
        (CHAT + "?stream=1", "chat"),
        ("/v1/models", None),
        ("/health", None),
        ("/", None),
        ("", None),
        ("/v1/chat/completions/extra", None),
    ],
)
def test_endpoint_for_path(path: str, endpoint: str | None) -> None:
    assert endpoint_for_path(path) == endpoint


def test_non_inference_path_skips_body() -> None:
    f = extract_features(
        "/v1/models",
        {SESSION_HEADER: "s1", POLICY_HEADER: "round-robin", PRIORITY_HEADER: "3"},
        b"this is not json",
        TOK,
    )
    assert f.endpoint is None
    assert f.model is None
    assert f.stream is False
    assert f.max_tokens is None
    assert f.session_key == "s1"
    assert f.prompt_chars == 0 and f.prompt_tokens == 0
    assert f.n_blocks == 0
    assert f.policy == "round-robin"
    assert f.priority == 3


def test_non_inference_path_with_empty_body() -> None:
    f = extract_features("/metrics", {}, b"", TOK)
    assert f.endpoint is None and f.session_key is None and f.policy is None


# --- prompt text per endpoint ---------------------------------------------------------------


def test_chat_full_features() -> None:
    f = feats(CHAT, {
        "model": "llama",
        "stream": True,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "hello there"}],
    })
    assert f.endpoint == "chat"
    assert f.model == "llama"
    assert f.stream is True
    assert f.max_tokens == 32
    assert f.prompt_chars == len("hello there")
    assert f.prompt_tokens == len("hello there")  # one char per token here
    np.testing.assert_array_equal(f.block_hashes, TOK.block_hashes("hello there"))
    assert f.n_blocks == 2


def test_chat_defaults() -> None:
    f = feats(CHAT, {"messages": [{"role": "user", "content": "x"}]})
    assert f.model is None
    assert f.stream is False
    assert f.max_tokens is None
    assert f.session_key is None
    assert f.policy is None and f.priority is None


def test_chat_order_system_tools_conversation() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "U1"},
            {"role": "system", "content": "SYS"},
            {"role": "assistant", "content": "A1"},
            {"role": "developer", "content": "DEV"},
            {"role": "user", "content": "U2"},
        ],
        "tools": [WEATHER],
    }
    text = prompt_text("chat", body)
    assert text == "\n".join(["SYS", "DEV", tool_json(WEATHER), "U1", "A1", "U2"])
    assert feats(CHAT, body).prompt_chars == len(text)


def test_chat_single_message_is_exactly_its_text() -> None:
    assert prompt_text("chat", {"messages": [{"role": "user", "content": "just this"}]}) == (
        "just this"
    )


def test_chat_next_turn_extends_previous_prompt() -> None:
    turn1 = [{"role": "system", "content": "S" * 9}, {"role": "user", "content": "q" * 9}]
    turn2 = [*turn1, {"role": "assistant", "content": "a" * 9}, {"role": "user", "content": "r"}]
    t1 = prompt_text("chat", {"messages": turn1})
    t2 = prompt_text("chat", {"messages": turn2})
    assert t2.startswith(t1)
    h1, h2 = feats(CHAT, {"messages": turn1}).block_hashes, feats(
        CHAT, {"messages": turn2}).block_hashes
    np.testing.assert_array_equal(h2[: len(h1)], h1)


def test_chat_multi_part_keeps_text_and_marks_media() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look at"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        "raw string part",
        {"type": "text", "text": "this"},
        {"type": "refusal", "refusal": "no"},  # neither text nor media: nothing, as before
    ]}]}
    text = prompt_text("chat", body)
    assert re.fullmatch(r"look at\n<image_url [0-9a-f]{16}>\nraw string part\nthis", text)


def _image_turn(*parts: dict, question: str = "what is in this picture? " * 8) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": question}, *parts,
        {"type": "text", "text": "answer in one line, please, and be brief " * 4}]}]}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


MEDIA_TOK = Tokenization(chars_per_token=1.0, block_tokens=4, media_tokens=700)


def _tokens(body: dict, tok: Tokenization = MEDIA_TOK) -> int:
    return extract_features(CHAT, {}, json.dumps(body).encode(), tok).prompt_tokens


@pytest.mark.parametrize("part", [
    _image("http://x/cat.png"),
    {"type": "image_url", "image_url": "http://x/cat.png", "text": ""},  # the type decides
    {"image_url": {"url": "http://x/cat.png"}},  # no type: a media key, as vLLM reads it
    {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
    {"type": "image_embeds", "image_embeds": [0.5] * 1000},
    {"type": "file", "file": {"file_id": "f-1"}},
])
def test_a_media_part_counts_for_the_fleets_media_tokens(part: dict) -> None:
    """An image was priced as nothing: a one-image question read as its few dozen words of
    text, where the engine prefills a thousand tokens more."""
    text_only = _tokens(_image_turn())
    assert _tokens(_image_turn(part)) == text_only + 700 + 1  # the part, and its newline
    assert _tokens(_image_turn(part, part)) == text_only + 2 * (700 + 1)
    items = {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hi"}, {"type": "input_image", "image_url": "http://x"}]}]}
    assert extract_features(RESPONSES, {}, json.dumps(items).encode(), MEDIA_TOK).prompt_tokens \
        == 2 + 1 + 700  # "hi", its newline, the image


@pytest.mark.parametrize("part", [
    {"type": ["image_url"], "image_url": "u"}, {"type": {"a": 1}}, {"type": 5},
    {"type": None, "x": 1}, {"type": "refusal", "refusal": "no"}, {"type": "input_text"}])
def test_a_part_of_no_known_media_type_adds_nothing(part: dict) -> None:
    """A type that is a list or an object raised TypeError (unhashable) in the media check:
    the router failed the request open, past every check of the body."""
    assert _tokens(_image_turn(part)) == _tokens(_image_turn())


def test_with_media_tokens_0_a_media_part_is_only_its_mark() -> None:
    tok = Tokenization(chars_per_token=1.0, block_tokens=4)
    text = prompt_text("chat", _image_turn(_image("http://x/cat.png")))
    mark = re.search(r"<image_url [0-9a-f]{16}>", text)
    assert mark is not None
    assert _tokens(_image_turn(_image("u")), tok) == _tokens(_image_turn(), tok) + len(
        mark.group()) + 1


def test_prompts_that_differ_only_in_their_images_hash_apart() -> None:
    """Two questions asked of two images shared every block, so the second was priced as
    cached where the first had gone; the same image hashes alike."""
    def f(url: str) -> RequestFeatures:
        return extract_features(CHAT, {}, json.dumps(_image_turn(_image(url))).encode(),
                                MEDIA_TOK)
    cat, dog, again = f("http://x/cat.png"), f("http://x/dog.png"), f("http://x/cat.png")
    np.testing.assert_array_equal(again.block_hashes, cat.block_hashes)
    assert cat.prompt_tokens == dog.prompt_tokens
    first = int(np.argmax(cat.block_hashes != dog.block_hashes))
    assert 0 < first < len(cat.block_hashes)  # apart from the image on, alike before it
    np.testing.assert_array_equal(cat.block_hashes[:first], dog.block_hashes[:first])
    assert (cat.block_hashes[first:] != dog.block_hashes[first:]).all()
    assert cat.head_hash != dog.head_hash
    # The image's tokens are blocks of the prompt: most of its 700 tokens are whole blocks.
    assert len(cat.block_hashes) * 4 >= cat.prompt_tokens - 4


def test_media_parts_past_the_prompt_limit_are_refused_before_they_are_built() -> None:
    limits = replace(DEFAULT_LIMITS, max_prompt_chars=5_000)
    body = _image_turn(*[_image(f"http://x/{k}.png") for k in range(8)])  # 8 x 700 chars
    with pytest.raises(RequestError) as info:
        extract_features(CHAT, {}, json.dumps(body).encode(), MEDIA_TOK, limits=limits)
    assert info.value.status == 413


def test_chat_null_content_and_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    body = {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]}
    text = prompt_text("chat", body)
    assert text == "hi\n" + json.dumps(call["function"], sort_keys=True)


def test_chat_non_list_tool_calls_is_a_client_error() -> None:
    err = error(CHAT, {"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]})
    assert err.status == 400


def test_chat_tools_null_is_no_tools() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": None}
    assert prompt_text("chat", body) == "x"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": ["hello"]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": ["ok", 7]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "tools"),
    ],
)
def test_chat_bad_shapes(body: dict, param: str) -> None:
    err = error(CHAT, body)
    assert err.status == 400
    assert err.param == param
    assert err.to_body()["error"]["param"] == param


def test_completions_string_and_lists() -> None:
    assert feats(COMPLETIONS, {"prompt": "abcdefgh"}).prompt_chars == 8
    assert prompt_text("completions", {"prompt": ["ab", "cd"]}) == "ab\ncd"
    assert prompt_text("completions", {"prompt": [1, 22, 333]}) == "1 22 333"
    assert prompt_text("completions", {"prompt": []}) == ""
    f = feats(COMPLETIONS, {"prompt": "p", "max_tokens": 7, "model": "m"})
    assert (f.endpoint, f.max_tokens, f.model) == ("completions", 7, "m")


def test_a_prompt_of_token_ids_counts_its_ids_not_their_digits() -> None:
    # its decimal text once counted 7 "tokens" per six-digit id (at 1 char a token here): a
    # prompt that fits was refused as too large, one that did not was booked at a fraction
    assert feats(COMPLETIONS, {"prompt": [128000] * 50}).prompt_tokens == 50
    assert feats(COMPLETIONS, {"prompt": [1, 2, 3]}).prompt_tokens == 3
    assert feats(COMPLETIONS, {"prompt": "1 2 3"}).prompt_tokens == 5  # text stays text
    a, b = (feats(COMPLETIONS, {"prompt": p}) for p in ([7, 8, 9, 10] * 4, [7, 8, 9, 10] * 5))
    assert a.block_hashes[:2].tolist() == b.block_hashes[:2].tolist()  # same ids, same blocks
    long = json.dumps({"prompt": [1] * 6}).encode()
    with pytest.raises(RequestError) as info:  # bounded before the scan and the join
        extract_features(COMPLETIONS, {}, long, TOK, limits=Limits(max_prompt_chars=10))
    assert info.value.status == 413


def test_a_prompt_of_token_ids_is_hashed_in_blocks_of_ids() -> None:
    """Blocks of ids, as the engine pages them: blocks of their decimal text held 8-11 six-digit
    ids at 4 characters a token, so 2,000 ids made 48 blocks where 31 of 64 exist, and half of
    a shared prefix of 1,000 ids was priced uncached."""
    tok = Tokenization(chars_per_token=4.0, block_tokens=64)
    rng = np.random.default_rng(1)
    shared = rng.integers(100_000, 128_000, 1000).tolist()
    a, b = ([*shared, *rng.integers(100_000, 128_000, 1000).tolist()] for _ in range(2))
    fa, fb = (extract_features(COMPLETIONS, {}, json.dumps({"prompt": p}).encode(), tok)
              for p in (a, b))
    assert len(fa.block_hashes) == 2000 // 64 == fa.prompt_tokens // 64
    common = int(np.argmin(fa.block_hashes == fb.block_hashes))
    assert common == 1000 // 64  # the shared ids' whole blocks, no more, no less
    batch = extract_features(COMPLETIONS, {}, json.dumps({"prompt": [a[:100], a[100:]]}).encode(),
                             tok)
    assert batch.block_hashes.tolist() == fa.block_hashes.tolist()
    with pytest.raises(RequestError) as info:
        feats(COMPLETIONS, {"prompt": [1, 2**64]})
    assert (info.value.status, info.value.param) == (400, "prompt")


def test_a_batch_of_token_id_prompts_is_routed_prompt_by_prompt() -> None:
    """Both engines serve a batch of token-id lists (RL frameworks send them): a 400 before."""
    f = feats(COMPLETIONS, {"prompt": [[1, 2, 3], [4] * 10], "n": 3, "max_tokens": 5})
    assert (f.prompt_tokens, f.longest_prompt_tokens, f.prompts, f.choices) == (13, 10, 2, 6)
    with pytest.raises(RequestError) as info:  # bounded before the scan, as one id prompt
        extract_features(COMPLETIONS, {}, json.dumps({"prompt": [[1] * 4, [2] * 4]}).encode(),
                         TOK, limits=Limits(max_prompt_chars=10))
    assert info.value.status == 413


@pytest.mark.parametrize(
    "body", [{}, {"prompt": 5}, {"prompt": ["a", 1]}, {"prompt": [[1, 2], "a"]},
             {"prompt": [[1, -2]]}, {"prompt": [[1], [True]]}, {"prompt": None},
             {"prompt": [1, True]}, {"prompt": [True]}, {"prompt": [1, -2]}, {"prompt": [1, 2.5]}]
)
def test_completions_bad_prompt(body: dict) -> None:
    err = error(COMPLETIONS, body)
    assert (err.status, err.param) == (400, "prompt")


def test_responses_string_input_with_instructions_and_tools() -> None:
    body = {"instructions": "BE BRIEF", "input": "question", "tools": [WEATHER]}
    assert prompt_text("responses", body) == "\n".join(["BE BRIEF", tool_json(WEATHER), "question"])
    f = feats(RESPONSES, {**body, "max_output_tokens": 9})
    assert f.endpoint == "responses"
    assert f.max_tokens == 9


def test_responses_message_list_input() -> None:
    body = {
        "instructions": "INS",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                         {"type": "input_image", "image_url": "http://x/y.png"}]},
            {"role": "developer", "content": "DEV"},
            {"role": "assistant", "content": "hello"},
        ],
    }
    assert re.fullmatch(r"INS\nDEV\nhi\n<input_image [0-9a-f]{16}>\nhello",
                        prompt_text("responses", body))


def test_responses_function_calls_and_their_outputs_count() -> None:
    """A tool's output fed back as a Responses item is prompt too: it was priced as nothing (a
    5,000-character output, one token)."""
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get", "arguments": '{"q": 1}'},
             {"type": "function_call_output", "call_id": "c1", "output": "y" * 5000},
             {"type": "custom_tool_call", "call_id": "c2", "name": "sh", "input": "z" * 300},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "w" * 2000}]}]
    f = feats(RESPONSES, {"input": items})
    assert f.prompt_chars >= 5000 + len('{"q": 1}') + 300 + 2000
    shot = {"type": "computer_call_output", "call_id": "c3",
            "output": {"type": "computer_screenshot", "image_url": "data:x"}}
    assert feats(RESPONSES, {"input": [*items, shot]}).prompt_chars == f.prompt_chars + 1  # "\n"


def test_responses_empty_instructions_not_rendered() -> None:
    assert prompt_text("responses", {"instructions": "", "input": "q"}) == "q"
    assert prompt_text("responses", {"instructions": None, "input": "q"}) == "q"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": "q", "instructions": 3}, "instructions"),
        ({"input": [{"role": "user", "content": 1}]}, "input[0].content"),
    ],
)
def test_responses_bad_shapes(body: dict, param: str) -> None:
    err = error(RESPONSES, body)
    assert (err.status, err.param) == (400, param)


def test_prompt_text_unknown_endpoint() -> None:
    with pytest.raises(ValueError, match="unknown endpoint"):
        prompt_text("embeddings", {"input": "x"})


# --- session, policy and priority ------------------------------------------------------------


def test_session_key_precedence() -> None:
    msgs = [{"role": "user", "content": "x"}]
    full = {"messages": msgs, "prompt_cache_key": "pck", "user": "u"}
    assert feats(CHAT, full, {SESSION_HEADER: "hdr"}).session_key == "hdr"
    assert feats(CHAT, full).session_key == "pck"
    assert feats(CHAT, {"messages": msgs, "user": "u"}).session_key == "u"
    assert feats(CHAT, {"messages": msgs}).session_key is None


def test_session_key_skips_empty_and_non_string_values() -> None:
    msgs = [{"role": "user", "content": "x"}]
    body = {"messages": msgs, "prompt_cache_key": "", "user": "u"}
    assert feats(CHAT, body, {SESSION_HEADER: ""}).session_key == "u"
    assert feats(CHAT, {"messages": msgs, "prompt_cache_key": 5, "user": "u"}).session_key == "u"
    assert feats(CHAT, {"messages": msgs, "user": None}).session_key is None


def test_policy_and_priority_headers() -> None:
    body = {"prompt": "x"}
    f = feats(COMPLETIONS, body, {POLICY_HEADER: "least-request", PRIORITY_HEADER: "2"})
    assert f.policy == "least-request"
    assert f.priority == 2
    assert feats(COMPLETIONS, body, {POLICY_HEADER: ""}).policy is None
    err = error(COMPLETIONS, body, {PRIORITY_HEADER: "high"})
    assert err.status == 400
    assert PRIORITY_HEADER in err.message


@pytest.mark.parametrize("raw", ["-2", "101", "1" + "0" * 400, "9" * 5000, "", " 3", "3.0",
                                 "1_0", "\u0663", "0x10"])
def test_priority_outside_its_bounds_is_a_400(raw: str) -> None:
    """A priority of 10**400 overflowed the shedding limit's float arithmetic (issue 12, finding
    4): only plain digits inside PRIORITY_BOUNDS are a priority."""
    err = error(COMPLETIONS, {"prompt": "x"}, {PRIORITY_HEADER: raw})
    assert (err.status, err.param, err.code) == (400, PRIORITY_HEADER, "invalid_priority")
    assert f"[{PRIORITY_BOUNDS[0]}, {PRIORITY_BOUNDS[1]}]" in err.message
    for value in PRIORITY_BOUNDS:
        assert feats(COMPLETIONS, {"prompt": "x"}, {PRIORITY_HEADER: str(value)}).priority == value


def test_an_unknown_policy_is_a_400_where_the_names_are_known() -> None:
    known = ("gorgo", "round-robin")
    raw = b'{"prompt": "x"}'
    f = extract_features(COMPLETIONS, {POLICY_HEADER: "round-robin"}, raw, TOK, policies=known)
    assert f.policy == "round-robin"
    with pytest.raises(RequestError) as info:
        extract_features(COMPLETIONS, {POLICY_HEADER: "x" * 5000}, raw, TOK, policies=known)
    err = info.value
    assert (err.status, err.param, err.code) == (400, POLICY_HEADER, "unknown_policy")
    assert "round-robin" in err.message and len(err.message) < 300  # the name is cut short
    # Without the router's names (the offline driver), the header is taken as it is.
    assert feats(COMPLETIONS, {"prompt": "x"}, {POLICY_HEADER: "nope"}).policy == "nope"


# --- typed fields ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"model": 5}, "model"),
        ({"model": ["a"]}, "model"),
        ({"stream": "true"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_completion_tokens": "x"}, "max_completion_tokens"),
        ({"max_output_tokens": 2.0}, "max_output_tokens"),
    ],
)
def test_type_errors_name_the_param(extra: dict, param: str) -> None:
    path, body = {"max_completion_tokens": (CHAT, {"messages": []}),
                  "max_output_tokens": (RESPONSES, {"input": "x"})}.get(
        param, (COMPLETIONS, {"prompt": "x"}))
    err = error(path, {**body, **extra})
    assert err.status == 400
    assert err.param == param
    assert param in err.message
    body = err.to_body()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param
    assert body["error"]["message"] == err.message


def test_max_tokens_aliases_and_precedence() -> None:
    """Each API's own output bound: chat takes max_completion_tokens over the deprecated
    max_tokens (as vLLM does: the reverse refused requests the engine serves), and a field of
    another API is not read (max_output_tokens on chat was a false 400 when large)."""
    assert feats(CHAT, {"messages": [], "max_completion_tokens": 11}).max_tokens == 11
    assert feats(CHAT, {"messages": [], "max_tokens": 5, "max_completion_tokens": 11}
                 ).max_tokens == 11
    assert feats(CHAT, {"messages": [], "max_tokens": 10**9, "max_completion_tokens": 11}
                 ).max_tokens == 11
    assert feats(CHAT, {"messages": [], "max_tokens": None, "max_completion_tokens": 11}
                 ).max_tokens == 11
    assert feats(CHAT, {"messages": [], "max_output_tokens": 10**9}).max_tokens is None
    assert feats(COMPLETIONS, {"prompt": "x", "max_completion_tokens": 10**9}).max_tokens == 16
    assert feats(RESPONSES, {"input": "x", "max_tokens": 10**9}).max_tokens is None
    assert feats(RESPONSES, {"input": "x", "max_output_tokens": 7}).max_tokens == 7


def test_completions_default_to_sixteen_tokens_and_echo_may_generate_none() -> None:
    """Without max_tokens a completion stops at 16 tokens (the API's default, the engines');
    `echo` with max_tokens 0 asks for the prompt's logprobs only (evaluation harnesses), a false
    400 before."""
    assert feats(COMPLETIONS, {"prompt": "x"}).max_tokens == 16
    assert feats(COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": 0}).max_tokens == 0
    assert error(COMPLETIONS, {"prompt": "x", "max_tokens": 0}).param == "max_tokens"
    assert error(COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": -1}).param == (
        "max_tokens")


def test_model_null_is_no_model() -> None:
    assert feats(COMPLETIONS, {"prompt": "x", "model": None}).model is None


def test_a_model_no_protobuf_can_carry_is_a_400() -> None:
    # JSON's escape of a lone surrogate decodes; encoding the decision's metadata then raised
    # after the request was booked, and the stream died without a counted fail-open
    err = error(CHAT, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}')
    assert (err.status, err.param) == (400, "model")
    assert feats(CHAT, {"model": "llama-3 \u00e9\u4e2d", "messages": []}).model == "llama-3 é中"


def test_stream_null_means_not_streaming() -> None:
    assert feats(COMPLETIONS, {"prompt": "x", "stream": None}).stream is False


# --- body decoding --------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"{", b"not json", b'{"a": }', b"\xff\xfe\x00{", b"{'a': 1}"])
def test_malformed_json(raw: bytes) -> None:
    err = error(CHAT, raw)
    assert err.status == 400
    assert "not valid JSON" in err.message


@pytest.mark.parametrize("raw", [b"[]", b"[1, 2]", b'"text"', b"42", b"null", b"true"])
def test_non_object_json(raw: bytes) -> None:
    err = error(CHAT, raw)
    assert err.status == 400
    assert "JSON object" in err.message


def test_empty_body() -> None:
    err = error(CHAT, b"")
    assert err.status == 400
    assert "empty" in err.message


def _nested(depth: int) -> bytes:
    """A JSON object ``depth`` containers deep (the outer object counts as 1)."""
    return ('{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)).encode()


def test_depth_limit_boundary() -> None:
    assert parse_json_body(_nested(DEFAULT_MAX_DEPTH)) is not None
    with pytest.raises(RequestError, match="deeper than 64"):
        parse_json_body(_nested(DEFAULT_MAX_DEPTH + 1))
    assert parse_json_body(_nested(5), max_depth=5)
    with pytest.raises(RequestError) as info:
        parse_json_body(_nested(6), max_depth=5)
    assert info.value.status == 400


def test_depth_counts_lists() -> None:
    raw = b'{"messages": [[[[1]]]]}'  # object, then 4 lists: depth 5
    assert parse_json_body(raw, max_depth=5)
    with pytest.raises(RequestError):
        parse_json_body(raw, max_depth=4)


def test_many_brackets_in_strings_are_not_depth() -> None:
    raw = json.dumps({"prompt": "{[" * 200}).encode()
    assert parse_json_body(raw, max_depth=3)["prompt"].startswith("{[")


def test_pathologically_deep_json_is_a_client_error() -> None:
    err = error(CHAT, b"[" * 100_000 + b"]" * 100_000)
    assert err.status == 400
    assert "deeper" in err.message


def test_extract_features_passes_max_depth() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    # object > messages list > message > content list > part: depth 5.
    five, four = (replace(DEFAULT_LIMITS, max_json_depth=d) for d in (5, 4))
    assert extract_features(CHAT, {}, raw.encode(), TOK, limits=five).prompt_chars == 1
    with pytest.raises(RequestError):
        extract_features(CHAT, {}, raw.encode(), TOK, limits=four)


def test_features_compare_by_identity() -> None:
    a = feats(COMPLETIONS, {"prompt": "same"})
    b = feats(COMPLETIONS, {"prompt": "same"})
    assert a != b
    assert len({a, b}) == 2


def test_request_error_defaults() -> None:
    err = RequestError(413, "too big")
    assert str(err) == "too big"
    assert err.to_body() == {
        "error": {"message": "too big", "type": "invalid_request_error", "param": None,
                  "code": None}
    }
