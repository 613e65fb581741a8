"""A request's prompt as the engine's token ids, for the precise cache view.

An engine hashes the tokens it actually runs: for a chat request, the served model's chat template
rendered over the messages (BOS, role markers and the generation prompt included) and tokenized
without adding special tokens again; for a completions request, the prompt tokenized with them
(vLLM's defaults). Two tokenizers:

- `SimTokenizer`: the simulated engine's, one token per ``chars_per_token`` characters of the
  router's own prompt text (`features.prompt_text`), its id a 17-bit hash of those characters
  (about a real vocabulary's size). Deterministic and vectorised; what `tokenizer: sim` names in
  the fleet file, and what the simulated vLLM's render endpoint returns.
- `HFTokenizer`: the served model's tokenizer and chat template from a local directory, through
  ``transformers`` (an optional dependency, imported only when a fleet names one).

Both yield the ids in chunks, lazily: the caller hashes blocks as they come and stops at the first
block no replica holds, so a cold prompt costs one chunk of tokenization, not the whole prompt.
Each chunk says how many of its ids were tokenized afresh, for the lookup's budget.
`HFTokenizer` cuts the rendered text before a word every ``CHUNK_CHARS`` characters, tokenizes the
pieces separately and memoises them: for a tokenizer whose pre-tokenizer splits words at spaces
(byte-level BPE, as the GPT-2/Llama 3/Qwen families; checked on load, else the whole text is
tokenized at once) this is exactly the whole text's tokenization, and the turns a conversation
repeats are not tokenized again. A chunk not in the memo is tokenized in quarter-chunk pieces as
the walk needs them (`HFTokenizer._chunks`).
"""

from __future__ import annotations

import array
import contextlib
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from gorgo.core.features import RequestFeatures, prompt_text
from gorgo.core.fleet import FleetError

SIM = "sim"
CHUNK_CHARS = 1024
MEMO_CHUNKS = 16384  # memoised chunks (about 1 KB of text and its ids each)
_WORD_START = re.compile(r"(?<=\S) (?=\S)")
_SIM_CHUNK_TOKENS = 1024
SIM_VOCAB_BITS = 17
_ID_MIX = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)  # odd 64-bit multipliers


# (token ids, characters they cover, how many of the ids were tokenized afresh for it: 0 when
# they came from a memo or from a tokenizer too cheap to count, as the simulated one)
Chunk = tuple["list[int] | array.array[int]", int, int]


class PromptTokenizer(Protocol):
    name: str

    def token_chunks(self, f: RequestFeatures) -> Iterator[Chunk]:
        """The prompt's token ids in order, a chunk at a time, each with the number of prompt
        characters it covers as the router counts them (``prompt_chars``: a chat template's
        markup scaled out; 0: unknown) and of ids tokenized afresh (what the precise lookup's
        budget counts); nothing for a non-inference request or one the template cannot
        render."""
        ...


