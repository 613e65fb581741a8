"""What the router needs to know about one OpenAI-style request: path, headers and body.

The prompt is serialised in the order an engine's chat template renders it: system (and
developer) messages first, then tool definitions (chat templates of Qwen, Hermes and Llama 3.1
render tools inside the system turn, before the conversation), then the conversation. Pieces are
joined with a newline and carry no role markers, so a single-message prompt is exactly its text and
turn N+1 of a conversation extends turn N's text: that is what makes prefix reuse visible.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gorgo.core.contract import (
    POLICY_HEADER,
    PRIORITY_BOUNDS,
    PRIORITY_HEADER,
    SESSION_HEADER,
    SLO_BOUNDS_MS,
    SLO_TPOT_HEADER,
    SLO_TTFT_HEADER,
)
from gorgo.core.decimals import whole_number
from gorgo.core.fleet import Limits
from gorgo.core.tokens import Tokenization

ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}
# The field that bounds the output, per endpoint, the first present counting (chat: vLLM and
# OpenAI take max_completion_tokens over the deprecated max_tokens).
OUTPUT_FIELDS = {"chat": ("max_completion_tokens", "max_tokens"), "completions": ("max_tokens",),
                 "responses": ("max_output_tokens",)}
COMPLETIONS_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's, vLLM's, SGLang's)
DEFAULT_LIMITS = Limits()
DEFAULT_MAX_DEPTH = DEFAULT_LIMITS.max_json_depth
AFFINITY_HEAD_TOKENS = 256
MAX_TOKEN_ID = 2**64  # token ids are hashed as 64-bit values (`Tokenization.id_block_hashes`)


class RequestError(Exception):
    """A client error with the HTTP status and OpenAI-style body the caller should answer with."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True, slots=True, eq=False)
class RequestFeatures:
    """Routing inputs of one request; ``endpoint`` is None for non-inference paths.

    Compared by identity: per-request memos key on the object itself.
    """

    endpoint: str | None
    model: str | None
    stream: bool
    max_tokens: int | None
    session_key: str | None
    prompt_chars: int
    prompt_tokens: int
    block_hashes: np.ndarray
    policy: str | None = None
    priority: int | None = None
    slo_ttft_ms: float | None = None  # the request's own targets (trusted headers), if any
    slo_tpot_ms: float | None = None
    head_hash: int = 0  # 64-bit hash of the first AFFINITY_HEAD_TOKENS tokens' text
    # Sequences the engine decodes for it: `n` for each prompt of the request (a completions
    # batch has ``prompts``), each with its own output in the batch; a prompt is prefilled once.
    choices: int = 1
    prompts: int = 1
    # A completions batch's longest prompt, in tokens (None: one prompt): what one of its
    # sequences needs on the KV pool besides its output (an engine schedules a batch's
    # sequences as its pool frees, one by one).
    longest_prompt_tokens: int | None = None
    # The parsed body, for a precise cache view that tokenizes it as the engine does
    # (gorgo.core.precise); None for non-inference paths.
    body: Mapping[str, Any] | None = None


    @property
    def sequence_prompt_tokens(self) -> int:
        """The prompt one sequence of the request needs on the KV pool."""
        longest = self.longest_prompt_tokens
        return self.prompt_tokens if longest is None else longest

    @property
    def context_tokens(self) -> int:
        """Prompt tokens its sequences attend over between them: each prompt's, `n` times."""
        return self.choices // self.prompts * self.prompt_tokens

    @property
    def n_blocks(self) -> int:
        return len(self.block_hashes)


EMPTY_HASHES = np.empty(0, dtype=np.uint64)


def endpoint_for_path(path: str) -> str | None:
    """The inference endpoint a request path names, ignoring the query string."""
    return ENDPOINTS.get(path.split("?", 1)[0].rstrip("/") or "/")


