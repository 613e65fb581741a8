"""Fuzzing request parsing: arbitrary bytes and arbitrary JSON never crash it.

Every input either yields features or a RequestError with a 4xx status and an OpenAI-style body;
nothing else may escape, because the ext_proc server answers from exactly these two outcomes.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gorgo.core.features import DEFAULT_LIMITS, MEDIA_PARTS, RequestError, extract_features
from gorgo.core.tokens import Tokenization

TOK = Tokenization()
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/x?y=1")
HEADERS = st.dictionaries(
    st.sampled_from(["x-session-id", "x-gorgo-policy", "x-gorgo-priority", "content-type"]),
    st.text(max_size=20),
    max_size=3,
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=40,
)
# Bodies shaped like real requests, with every field free to be the wrong type.
shaped = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values,
        "stream": json_values,
        "max_tokens": json_values,
        "user": json_values,
        "prompt_cache_key": json_values,
        "messages": st.lists(
            st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values,
                                                "tool_calls": json_values}),
            max_size=4,
        ) | json_values,
        "prompt": json_values,
        "input": json_values,
        "instructions": json_values,
        "tools": json_values,
    },
)


# Content parts whose `type` and media fields are free to be anything: a list as a type once
# raised TypeError (unhashable) and failed the request open.
parts = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from([*sorted(MEDIA_PARTS), "text", "input_text"]) | json_values,
    "text": json_values, "image_url": json_values, "input_audio": json_values,
    "image_embeds": json_values, "file": json_values})
with_parts = st.fixed_dictionaries({"messages": st.lists(
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(parts, max_size=4)}),
    min_size=1, max_size=3)})
MEDIA = Tokenization(chars_per_token=1.0, block_tokens=4, media_tokens=50)

SHALLOW = replace(DEFAULT_LIMITS, max_json_depth=16)


def _check(path: str, headers: dict[str, str], raw: bytes, tok: Tokenization = TOK) -> None:
    try:
        f = extract_features(path, headers, raw, tok, limits=SHALLOW)
    except RequestError as err:
        assert 400 <= err.status < 500
        body = err.to_body()
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        json.dumps(body)
    else:
        assert f.prompt_tokens >= 0 and len(f.block_hashes) <= f.prompt_tokens + 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), HEADERS, st.binary(max_size=300))
def test_arbitrary_bytes(path: str, headers: dict[str, str], raw: bytes) -> None:
    _check(path, headers, raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), HEADERS, json_values)
def test_arbitrary_json(path: str, headers: dict[str, str], value: object) -> None:
    _check(path, headers, json.dumps(value).encode())


@pytest.mark.slow  # about 4 s of generation
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS[:3]), HEADERS, shaped)
def test_request_shaped_json(path: str, headers: dict[str, str], body: dict) -> None:
    _check(path, headers, json.dumps(body).encode())


@pytest.mark.slow  # about 5 s of generation
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["/v1/chat/completions", "/v1/responses"]), with_parts)
def test_content_parts_of_any_shape(path: str, body: dict) -> None:
    if path == "/v1/responses":
        body = {"input": body["messages"]}
    _check(path, {}, json.dumps(body).encode(), MEDIA)


def test_deep_nesting_is_a_400() -> None:
    for depth in (17, 1000, 100_000):
        raw = b'{"messages":' + b"[" * depth + b"]" * depth + b"}"
        _check("/v1/chat/completions", {}, raw)
