"""Request traces for replay and offline simulation, with deterministic synthetic prompt text.

Public traces carry lengths and (sometimes) prefix structure but no text, so each request is
described by ``parts``: a sequence of (key, tokens) pieces. A key always expands to the same text
(a ``[key]`` marker followed by a slice of a fixed pseudo-word pool chosen by the key), and a
shorter expansion is a prefix of a longer one, so requests that share leading keys share a text
prefix exactly, and requests that do not share keys differ from their first router block on.
Piece boundaries depend only on the tokens before them, so a shared prefix of parts is a shared
prefix of characters whatever the ``Tokenization``.

Sources (``load_trace`` spec strings):

- ``mooncake[:PATH]``: Mooncake FAST'25 conversation trace. Each 512-token block hash id becomes
  one block of text (the last block takes the remainder), so equal hash ids give equal prefixes.
  The trace has no sessions.
- ``azure[:PATH]``: Azure LLM inference trace 2023 (conversation). It has no prefix information;
  see ``DESCRIPTION["azure"]`` for the synthesised prefix assumption.
- ``chat[:seed=S,users=U,...]``: built-in multi-turn chat generator calibrated to the statistics
  the GORGO paper reports for ART-Chat-2.5M; see ``DESCRIPTION["chat"]`` and ``chat_trace``.

Options after ``:`` are ``key=value`` pairs separated by commas; a bare value is a path. Every
source accepts ``limit=N`` (first N requests); file sources accept ``path=``. Trace files are found
under ``traces_dir()``: ``$GORGO_TRACES`` if set, else the repository's own ``data/traces`` (see
``data/README.md`` for sources, licenses and checksums). A missing file raises ``TraceNotFound``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from gorgo.core.tokens import Tokenization
from gorgo.errors import UserError

TRACES_ENV = "GORGO_TRACES"
MOONCAKE_FILE = "mooncake/conversation_trace.jsonl"
AZURE_FILE = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
MOONCAKE_BLOCK_TOKENS = 512
AZURE_SYSTEM_TOKENS = 512

DESCRIPTION: dict[str, str] = {
    "mooncake": (
        "Mooncake FAST'25 conversation trace (Kimi, 1 h, 12,031 requests): real arrival times, "
        "token counts and 512-token prefix-block hashes. Each block hash becomes a fixed block of "
        "synthetic text, so prefix reuse is exactly the trace's own. No sessions."
    ),
    "azure": (
        "Azure LLM inference trace 2023, conversation service (Splitwise, ISCA'24; CC-BY-4.0): "
        "real arrival times and token counts, no prefix data. ASSUMPTION: every prompt starts "
        f"with one system prompt shared by all requests ({AZURE_SYSTEM_TOKENS} tokens, cut to at "
        "most half of a shorter prompt); the rest of each prompt is unique, so there is no other "
        "prefix reuse and no sessions."
    ),
    "chat": (
        "Synthetic multi-turn chat (seeded) calibrated to ART-Chat-2.5M as reported in the GORGO "
        "paper: about 13 requests per user, 74 % of requests continue a conversation (prompt = "
        "previous prompt + previous answer + new message), 89 % share a prefix with an earlier "
        "request of the same user (continuations plus new conversations that reuse the user's "
        "system prompt); Poisson arrivals; session = user id."
    ),
}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace; ``parts`` describe its prompt (empty: one unique piece)."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    session: str | None = None
    parts: tuple[tuple[str, int], ...] = ()
    # The ``index`` of the request this one continues (its session's previous turn: this prompt
    # is that prompt, its answer and a new message); None for a first turn or an unmarked trace.
    follows: int | None = None

    def prompt(self, tok: Tokenization) -> str:
        """Prompt text with ``tok.count_tokens(len(text)) == input_tokens`` exactly."""
        parts = self.parts or ((f"req{self.index}", self.input_tokens),)
        return build_text(parts, self.input_tokens, tok, pad_key=f"pad{self.index}")

    def chat_body(self, tok: Tokenization, model: str, stream: bool = True) -> dict[str, Any]:
        """OpenAI chat-completions body: the whole prompt in one user message."""
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": self.prompt(tok)}],
            "max_tokens": self.output_tokens,
            "stream": stream,
        }
        return self._finish_body(body, stream)

    def completion_body(self, tok: Tokenization, model: str, stream: bool = True) -> dict[str, Any]:
        """OpenAI (legacy) completions body with the same prompt."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": self.prompt(tok),
            "max_tokens": self.output_tokens,
            "stream": stream,
        }
        return self._finish_body(body, stream)

    def _finish_body(self, body: dict[str, Any], stream: bool) -> dict[str, Any]:
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.session is not None:
            body["user"] = self.session
        return body