class SimTokenizer:
    """The simulated engine's tokenizer (see module docstring)."""

    def __init__(self, chars_per_token: float) -> None:
        self.name = SIM
        self.chars_per_token = chars_per_token

    def count(self, n_chars: int) -> int:
        """Tokens in ``n_chars`` characters (a partial token counts), as `Tokenization`."""
        return int(-(-n_chars // self.chars_per_token)) if n_chars > 0 else 0

    def ids(self, text: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Ids of tokens ``start:stop`` of ``text``: token k hashes the characters
        [round(k * cpt), round((k + 1) * cpt)), so two prompts with a common prefix share their
        leading ids, as a real tokenizer's output would."""
        size = len(text)
        stop = self.count(size) if stop is None else min(stop, self.count(size))
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        cpt = self.chars_per_token
        starts = np.minimum(np.round(np.arange(start, stop) * cpt).astype(np.int64), size - 1)
        # below one character per token the last tokens may start where the range would end
        # (round(k * cpt) == round((k + 1) * cpt)): every token keeps its character
        lo, hi = int(starts[0]), min(size, max(round(stop * cpt), int(starts[-1]) + 1))
        codes = np.frombuffer(text[lo:hi].encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        starts -= lo
        pos = np.arange(codes.size)
        offset = (pos - starts[np.searchsorted(starts, pos, side="right") - 1]).astype(np.uint64)
        with np.errstate(over="ignore"):  # 64-bit hashing wraps by design
            mixed = codes.astype(np.uint64) * (offset * np.uint64(_ID_MIX[0]) + np.uint64(1))
            ids = np.add.reduceat(mixed, starts) * np.uint64(_ID_MIX[1])
        return (ids >> np.uint64(64 - SIM_VOCAB_BITS)).astype(np.int64)

    def token_chunks(self, f: RequestFeatures) -> Iterator[Chunk]:
        if f.endpoint is None or f.body is None:
            return
        text = prompt_text(f.endpoint, f.body)
        n, cpt = self.count(len(text)), self.chars_per_token
        for k in range(0, n, _SIM_CHUNK_TOKENS):
            stop = min(k + _SIM_CHUNK_TOKENS, n)
            chars = min(len(text), round(stop * cpt)) - round(k * cpt)
            yield self.ids(text, k, stop).tolist(), chars, 0


def _text_of(content: Any) -> str:
    """A message's content as vLLM's "string" content format flattens it: text parts joined."""
    if isinstance(content, list):
        return "\n".join(p if isinstance(p, str) else str(p.get("text", ""))
                         for p in content if isinstance(p, str | dict))
    return "" if content is None else str(content)


def _messages(raw: Any) -> list[dict[str, Any]]:
    return [{**m, "content": _text_of(m.get("content"))} for m in raw if isinstance(m, dict)]


class HFTokenizer:
    """The served model's tokenizer and chat template (see module docstring)."""

    def __init__(self, path: str, chunk_chars: int = CHUNK_CHARS) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise FleetError(f"tokenizer {path!r}: needs the 'transformers' package "
                             "(pip install 'gorgo-router[precise]')") from None
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise FleetError(f"tokenizer {path!r}: cannot load it: {exc}") from None
        self._backend = getattr(self._tok, "backend_tokenizer", None)
        self.name = path
        self.chunk_chars = chunk_chars
        self._memo: OrderedDict[str, array.array] = OrderedDict()
        self._prefix = self._encode("", True)
        self.chunked = self._chunking_exact()
        self._memo.clear()

    def _encode(self, text: str, special: bool) -> list[int]:
        """``transformers``' encode, through its Rust tokenizer directly where it has one (what
        its fast tokenizers call, without building a `BatchEncoding` per piece)."""
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=special).ids
        return self._tok.encode(text, add_special_tokens=special)

    def _chunking_exact(self) -> bool:
        """Whether chunked tokenization equals whole-text tokenization for this tokenizer: a
        probe of words, digits, punctuation, runs of spaces and newlines, templated as a chat."""
        words = ["alpha", "Beta", "12345", "x=y;", "  ", "\n", "\n\n", " \t", "héllo", "(a)",
                 "don't", "--", "...", "end."]
        rng = np.random.default_rng(7)
        body = " ".join(words[i] for i in rng.integers(0, len(words), size=1200))
        text = self.render({"messages": [{"role": "user", "content": body}]}, "chat")
        if text is None:
            text = body
        whole = self._encode(text, False)
        pieces: list[int] = []
        for chunk in self._cut(text, 97):
            pieces.extend(self._encode(chunk, False))
        with_special = self._encode(text, True)
        return pieces == whole and with_special[: len(self._prefix)] == self._prefix \
            and with_special[len(self._prefix):] == whole

    def render(self, body: Mapping[str, Any], endpoint: str) -> str | None:
        """The prompt text the engine tokenizes (chat template applied for chat)."""
        try:
            if endpoint == "chat":
                messages = _messages(body.get("messages") or [])
            elif endpoint == "responses":
                inp = body.get("input")
                messages = ([{"role": "user", "content": inp}] if isinstance(inp, str)
                            else _messages(inp or []))
                if isinstance(body.get("instructions"), str):
                    messages.insert(0, {"role": "system", "content": body["instructions"]})
            else:
                return None
            return self._tok.apply_chat_template(
                messages, tools=body.get("tools") or None, add_generation_prompt=True,
                tokenize=False)
        except Exception:  # a template may reject a conversation; the lookup then misses
            return None

    @staticmethod
    def _cut(text: str, every: int) -> Iterator[str]:
        """``text`` in pieces, each cut right before a single space between two non-spaces, at
        or after ``every`` characters (where a pre-tokenizer starts a word: ``foo| bar``)."""
        start = 0
        while start < len(text):
            m = _WORD_START.search(text, start + every)
            if m is None:
                yield text[start:]
                return
            yield text[start:m.start()]
            start = m.start()

    def _memoised(self, text: str) -> array.array | None:
        """The memo is shared with `PreciseCache.warm`'s thread, so each step tolerates the
        other thread having moved or dropped the entry."""
        ids = self._memo.get(text)
        if ids is not None:
            with contextlib.suppress(KeyError):
                self._memo.move_to_end(text)
        return ids

    def _memoise(self, text: str, ids: array.array) -> None:
        memo = self._memo
        memo[text] = ids
        if len(memo) > MEMO_CHUNKS:
            with contextlib.suppress(KeyError):
                memo.popitem(last=False)

    def _piece(self, piece: str, memoise: bool) -> Chunk:
        ids = self._memoised(piece)
        if ids is not None:
            return ids, len(piece), 0
        ids = array.array("l", self._encode(piece, False))
        if memoise:
            self._memoise(piece, ids)
        return ids, len(piece), len(ids)

    def _chunks(self, text: str) -> Iterator[Chunk]:
        """``text``'s ids a chunk at a time, from the memo where it has them. The first chunk it
        has not is tokenized in pieces of a quarter chunk, lazily, so a walk that stops inside it
        (most walks stop at their first fresh chunk) pays for the pieces it needs only; once
        tokenized to its end it is memoised whole. Later fresh chunks are tokenized whole (a long
        walk: per-piece overhead would cost it a quarter more). The text's last chunk is memoised
        as its pieces instead: a conversation's next turn extends it, so that chunk comes back
        longer, and only its pieces match."""
        cuts = self._cut(text, self.chunk_chars)
        chunk = next(cuts, None)
        fresh_before = False
        while chunk is not None:
            after = next(cuts, None)
            ids = self._memoised(chunk)
            if ids is not None:
                yield ids, len(chunk), 0
            elif after is None:
                for piece in self._cut(chunk, self.chunk_chars // 4):
                    yield self._piece(piece, memoise=True)
            elif fresh_before:
                yield self._piece(chunk, memoise=True)
            else:
                fresh_before = True
                whole = array.array("l")
                for piece in self._cut(chunk, self.chunk_chars // 4):
                    ids, chars, fresh = self._piece(piece, memoise=False)
                    whole.extend(ids)
                    yield ids, chars, fresh
                self._memoise(chunk, whole)
            chunk = after

    def token_chunks(self, f: RequestFeatures) -> Iterator[Chunk]:
        if f.endpoint is None or f.body is None:
            return
        body = f.body
        special = False
        if f.endpoint == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                yield list(prompt), 0, 0  # token ids: the engine runs them as given
                return
            text = prompt[0] if isinstance(prompt, list) and prompt else prompt
            if isinstance(text, list):  # a batch of token-id prompts: its first, as with text
                yield list(text), 0, 0
                return
            if not isinstance(text, str):
                return
            special = True
        else:
            text = self.render(body, f.endpoint)
            if text is None:
                return
        # Characters counted as the router counts the prompt (``prompt_chars``): a chat
        # template's markup is no part of it, and counted in, a conversation of short turns
        # looked cached beyond its end.
        scale = f.prompt_chars / len(text) if text else 1.0
        if not self.chunked:
            ids = self._encode(text, special)
            yield ids, round(len(text) * scale), len(ids)
            return
        if special:
            yield self._prefix, 0, 0
        for ids, chars, fresh in self._chunks(text):
            yield ids, round(chars * scale), fresh


def load_tokenizer(name: str, chars_per_token: float) -> PromptTokenizer:
    """`tokenizer:` of the fleet file: ``sim`` or a local model directory."""
    if name == SIM:
        return SimTokenizer(chars_per_token)
    return HFTokenizer(name)