def parse_json_body(
    raw: bytes, max_depth: int = DEFAULT_MAX_DEPTH,
    max_containers: int = DEFAULT_LIMITS.max_json_containers,
) -> dict[str, Any]:
    """Decode a JSON object body, refusing bad encodings, nesting deeper than ``max_depth`` and
    more than ``max_containers`` objects and arrays (what every later per-element step costs)."""
    if not raw:
        raise RequestError(400, "Request body is empty; expected a JSON object.")
    try:
        body = json.loads(raw)
    except ValueError as exc:  # bad JSON or UTF-8, or an integer past Python's 4300 digits
        raise RequestError(400, f"Request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise RequestError(400, f"JSON nesting deeper than {max_depth} levels.") from None
    if not isinstance(body, dict):
        raise RequestError(400, "Request body must be a JSON object.")
    # Cheap bound first: neither depth nor containers can exceed the number of opening brackets.
    if raw.count(b"{") + raw.count(b"[") > min(max_depth, max_containers):
        _check_shape(body, max_depth, max_containers)
    return body


def _check_shape(obj: Any, max_depth: int, max_containers: int) -> None:
    """Walk the containers, stopping at the first one past either bound: the walk itself costs at
    most ``max_containers`` steps, however many elements the body holds."""
    seen = 1
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if d > max_depth:
            raise RequestError(400, f"JSON nesting deeper than {max_depth} levels.")
        for v in node.values() if isinstance(node, dict) else node:
            if isinstance(v, dict | list):
                seen += 1
                if seen > max_containers:
                    raise RequestError(
                        413, f"Request body has more than {max_containers} JSON objects and "
                             "arrays.", code="request_too_large")
                stack.append((v, d + 1))


def _bounded(items: list[Any], limit: int, param: str) -> list[Any]:
    """``items`` when at most ``limit`` long, else the OpenAI-style array-length error."""
    if len(items) > limit:
        raise RequestError(
            400, f"Invalid '{param}': array too long. Expected an array with maximum length "
                 f"{limit}, but got an array with length {len(items)} instead.",
            param=param, code="array_above_max_length")
    return items


# Content parts that carry media, not text (OpenAI's chat and Responses parts, and vLLM's own),
# by their type; a part with no type is media when it holds one of ``MEDIA_KEYS``, as vLLM reads
# it. Each stands in the prompt as a mark naming its content (`_Media.mark`). Any other part
# without text adds nothing.
MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "image_embeds", "image_pil",
                         "input_audio", "audio_url", "audio", "audio_embeds", "video_url",
                         "video", "file", "input_file"})
MEDIA_KEYS = ("image_url", "audio_url", "video_url", "image_embeds", "input_audio",
              "audio_embeds")


def _media_kind(part: dict[str, Any]) -> str | None:
    """The media type of a content part, None for text or anything else."""
    kind = part.get("type")
    if kind is None:
        return next((k for k in MEDIA_KEYS if k in part), None)
    return kind if isinstance(kind, str) and kind in MEDIA_PARTS else None