# ---------------------------------------------------------------------------- text synthesis

_POOL_CHARS = 1 << 20
_POOL_SEED = 0x6060
_PIECE_CACHE_SIZE = 8192
_piece_cache: OrderedDict[str, str] = OrderedDict()


@cache
def _pool() -> str:
    """A fixed ~1 MiB ASCII pseudo-word text, doubled so any slice up to its length is direct."""
    rng = random.Random(_POOL_SEED)
    onsets, vowels = "bcdfghjklmnprstvwz", "aeiou"
    vocab = [
        "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))
        for _ in range(4096)
    ]
    words = rng.choices(vocab, k=_POOL_CHARS // 4)
    for k in range(11, len(words), 12):
        words[k] += "." if k % 5 else ".\n"
    text = " ".join(words)[:_POOL_CHARS]
    return text + text


def piece_text(key: str, n_chars: int) -> str:
    """``n_chars`` of the text for ``key``; a shorter call returns a prefix of a longer one."""
    if n_chars <= 0:
        return ""
    cached = _piece_cache.get(key)
    if cached is not None:
        _piece_cache.move_to_end(key)
        if len(cached) >= n_chars:
            return cached if len(cached) == n_chars else cached[:n_chars]
    pool = _pool()
    size = len(pool) // 2
    head = f"[{key}] "
    body = n_chars - len(head)
    start = zlib.crc32(key.encode()) % size
    if body <= 0:
        text = head[:n_chars]
    elif body <= size:
        text = head + pool[start : start + body]
    else:
        reps = body // size + 2
        text = head + (pool[:size] * reps)[start : start + body]
    _piece_cache[key] = text
    if len(_piece_cache) > _PIECE_CACHE_SIZE:
        _piece_cache.popitem(last=False)
    return text


def chars_for_tokens(tok: Tokenization, tokens: int) -> int:
    """Characters nearest ``tokens * chars_per_token`` that count as exactly ``tokens``."""
    if tokens <= 0:
        return 0
    n = tok.chars_for_tokens(tokens)
    while n > 0 and tok.count_tokens(n) > tokens:
        n -= 1
    while tok.count_tokens(n) < tokens:
        n += 1
    return n


def build_text(
    parts: Iterable[tuple[str, int]], total_tokens: int, tok: Tokenization, pad_key: str
) -> str:
    """Concatenate the parts' texts, cut or padded (with ``pad_key``) to ``total_tokens``."""
    total = chars_for_tokens(tok, total_tokens)
    pieces: list[str] = []
    cum = 0
    pos = 0
    for key, tokens in parts:
        cum += tokens
        end = min(chars_for_tokens(tok, cum), total)
        if end > pos:
            pieces.append(piece_text(key, end - pos))
            pos = end
        if pos >= total:
            break
    if pos < total:
        pieces.append(piece_text(pad_key, total - pos))
    return "".join(pieces)


# ---------------------------------------------------------------------------------- sources


# The repository's data/traces: gorgo/sim/traces.py -> parents[2] is the source tree's root.
DEFAULT_TRACES_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"


class TraceError(UserError, ValueError):
    """A trace spec or trace file that cannot be used; `gorgo` reports it in one line."""


class TraceNotFound(TraceError):
    """A trace file that is not there (a ValueError, as any other bad trace spec)."""


def traces_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Where the trace files live: ``override``, ``$GORGO_TRACES``, else the repo's data/traces."""
    if override:
        return Path(override)
    env = os.environ.get(TRACES_ENV)
    if env:
        return Path(env)
    return DEFAULT_TRACES_DIR


def _resolve(path: str | os.PathLike[str] | None, default: str, root: Path | None) -> Path:
    base = root if root is not None else traces_dir()
    if path is None:
        file = base / default
    else:
        p = Path(path)
        file = p / Path(default).name if p.is_dir() else p
    if not file.is_file():
        raise TraceNotFound(
            f"trace file not found: {file} (the repository ships it under data/traces; "
            f"${TRACES_ENV} or a path in the spec points elsewhere)"
        )
    return file


def mooncake_trace(
    path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    root: Path | None = None,
) -> list[TraceRequest]:
    """The Mooncake conversation trace; block hash ids become shared text blocks."""
    file = _resolve(path, MOONCAKE_FILE, root)
    block = MOONCAKE_BLOCK_TOKENS
    interned: dict[tuple[int, int], tuple[str, int]] = {}
    out: list[TraceRequest] = []
    with open(file, encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            index = len(out)
            input_tokens = int(row["input_length"])
            remaining = input_tokens
            parts: list[tuple[str, int]] = []
            for h in row["hash_ids"]:
                tokens = min(block, remaining)
                if tokens <= 0:
                    break
                pair = interned.get((h, tokens))
                if pair is None:
                    pair = interned[(h, tokens)] = (f"mc{h}", tokens)
                parts.append(pair)
                remaining -= tokens
            if remaining > 0:
                parts.append((f"mc-tail{index}", remaining))
            out.append(
                TraceRequest(
                    index=index,
                    arrival_s=float(row["timestamp"]) / 1000.0,
                    input_tokens=input_tokens,
                    output_tokens=int(row["output_length"]),
                    parts=tuple(parts),
                )
            )
    return _checked(out, file)


def _checked(rows: list[TraceRequest], file: Path) -> list[TraceRequest]:
    """A trace file's requests, refused where a bench would go wrong silently or late: out of
    time order (negative arrivals, and a mean rate, so a load, off by the disorder: 3x in one
    case) or without a prompt or output token (the bench died with a traceback)."""
    for k, r in enumerate(rows):
        if r.input_tokens < 1 or r.output_tokens < 1:
            raise TraceError(f"{file}: record {k + 1} has {r.input_tokens} prompt and "
                             f"{r.output_tokens} output tokens; a request needs at least one "
                             "of each")
        if k and r.arrival_s < rows[k - 1].arrival_s:
            early = rows[k - 1].arrival_s - r.arrival_s
            raise TraceError(f"{file}: record {k + 1} arrives {early:g} s before record {k}; "
                             "sort the file by its timestamps")
    return rows


def azure_trace(
    path: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    system_tokens: int = AZURE_SYSTEM_TOKENS,
    root: Path | None = None,
) -> list[TraceRequest]:
    """The Azure 2023 conversation trace with a synthesised shared system prompt.

    Each prompt opens with ``min(system_tokens, input_tokens // 2)`` tokens of one system prompt
    common to all requests; the rest is unique to the request.
    """
    file = _resolve(path, AZURE_FILE, root)
    out: list[TraceRequest] = []
    t0: datetime | None = None
    with open(file, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if limit is not None and len(out) >= limit:
                break
            ts = datetime.fromisoformat(row["TIMESTAMP"].strip())
            if t0 is None:
                t0 = ts
            index = len(out)
            input_tokens = int(row["ContextTokens"])
            shared = min(system_tokens, input_tokens // 2)
            parts = (("az-system", shared), (f"az{index}", input_tokens - shared))
            out.append(
                TraceRequest(
                    index=index,
                    arrival_s=(ts - t0).total_seconds(),
                    input_tokens=input_tokens,
                    output_tokens=int(row["GeneratedTokens"]),
                    parts=tuple(p for p in parts if p[1] > 0),
                )
            )
    return _checked(out, file)


def chat_trace(
    seed: int = 0,
    users: int = 200,
    rate: float = 2.0,
    requests_per_user: float = 13.0,
    multi_turn: float = 0.74,
    reuse: float = 0.89,
    system_tokens: int = 2048,
    message_tokens: int = 256,
    output_tokens: int = 128,
    max_context: int = 32768,
    limit: int | None = None,
) -> list[TraceRequest]:
    """Seeded multi-turn chat calibrated to ART-Chat-2.5M (GORGO paper).

    Users send a geometric number of requests (mean ``requests_per_user``), interleaved at random
    into one Poisson stream of ``rate`` req/s. After a user's first request, each request
    continues the user's current conversation (prompt = previous prompt + previous answer + new
    message) with a probability set so that a ``multi_turn`` fraction of all requests are
    continuations; otherwise it opens a new conversation that reuses the user's system prompt
    with a probability set so that a ``reuse`` fraction of all requests share a prefix with an
    earlier request of the same user. Lengths are lognormal with the given medians
    (``*_tokens``); a conversation that would outgrow ``max_context`` starts over.
    """
    if users < 1 or not 0 < rate < math.inf or requests_per_user < 1:  # NaN: all at once
        raise ValueError("need users >= 1, rate > 0 and requests_per_user >= 1")
    first = 1.0 / requests_per_user
    if not 0.0 <= multi_turn <= 1.0 - first:
        raise ValueError(f"multi_turn must be in [0, {1.0 - first:.3f}] at this requests_per_user")
    if not multi_turn <= reuse <= 1.0 - first:
        raise ValueError(f"reuse must be in [multi_turn, {1.0 - first:.3f}]")
    p_continue = multi_turn / (1.0 - first)
    fresh = 1.0 - multi_turn - first
    p_same_system = (reuse - multi_turn) / fresh if fresh > 0 else 1.0

    rng = np.random.default_rng(seed)
    counts = rng.geometric(first, size=users)
    order = np.repeat(np.arange(users), counts)
    rng.shuffle(order)
    n = len(order)
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.concatenate(([0.0], np.cumsum(gaps[:-1])))
    msgs = _lognormal_tokens(rng, message_tokens, 1.0, 8192, n)
    outs = _lognormal_tokens(rng, output_tokens, 0.6, 2048, n)
    systems = _lognormal_tokens(rng, system_tokens, 0.6, 16384, n)
    coin_continue = rng.random(n)
    coin_system = rng.random(n)

    system: list[tuple[str, int] | None] = [None] * users
    n_systems = [0] * users
    convo: list[tuple[tuple[str, int], ...]] = [()] * users
    convo_tokens = [0] * users
    n_convos = [0] * users
    turn = [0] * users
    last_out = [0] * users
    last_index: list[int | None] = [None] * users
    out: list[TraceRequest] = []
    for j in range(n if limit is None else min(n, limit)):
        u = int(order[j])
        prefix = f"c{seed}u{u}"
        msg, answer = int(msgs[j]), int(outs[j])
        grown = convo_tokens[u] + last_out[u] + msg
        follows = None
        if convo[u] and coin_continue[j] < p_continue and grown <= max_context:
            follows = last_index[u]
            turn[u] += 1
            c, t = n_convos[u], turn[u]
            parts = (*convo[u], (f"{prefix}a{c}.{t - 1}", last_out[u]), (f"{prefix}m{c}.{t}", msg))
        else:
            sys_part = system[u]
            if sys_part is None or coin_system[j] >= p_same_system:
                n_systems[u] += 1
                sys_part = system[u] = (f"{prefix}s{n_systems[u]}", int(systems[j]))
            n_convos[u] += 1
            turn[u] = 1
            parts = (sys_part, (f"{prefix}m{n_convos[u]}.1", msg))
        parts = tuple(p for p in parts if p[1] > 0)
        tokens = sum(p[1] for p in parts)
        convo[u], convo_tokens[u], last_out[u], last_index[u] = parts, tokens, answer, j
        out.append(
            TraceRequest(
                index=j,
                arrival_s=float(arrivals[j]),
                input_tokens=tokens,
                output_tokens=answer,
                session=f"user-{u}",
                parts=parts,
                follows=follows,
            )
        )
    return out


def _lognormal_tokens(
    rng: np.random.Generator, median: int, sigma: float, cap: int, n: int
) -> np.ndarray:
    draws = rng.lognormal(math.log(max(1, median)), sigma, size=n)
    return np.clip(np.rint(draws), 1, cap).astype(np.int64)


# ------------------------------------------------------------------------------ spec parsing

_CHAT_OPTIONS: dict[str, type] = {
    "seed": int,
    "users": int,
    "rate": float,
    "requests_per_user": float,
    "multi_turn": float,
    "reuse": float,
    "system_tokens": int,
    "message_tokens": int,
    "output_tokens": int,
    "max_context": int,
}
_FILE_OPTIONS: dict[str, dict[str, type]] = {
    "mooncake": {"path": str},
    "azure": {"path": str, "system_tokens": int},
}
SOURCES: tuple[str, ...] = ("mooncake", "azure", "chat")


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``name[:PATH | :k=v,...]`` into the source name and typed options."""
    name, _, rest = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in SOURCES:
        raise TraceError(f"unknown trace source {name!r}; expected one of {SOURCES}")
    allowed = {"limit": int, **(_CHAT_OPTIONS if name == "chat" else _FILE_OPTIONS[name])}
    opts: dict[str, Any] = {}
    if not rest:
        return name, opts
    if "=" not in rest:
        if name == "chat":
            raise TraceError("chat options are key=value pairs, e.g. chat:seed=1,users=50")
        return name, {"path": rest}
    for item in rest.split(","):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in allowed:
            raise TraceError(f"bad option {item!r} for {name}; known: {sorted(allowed)}")
        try:
            opts[key] = allowed[key](value.strip())
        except ValueError:
            raise TraceError(f"bad value for {key}: {value!r}") from None
    return name, opts


def load_trace(spec: str, root: str | os.PathLike[str] | None = None) -> list[TraceRequest]:
    """Load a trace from a CLI spec (see the module docstring); ``root`` overrides traces_dir().
    Any problem with the spec or its file is a TraceError."""
    name, opts = parse_spec(spec)
    base = traces_dir(root) if root is not None else None
    try:
        if name == "mooncake":
            return mooncake_trace(root=base, **opts)
        if name == "azure":
            return azure_trace(root=base, **opts)
        return chat_trace(**opts)
    except TraceError:
        raise
    except KeyError as exc:
        raise TraceError(f"{spec}: a record lacks the field {exc}") from None
    except (ValueError, OSError) as exc:
        raise TraceError(f"{spec}: {exc}") from None


# ----------------------------------------------------------------------------- statistics


def reuse_stats(requests: Sequence[TraceRequest], tok: Tokenization) -> dict[str, float]:
    """Session-level prefix statistics measured on the generated text itself.

    ``continuation_fraction``: requests whose prompt extends the same session's previous prompt.
    ``session_reuse_fraction``: requests whose first router block equals that of an earlier
    request of the same session. Requests without a session count as neither.
    """
    last: dict[str, str] = {}
    first_blocks: dict[str, set[str]] = {}
    continued = reused = 0
    tokens = 0
    for r in requests:
        tokens += r.input_tokens
        if r.session is None:
            continue
        text = r.prompt(tok)
        prev = last.get(r.session)
        if prev is not None and text.startswith(prev):
            continued += 1
        seen = first_blocks.setdefault(r.session, set())
        head = text[: tok.block_chars]
        if len(head) == tok.block_chars:
            if head in seen:
                reused += 1
            seen.add(head)
        last[r.session] = text
    n = len(requests)
    sessions = len(first_blocks)
    return {
        "requests": float(n),
        "sessions": float(sessions),
        "requests_per_session": n / sessions if sessions else 0.0,
        "continuation_fraction": continued / n if n else 0.0,
        "session_reuse_fraction": reused / n if n else 0.0,
        "mean_input_tokens": tokens / n if n else 0.0,
    }
