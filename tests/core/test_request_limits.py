"""What parsing one request may cost: the fleet's `limits:` bounds, enforced while parsing.

Issue 12, finding 2: a 3.6 MB body of 300k `tools` entries cost the router 2.6 s of its event loop
(every entry serialised on its own, then hashed). Each limit is checked before the per-element
work it bounds, so such a body costs about what decoding its JSON costs.
"""

from __future__ import annotations

import json
import time

import pytest

from gorgo.core.features import DEFAULT_LIMITS, RequestError, extract_features
from gorgo.core.fleet import FleetError, Limits, parse_fleet
from gorgo.core.tokens import Tokenization

CHAT = "/v1/chat/completions"
TOK = Tokenization()


def _error(
    body: dict | bytes, limits: Limits = DEFAULT_LIMITS, path: str = CHAT
) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        extract_features(path, {}, raw, TOK, limits=limits)
    return info.value


def _user(text: str = "hi") -> dict:
    return {"role": "user", "content": text}


def test_default_limits_admit_a_large_ordinary_request() -> None:
    body = {"messages": [_user(f"turn {k} " * 50) for k in range(2000)],
            "tools": [{"type": "function", "function": {"name": f"f{k}", "parameters": {
                "type": "object", "properties": {"x": {"type": "string"}}}}} for k in range(128)],
            "max_tokens": 4096}
    f = extract_features(CHAT, {}, json.dumps(body).encode(), TOK)
    assert f.prompt_chars > 2000 * 50 * 6 and f.max_tokens == 4096


@pytest.mark.parametrize(("body", "param", "limits"), [
    ({"messages": [_user()] * 5}, "messages", Limits(max_messages=4)),
    ({"messages": [_user()], "tools": [{"type": "function"}] * 3}, "tools", Limits(max_tools=2)),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 3}]},
     "messages[0].content", Limits(max_content_parts=2)),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}] * 3}]},
     "messages[0].tool_calls", Limits(max_content_parts=2)),
    ({"input": [_user()] * 5}, "input", Limits(max_messages=4)),
])
def test_arrays_past_their_limit_are_400_array_above_max_length(
    body: dict, param: str, limits: Limits
) -> None:
    path = "/v1/responses" if "input" in body else CHAT
    err = _error(body, limits, path)
    assert (err.status, err.code, err.param) == (400, "array_above_max_length", param)
    assert "maximum length" in err.message
    assert err.to_body()["error"]["type"] == "invalid_request_error"


def test_completions_prompt_list_is_bounded() -> None:
    err = _error({"prompt": ["a"] * 5}, Limits(max_messages=4), "/v1/completions")
    assert (err.status, err.param) == (400, "prompt")


def test_too_many_containers_is_413_before_any_per_element_work() -> None:
    err = _error({"messages": [_user()], "tools": [{}] * 101}, Limits(max_json_containers=100))
    assert (err.status, err.code) == (413, "request_too_large")
    assert "100 JSON objects and arrays" in err.message


def test_prompt_characters_are_bounded_tools_included() -> None:
    limits = Limits(max_prompt_chars=1000)
    extract_features(CHAT, {}, json.dumps({"messages": [_user("x" * 1000)]}).encode(), TOK,
                     limits=limits)
    err = _error({"messages": [_user("x" * 1001)]}, limits)
    assert (err.status, err.code) == (413, "request_too_large")
    tools = [{"description": "y" * 600}] * 2  # short conversation, long tool definitions
    assert _error({"messages": [_user()], "tools": tools}, limits).status == 413


@pytest.mark.parametrize(("name", "path", "base"), [
    ("max_tokens", CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    ("max_completion_tokens", CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    ("max_tokens", "/v1/completions", {"prompt": "hi"}),
    ("max_output_tokens", "/v1/responses", {"input": "hi"}),
])
def test_absurd_max_tokens_is_400(name: str, path: str, base: dict) -> None:
    err = _error({**base, name: 10**30}, path=path)
    assert (err.status, err.code, err.param) == (400, "integer_above_max_value", name)
    limits = Limits(max_output_tokens=100)
    assert _error({**base, name: 101}, limits, path).status == 400
    f = extract_features(path, {}, json.dumps({**base, name: 100}).encode(), TOK, limits=limits)
    assert f.max_tokens == 100


def test_n_is_bounded_and_counts_the_sequences() -> None:
    limits = Limits(max_choices=8)

    def choices(body: dict, path: str = CHAT) -> int:
        raw = json.dumps(body).encode()
        return extract_features(path, {}, raw, TOK, limits=limits).choices

    base = {"messages": [_user()]}
    assert choices(base) == 1
    assert choices({**base, "n": 3}) == 3
    assert choices({"prompt": "hi", "n": 2, "best_of": 5}, "/v1/completions") == 2
    assert choices({"prompt": ["a", "b", "c"], "n": 2}, "/v1/completions") == 6  # per prompt
    assert choices({"input": "hi", "n": 9}, "/v1/responses") == 1  # no `n` in that API
    err = _error({**base, "n": 9}, limits)
    assert (err.status, err.code, err.param) == (400, "integer_above_max_value", "n")
    for bad in (0, -1, 2.5, "2", True):
        err = _error({**base, "n": bad}, limits)
        assert (err.status, err.param) == (400, "n"), bad


def test_an_integer_past_pythons_digit_limit_is_a_client_error() -> None:
    raw = b'{"messages": [], "max_tokens": 1' + b"0" * 5000 + b"}"
    err = _error(raw)
    assert err.status == 400 and "not valid JSON" in err.message


@pytest.mark.slow
def test_the_300k_tools_body_costs_about_what_decoding_it_costs() -> None:
    """The attack of finding 2: refused in a small multiple of the bare json.loads of the same
    bytes (it took 15x that before the limits: every entry serialised, the prompt hashed)."""
    raw = json.dumps({"model": "m", "messages": [_user()],
                      "tools": [{"abc": 1}] * 300_000}).encode()
    assert 3.4e6 < len(raw) < 3.8e6
    # Interleaved, best of five each: a loaded machine slows both alike, not one phase alone.
    timings = [(_timed(lambda: json.loads(raw)), _timed(lambda: _error(raw))) for _ in range(5)]
    decode, refuse = (min(t) for t in zip(*timings, strict=True))
    assert _error(raw).status == 413
    assert refuse < 3 * decode, (refuse, decode)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.parametrize(("limits", "message"), [
    ({"max_tools": 0}, "fleet.limits.max_tools: must be >= 1"),
    ({"max_json_depth": 300}, "fleet.limits.max_json_depth: must be <= 256"),
    ({"max_messages": 1.5}, "fleet.limits.max_messages: expected an integer"),
    ({"max_prompt_chars": "many"}, "fleet.limits.max_prompt_chars: expected a number"),
])
def test_fleet_limits_are_validated(limits: dict, message: str) -> None:
    doc = {"regions": {"a": {}}, "limits": limits,
           "replicas": [{"name": "r", "engine": "sim", "region": "a", "address": "h:1"}]}
    with pytest.raises(FleetError, match=message):
        parse_fleet(doc)


def test_fleet_limits_reach_the_parser() -> None:
    spec = parse_fleet({"regions": {"a": {}}, "limits": {"max_tools": 2},
                        "replicas": [{"name": "r", "engine": "sim", "region": "a",
                                      "address": "h:1"}]})
    assert spec.limits.max_tools == 2
    err = _error({"messages": [_user()], "tools": [{}] * 3}, spec.limits)
    assert err.param == "tools"