class _Media:
    """How media parts stand in one prompt's text. A part is a mark naming its content, padded
    to ``chars`` characters (the fleet's `media_tokens` at its characters per token), so it
    counts for its tokens and its blocks hash with the text around it: two questions about
    different images hash apart from the first image on (an image once added nothing, so the
    second was priced as cached where the first had gone), and the same image, sent again in a
    conversation, is a cached prefix like its text. At most ``most`` characters of marks (the
    prompt limit), checked before they are built."""

    def __init__(self, chars: int, most: int) -> None:
        self.chars = chars
        self.most = most
        self.size = 0  # characters of the marks so far

    def mark(self, part: dict[str, Any], kind: str) -> str:
        digest = _media_digest(part)
        mark = f"<{kind} {digest}>"
        size = max(len(mark), self.chars)
        self.size += size
        if self.size > self.most:
            raise RequestError(
                413, f"The prompt's media parts stand for more than {self.most} characters, the "
                     "limit of a prompt.", code="request_too_large")
        return mark if size == len(mark) else (mark + digest * (size // len(digest)))[:size]


def _media_digest(part: dict[str, Any]) -> str:
    """16 hex digits of a media part's content: its string fields and those of its objects, one
    level down (the URL or data of an image, an audio clip's data and format, a file's data or
    id), in key order; a list (embeddings) by its length only. Each string is hashed as its
    bytes: the part's `ascii` text once cost 2-3x the parse of the whole body (8 MB of floats:
    1.1 s)."""
    h = hashlib.blake2b(digest_size=8)
    for name, value in _media_fields(part):
        if isinstance(value, str):
            h.update(f"{name}={len(value)}:".encode())
            h.update(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, list):
            h.update(f"{name}=[{len(value)}]".encode())
    return h.hexdigest()


def _media_fields(part: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, value) of a part's fields in key order, an object's fields in its place one level
    down (``image_url.url``)."""
    for key in sorted(part):
        value = part[key]
        if isinstance(value, dict):
            for k in sorted(value):
                yield f"{key}.{k}", value[k]
        else:
            yield key, value


def _content_text(content: Any, param: str, max_parts: int, media: _Media) -> str:
    """Text of a message's content: a string, or a multi-part list's text parts, each media part
    as its mark."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(_bounded(content, max_parts, param)):
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                kind = _media_kind(part)
                if kind is not None:
                    parts.append(media.mark(part, kind))
                elif isinstance(part.get("text"), str):
                    parts.append(part["text"])
            else:
                raise RequestError(400, f"Invalid content part at {param}[{i}].", param=param)
        return "\n".join(parts)
    raise RequestError(400, f"'{param}' must be a string or a list of parts.", param=param)


def _messages_text(messages: Any, param: str, limits: Limits,
                   media: _Media) -> tuple[list[str], list[str]]:
    """(system texts, conversation texts) of a message list."""
    if not isinstance(messages, list):
        raise RequestError(400, f"'{param}' must be a list of messages.", param=param)
    system: list[str] = []
    rest: list[str] = []
    parts = limits.max_content_parts
    for i, msg in enumerate(_bounded(messages, limits.max_messages, param)):
        if not isinstance(msg, dict):
            raise RequestError(400, f"'{param}[{i}]' must be an object.", param=f"{param}[{i}]")
        text = _content_text(msg.get("content"), f"{param}[{i}].content", parts, media)
        calls = msg.get("tool_calls")
        if calls:  # most messages have none (an empty or null list is none)
            if not isinstance(calls, list):
                raise RequestError(400, f"'{param}[{i}].tool_calls' must be a list.",
                                   param=f"{param}[{i}].tool_calls")
            for call in _bounded(calls, parts, f"{param}[{i}].tool_calls"):
                if isinstance(call, dict):
                    text += json.dumps(call.get("function", call), sort_keys=True)
        # Responses items: a (custom) tool call's arguments or input, and its output
        for key in ("arguments", "input"):
            if isinstance(msg.get(key), str):
                text += msg[key]
        if isinstance(msg.get("output"), str | list):  # other shapes (a screenshot) add nothing
            text += _content_text(msg["output"], f"{param}[{i}].output", parts, media)
        (system if msg.get("role") in ("system", "developer") else rest).append(text)
    return system, rest


def _tools_text(tools: Any, max_tools: int) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(400, "'tools' must be a list.", param="tools")
    return [json.dumps(t, sort_keys=True, separators=(",", ":"))
            for t in _bounded(tools, max_tools, "tools")]


def _ids_shaped(prompt: Any) -> bool:
    """Whether a completions ``prompt`` is a list that starts with a token id."""
    return isinstance(prompt, list) and bool(prompt) and type(prompt[0]) is int


def _token_ids(prompt: Any, limits: Limits) -> bool:
    """Whether ``prompt`` is a completions prompt of token ids (bounded before it is scanned: as
    text each id takes at least two characters)."""
    if not _ids_shaped(prompt):
        return False
    if 2 * len(prompt) - 1 > limits.max_prompt_chars:
        raise RequestError(
            413, f"The prompt has {len(prompt)} token ids; the limit is "
            f"{(limits.max_prompt_chars + 1) // 2}.", code="request_too_large")
    return _all_ids(prompt)


def _all_ids(ids: list[Any]) -> bool:
    """Every element a non-negative int below 2**64 (bool is no int here): per type, not per
    element, which took a quarter of a second for an 8 MiB prompt of ids on the router's loop."""
    if not ids or set(map(type, ids)) != {int} or min(ids) < 0:
        return not ids
    if max(ids) >= MAX_TOKEN_ID:
        raise RequestError(400, f"Token ids must be below {MAX_TOKEN_ID}.", param="prompt")
    return True


def prompt_block_hashes(endpoint: str, body: Mapping[str, Any], text: str,
                        tok: Tokenization) -> np.ndarray:
    """The prompt's chained block hashes, as the router and the simulated engine both cut them:
    ``text`` (`prompt_text`) in blocks of characters, but a completions prompt of token ids in
    blocks of ``block_tokens`` ids (a batch's lists one after the other, as a batch of texts is
    hashed as one text), as the engine pages them."""
    prompt = body.get("prompt") if endpoint == "completions" else None
    if _ids_shaped(prompt):
        return tok.id_block_hashes(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return tok.id_block_hashes([i for ids in prompt for i in ids])
    return tok.block_hashes(text)


def _ids_text(ids: list[int]) -> str:
    """Token ids as the text they are hashed as: ``" ".join(map(str, ids))``, by the C encoder
    (the join took another quarter of a second)."""
    return json.dumps(ids)[1:-1].replace(", ", " ")


def _token_id_batch(prompt: Any, limits: Limits) -> bool:
    """Whether ``prompt`` is a batch of token-id lists (bounded as one prompt of ids is)."""
    if not (isinstance(prompt, list) and prompt and all(
            isinstance(p, list) for p in _bounded(prompt, limits.max_messages, "prompt"))):
        return False
    total = sum(map(len, prompt))
    if 2 * total - len(prompt) > limits.max_prompt_chars:
        raise RequestError(
            413, f"The prompt has {total} token ids; the limit is "
            f"{(limits.max_prompt_chars + 1) // 2}.", code="request_too_large")
    return all(_all_ids(ids) for ids in prompt)


def token_count(text: str, limits: Limits = DEFAULT_LIMITS) -> int | None:
    """``text`` as a number of output tokens a request may ask for (1 to
    ``limits.max_output_tokens``), None when it is not one (`whole_number`)."""
    n = whole_number(text)
    return n if n is not None and 1 <= n <= limits.max_output_tokens else None


def output_bound(endpoint: str, body: Mapping[str, Any],
                 limits: Limits = DEFAULT_LIMITS) -> int | None:
    """The output tokens a request asks for at most (None: not said): the field its API reads
    (chat: the newer name first, as vLLM and OpenAI do; a field of another API is not this
    one's); a completion's default is the API's 16; with `echo`, 0 asks only for the prompt's
    logprobs (evaluation harnesses)."""
    echo = endpoint == "completions" and body.get("echo") is True
    bound = positive_int(body, *OUTPUT_FIELDS[endpoint], maximum=limits.max_output_tokens,
                         minimum=0 if echo else 1)
    if bound is None and endpoint == "completions":
        return COMPLETIONS_MAX_TOKENS
    return bound


def prompt_sizes(prompt: Any, tok: Tokenization) -> list[int]:
    """Tokens of each prompt of a completions request (checked by `prompt_text`): ids counted
    as ids, text by the fleet's characters per token."""
    if isinstance(prompt, str):
        return [tok.count_tokens(len(prompt))]
    if _ids_shaped(prompt):
        return [len(prompt)]
    return [len(p) if isinstance(p, list) else tok.count_tokens(len(p)) for p in prompt]


def prompt_text(endpoint: str, body: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS,
                media_chars: int = 0) -> str:
    """The prompt as the engine's template sees it (see module docstring for the order), at most
    ``limits.max_prompt_chars`` long; every list is bounded before its elements are read. A
    media part stands as a mark naming its content, padded to ``media_chars`` characters (its
    tokens' worth, `_Media`)."""
    media = _Media(media_chars, limits.max_prompt_chars)
    if endpoint == "chat":
        if "messages" not in body:
            raise RequestError(400, "Missing required parameter: 'messages'.", param="messages")
        system, convo = _messages_text(body["messages"], "messages", limits, media)
        pieces = system + _tools_text(body.get("tools"), limits.max_tools) + convo
    elif endpoint == "completions":
        if "prompt" not in body:
            raise RequestError(400, "Missing required parameter: 'prompt'.", param="prompt")
        prompt = body["prompt"]
        if isinstance(prompt, str):
            pieces = [prompt]
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            pieces = _bounded(prompt, limits.max_messages, "prompt")
        elif _token_ids(prompt, limits):
            # Token ids: counted and hashed as ids (`prompt_block_hashes`), their text for the rest
            pieces = [_ids_text(prompt)]
        elif _token_id_batch(prompt, limits):
            pieces = [_ids_text(ids) for ids in prompt]
        else:
            raise RequestError(400, "'prompt' must be a string, a list of strings, a list of "
                               "token ids or a list of such lists.", param="prompt")
    elif endpoint == "responses":
        if "input" not in body:
            raise RequestError(400, "Missing required parameter: 'input'.", param="input")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise RequestError(400, "'instructions' must be a string.", param="instructions")
        inp = body["input"]
        system, convo = (([], [inp]) if isinstance(inp, str)
                         else _messages_text(inp, "input", limits, media))
        if instructions:
            system.insert(0, instructions)
        pieces = system + _tools_text(body.get("tools"), limits.max_tools) + convo
    else:
        raise ValueError(f"unknown endpoint {endpoint!r}")
    text = "\n".join(pieces)
    if len(text) > limits.max_prompt_chars:
        raise RequestError(
            413, f"The prompt has {len(text)} characters; the limit is {limits.max_prompt_chars}.",
            code="request_too_large")
    return text


def positive_int(body: Mapping[str, Any], *names: str, maximum: int | None = None,
                 minimum: int = 1) -> int | None:
    """The first of ``names`` present in ``body``, which must be an integer of at least
    ``minimum`` (1: positive) and at most ``maximum``, when given."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise RequestError(400, f"'{name}' must be {what}.", param=name)
        if maximum is not None and value > maximum:
            raise RequestError(400, f"'{name}' must be at most {maximum}.", param=name,
                               code="integer_above_max_value")
        return value
    return None


def _priority(headers: Mapping[str, str]) -> int | None:
    """The priority header as a bounded integer: plain ASCII digits, nothing the shedding limit's
    float arithmetic could overflow on."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return None
    lo, hi = PRIORITY_BOUNDS
    n = whole_number(raw, len(str(hi)))
    if n is not None and lo <= n <= hi:
        return n
    raise RequestError(400, f"Header '{PRIORITY_HEADER}' must be an integer in [{lo}, {hi}].",
                       param=PRIORITY_HEADER, code="invalid_priority")


def _slo(headers: Mapping[str, str], name: str) -> float | None:
    """A latency target header in milliseconds, bounded (a plain decimal number)."""
    raw = headers.get(name)
    if raw is None:
        return None
    lo, hi = SLO_BOUNDS_MS
    try:
        value = float(raw) if raw.isascii() and len(raw) <= 16 else math.nan
    except ValueError:
        value = math.nan
    if not lo <= value <= hi:  # NaN fails too
        raise RequestError(400, f"Header '{name}' must be a number of milliseconds in "
                                f"[{lo:g}, {hi:g}].", param=name, code="invalid_slo")
    return value


def _policy(headers: Mapping[str, str], known: Collection[str] | None) -> str | None:
    """The policy header; with ``known``, a name outside it is a client error, not ignored."""
    policy = headers.get(POLICY_HEADER) or None
    if policy is not None and known is not None and policy not in known:
        raise RequestError(400, f"Header '{POLICY_HEADER}' names unknown policy {policy[:64]!r} "
                                f"(known: {', '.join(known)}).",
                           param=POLICY_HEADER, code="unknown_policy")
    return policy


def _named_model(raw_body: bytes, limits: Limits) -> str | None:
    """The model a request of another path (`routes.extra_paths`: embeddings, ...) names in its
    JSON body, if it names one: where it can be served. The body is otherwise the engine's to
    judge, so the inference paths' container count does not apply (an embeddings batch of 50,001
    token-id arrays lost its model that way and went to replicas of another model); a body
    that is no JSON object names none."""
    if not raw_body:
        return None
    try:
        body = json.loads(raw_body)
    except ValueError:
        return None
    except RecursionError:
        raise RequestError(400, f"JSON nesting deeper than {limits.max_json_depth} "
                                "levels.") from None
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str):
        return None
    try:  # a non-ASCII name is a model no replica serves (a 404), not "any replica"
        model.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(400, "'model' is not valid Unicode text.", param="model") from None
    return model


def extract_features(
    path: str,
    headers: Mapping[str, str],
    raw_body: bytes,
    tok: Tokenization,
    *,
    policies: Collection[str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> RequestFeatures:
    """Features of one request; ``headers`` must have lower-case names. Raises RequestError,
    also for a policy header outside ``policies`` (when given: the router's policy names) and for
    a body past the fleet's ``limits``."""
    policy = _policy(headers, policies)
    priority = _priority(headers)
    slo = (_slo(headers, SLO_TTFT_HEADER), _slo(headers, SLO_TPOT_HEADER))
    endpoint = endpoint_for_path(path)
    if endpoint is None:
        return RequestFeatures(None, _named_model(raw_body, limits), False, None,
                               headers.get(SESSION_HEADER) or None, 0, 0, EMPTY_HASHES, policy,
                               priority, *slo)
    body = parse_json_body(raw_body, limits.max_json_depth, limits.max_json_containers)
    text = prompt_text(endpoint, body, limits, tok.chars_for_tokens(tok.media_tokens))
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string.", param="model")
    if model is not None and not model.isascii():
        try:  # JSON's "\ud800" escape decodes to a string no protobuf or span can carry
            model.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(400, "'model' is not valid Unicode text.", param="model") from None
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be a boolean.", param="stream")
    max_tokens = output_bound(endpoint, body, limits)
    # The Responses API has no `n`. (vLLM's `best_of` is not counted: its V1 engine refuses any
    # above 1, and SGLang reads none.)
    n = 1 if endpoint == "responses" else positive_int(body, "n", maximum=limits.max_choices) or 1
    # each prompt's tokens: a completions prompt of token ids (prompt_text checked every
    # element) is counted as ids, a batch of prompts one by one; None: the one prompt's text
    sizes = prompt_sizes(body["prompt"], tok) if endpoint == "completions" else None
    prompt_tokens = tok.count_tokens(len(text)) if sizes is None else sum(sizes)
    batch = sizes is not None and not (_ids_shaped(body["prompt"]) or isinstance(
        body["prompt"], str))
    session = headers.get(SESSION_HEADER) or None
    for key in ("prompt_cache_key", "user"):
        if session is None and isinstance(body.get(key), str) and body[key]:
            session = body[key]
    return RequestFeatures(
        endpoint=endpoint,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        session_key=session,
        prompt_chars=len(text),
        prompt_tokens=prompt_tokens,
        block_hashes=prompt_block_hashes(endpoint, body, text, tok),
        policy=policy,
        priority=priority,
        slo_ttft_ms=slo[0],
        slo_tpot_ms=slo[1],
        head_hash=stable_hash(text[: tok.chars_for_tokens(AFFINITY_HEAD_TOKENS)]),
        body=body,
        choices=n * max(len(sizes), 1) if batch else n,
        prompts=max(len(sizes), 1) if batch else 1,
        longest_prompt_tokens=max(sizes, default=0) if batch else None,
    )


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")
