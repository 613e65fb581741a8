"""A continuous-batching LLM engine as a pure model: no I/O and no clock, time is passed in.

The live engine server (asyncio) and the offline discrete-event simulator both drive it the same
way: ``submit`` requests as they arrive, then call ``step(now)`` while ``has_work()``; each call
runs one batch step starting at ``now`` and returns how long it takes and what happens at its end.

Scheduling follows SGLang/vLLM with chunked prefill: a FCFS waiting queue; a request is admitted
when a step has prefill budget left, fewer than ``max_running`` requests run and the KV cache can
hold it (its cached prefix is looked up and pinned at admission, the rest of its prompt plus
``max_tokens`` is reserved, so it never has to be preempted). Each step prefills up to
``prefill_chunk_tokens`` uncached prompt tokens, oldest request first, and decodes one token for
every request whose prefill finished in an earlier step. A request whose prefill completes in a
step gets its first token at the end of that step. After ``max_tokens`` tokens it finishes and its
full prompt blocks stay in the cache, unreferenced and evictable.

Fast-forward: ``step(now, max_decode_steps=k, horizon=t)`` may fold up to k steps into one result
when nothing can change the batch in between (no prefill pending, nothing admissible waiting, no
request finishing before the last folded step, no step starting at or after ``horizon``, which the
caller sets to its next external event). The state and times it produces are identical to k calls
of ``step``: durations are the same per-step formula summed.
"""

from __future__ import annotations

import bisect
import copy
import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from gorgo.core.kv_events import REMOVED, STORED, KVEvent
from gorgo.core.tokens import Tokenization
from gorgo.sim.kv_cache import PrefixKVCache
from gorgo.sim.profiles import EngineProfile

WAITING, PREFILLING, DECODING = 0, 1, 2


class EngineRejected(Exception):
    """``submit`` refused a request; ``status`` is the HTTP status an engine would answer."""

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True, slots=True)
class EngineRequest:
    rid: Hashable
    prompt_tokens: int
    block_hashes: np.ndarray  # uint64 chained hashes of the prompt's full blocks
    max_tokens: int
    arrival: float
    # The prompt's token ids, for the KV events of an engine that publishes them (their
    # block_hashes are then the engine's own, gorgo.core.block_hashes).
    token_ids: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class FirstToken:
    rid: Hashable
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True, slots=True)
class Finished:
    rid: Hashable
    completion_tokens: int
    reason: str  # "length": max_tokens reached


@dataclass(slots=True)
class StepResult:
    """One step (or ``steps`` folded decode steps) and the events at its end.

    Every request in ``decoded`` received ``steps`` new tokens, one at the end of each step; for a
    request in ``first_tokens`` the first of them is its first token, produced at ``first_end``
    (the end of the first step). Requests in ``finished`` finished at ``end``.
    """

    start: float
    end: float  # start plus the summed step times, each already divided by the engine's speed
    first_end: float  # end of the first step (equals ``end`` unless steps were folded)
    steps: int = 1
    prefill_tokens: int = 0
    first_tokens: list[FirstToken] = field(default_factory=list)
    decoded: list[Hashable] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def tokens(self) -> int:
        return self.steps * len(self.decoded)


# Upper edges (s) of the inter-token latency histogram, as engines export it (+Inf last).
ITL_BUCKETS_S = (0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    num_waiting: int
    num_running: int  # admitted: prefilling or decoding
    num_decoding: int
    kv_usage: float  # tokens held by requests / capacity (evictable cache counts as free)
    cache_usage: float  # tokens held including evictable cached blocks / capacity
    waiting_prompt_tokens: int  # prompt tokens of the waiting queue
    pending_prefill_tokens: int  # uncached prompt tokens admitted requests still have to prefill
    prompt_tokens_total: int  # of requests whose prefill completed
    cached_tokens_total: int  # of those, tokens served from the prefix cache
    generated_tokens_total: int
    requests_finished: int
    finished_generated_total: int  # tokens the finished requests generated (vLLM's histogram sum)
    requests_cancelled: int
    requests_rejected: int
    steps_total: int
    busy_time_s: float  # sum of step durations
    # Inter-token gaps of decoding requests (each token after a request's first), as the
    # engines' inter-token latency histograms count them: their sum and count.
    itl_sum_s: float = 0.0
    itl_count: int = 0
    itl_buckets: tuple[int, ...] = ()  # gaps per ITL_BUCKETS_S bucket (+Inf last), not cumulative


class _Req:
    __slots__ = (
        "arrival", "cached", "generated", "hashes", "held", "max_tokens", "prefilled",
        "private", "prompt_tokens", "rid", "state", "token_ids",
    )

    def __init__(self, req: EngineRequest, hashes: list[int]) -> None:
        self.rid = req.rid
        self.prompt_tokens = req.prompt_tokens
        self.max_tokens = req.max_tokens
        self.arrival = req.arrival
        self.hashes = hashes
        self.token_ids = req.token_ids
        self.state = WAITING
        self.cached = 0  # prompt tokens matched in the cache at admission
        self.prefilled = 0  # prompt tokens in KV (cached + computed)
        self.held = 0  # hashes[:held] are pinned by this request
        self.private = 0  # private tokens reserved in the cache
        self.generated = 0

    def copy(self) -> _Req:
        r = _Req.__new__(_Req)
        for k in _Req.__slots__:
            setattr(r, k, getattr(self, k))
        return r


class Engine:
    """Continuous batching with chunked prefill over a prefix KV cache (see module docstring)."""

    def __init__(
        self, profile: EngineProfile, tokenization: Tokenization, speed: float = 1.0,
        kv_events: bool = False,
    ) -> None:
        if not speed > 0:
            raise ValueError("speed must be > 0")
        self.profile = profile
        self.tokenization = tokenization
        self.speed = speed
        self.block_tokens = tokenization.block_tokens
        capacity = max(profile.kv_capacity_tokens, self.block_tokens)
        self.cache = PrefixKVCache(capacity, self.block_tokens)
        # vLLM's KV events since the last take_kv_events(): blocks stored (newly cached, one event
        # per request's run of them) and removed (evicted), in the order they happened.
        self._kv_log: list[KVEvent] | None = [] if kv_events else None
        self._removed: list[int] = []  # evicted since the last event logged
        if kv_events:
            self.cache.on_remove = self._log_removed
        self._reqs: dict[Hashable, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._prefilling: list[_Req] = []  # admitted, prefill incomplete, admission order
        self._decoding: list[_Req] = []
        self._head_blocked = False  # the waiting head cannot be admitted until capacity frees
        self._decode_ctx = 0  # KV tokens the decoding batch reads per step
        self._unused_reserved = 0  # reserved generation tokens not yet generated
        self._waiting_tokens = 0
        self._pending_prefill = 0
        self._prompt_total = 0
        self._cached_total = 0
        self._generated_total = 0
        self._finished = 0
        self._finished_generated = 0
        self._cancelled = 0
        self._rejected = 0
        self._steps = 0
        self._busy = 0.0
        self._itl_sum = 0.0
        self._itl_count = 0
        self._itl_hist = [0] * (len(ITL_BUCKETS_S) + 1)

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, req: EngineRequest, now: float) -> None:
        """Queue a request; raises EngineRejected (400 too large, 503 queue full)."""
        if req.rid in self._reqs:
            raise ValueError(f"duplicate request id {req.rid!r}")
        if req.prompt_tokens < 1 or req.max_tokens < 1:
            self._rejected += 1
            raise EngineRejected("prompt and max_tokens must each be at least 1 token", 400)
        total = req.prompt_tokens + req.max_tokens
        if total > self.cache.capacity_tokens:
            self._rejected += 1
            raise EngineRejected(
                f"This model's KV cache holds {self.cache.capacity_tokens} tokens. However, you "
                f"requested {total} tokens ({req.prompt_tokens} in the prompt, {req.max_tokens} "
                "for the completion).",
                400,
            )
        if len(self._waiting) >= self.profile.max_queue:
            self._rejected += 1
            raise EngineRejected("The request queue is full; try again later.", 503)
        n_blocks = min(len(req.block_hashes), req.prompt_tokens // self.block_tokens)
        r = _Req(req, np.asarray(req.block_hashes[:n_blocks], dtype=np.uint64).tolist())
        self._reqs[req.rid] = r
        if not self._waiting:
            self._head_blocked = False
        self._waiting.append(r)
        self._waiting_tokens += r.prompt_tokens

    def cancel(self, rid: Hashable) -> bool:
        """Drop a request (its client went away) and free what it holds; False if unknown."""
        r = self._reqs.pop(rid, None)
        if r is None:
            return False
        self._cancelled += 1
        self._head_blocked = False
        if r.state == WAITING:
            self._waiting.remove(r)
            self._waiting_tokens -= r.prompt_tokens
            return True
        if r.state == PREFILLING:
            self._prefilling.remove(r)
            self._pending_prefill -= r.prompt_tokens - r.prefilled
        else:
            self._decoding.remove(r)
            self._decode_ctx -= r.prompt_tokens + r.generated
        self._release(r)
        return True

    def clone(self) -> Engine:
        """An independent copy of the whole state, for a lookahead that rolls it forward and
        throws it away (`sim.lookahead`): the requests and the cache are copied (block hashes and
        token ids are shared, never mutated); the copy logs no KV events."""
        e = copy.copy(self)
        e.cache = self.cache.clone()
        e._kv_log = None
        e._removed = []
        reqs = {rid: r.copy() for rid, r in self._reqs.items()}
        e._reqs = reqs
        e._waiting = deque(reqs[r.rid] for r in self._waiting)
        e._prefilling = [reqs[r.rid] for r in self._prefilling]
        e._decoding = [reqs[r.rid] for r in self._decoding]
        e._itl_hist = list(self._itl_hist)
        return e

    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._decoding)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._reqs

    # -- scheduling -------------------------------------------------------------------------------
    def _admit(self, r: _Req) -> bool:
        """Pin the request's cached prefix and reserve the rest of its KV; False if it won't fit."""
        cache = self.cache
        bt = self.block_tokens
        # An engine must compute at least the last prompt token to get logits, and it caches
        # whole blocks only: a fully cached prompt recomputes its last block.
        m = min(cache.match(r.hashes), (r.prompt_tokens - 1) // bt)
        matched = r.hashes[:m]
        need = r.prompt_tokens - m * bt + r.max_tokens
        if not cache.can_reserve(need, cache.unreferenced_tokens(matched)):
            return False
        cache.pin(matched)
        cache.reserve(need)
        r.held = m
        r.cached = r.prefilled = m * bt
        r.private = need
        r.state = PREFILLING
        self._unused_reserved += r.max_tokens
        self._pending_prefill += r.prompt_tokens - r.cached
        return True

    def _release(self, r: _Req) -> None:
        self.cache.unpin(r.hashes[: r.held])
        self.cache.release(r.private)
        self._unused_reserved -= r.max_tokens - r.generated
        r.held = r.private = 0
        self._head_blocked = False

    def _schedule_prefill(self) -> list[tuple[_Req, int]]:
        """This step's prefill chunks: running prefills first, then newly admitted requests."""
        budget = self.profile.prefill_chunk_tokens
        chunks: list[tuple[_Req, int]] = []
        for r in self._prefilling:
            if budget <= 0:
                break
            n = min(r.prompt_tokens - r.prefilled, budget)
            chunks.append((r, n))
            budget -= n
        waiting = self._waiting
        max_running = self.profile.max_running
        while budget > 0 and waiting and not self._head_blocked:
            if len(self._prefilling) + len(self._decoding) >= max_running:
                self._head_blocked = True
                break
            r = waiting[0]
            if not self._admit(r):
                self._head_blocked = True
                break
            waiting.popleft()
            self._waiting_tokens -= r.prompt_tokens
            self._prefilling.append(r)
            n = min(r.prompt_tokens - r.prefilled, budget)
            chunks.append((r, n))
            budget -= n
        return chunks

    def step(
        self, now: float, max_decode_steps: int = 1, horizon: float = math.inf
    ) -> StepResult:
        """Run one batch step from ``now`` (or fold several decode steps, see module docstring)."""
        chunks = self._schedule_prefill()
        decoding = self._decoding
        n_dec = len(decoding)
        if not chunks and not n_dec:
            return StepResult(start=now, end=now, first_end=now, steps=0)

        prefill_tokens = 0
        ctx = self._decode_ctx
        for r, n in chunks:
            prefill_tokens += n
            ctx += r.prefilled + n
        profile = self.profile
        speed = self.speed
        duration = profile.step_time_s(prefill_tokens, n_dec, ctx) / speed
        end = now + duration

        # Decode: every request already decoding gets one token, ``duration`` after its last.
        self._count_gaps(duration, n_dec)
        decoded = [r.rid for r in decoding]
        for r in decoding:
            r.generated += 1
        self._decode_ctx += n_dec
        new_tokens = n_dec

        # Prefill chunks land; completed prompts produce their first token.
        first: list[FirstToken] = []
        completed: list[_Req] = []
        cache = self.cache
        bt = self.block_tokens
        for r, n in chunks:
            r.prefilled += n
            self._pending_prefill -= n
            full = min(r.prefilled // bt, len(r.hashes))
            if full > r.held:
                stored = [k for k in range(r.held, full) if cache.commit_block(r.hashes[k])]
                if stored and self._kv_log is not None:
                    self._log_stored(r, stored)
                if len(stored) < full - r.held:  # shared another's copy: its own space is freed
                    self._head_blocked = False
                elif stored and self._head_blocked and self._waiting:
                    # the waiting head's cached prefix grew (a request of the same prompt):
                    # it needs less, so it is tried again, as the engines try it every step
                    head = self._waiting[0].hashes
                    if len(head) > stored[0] and head[stored[0]] == r.hashes[stored[0]]:
                        self._head_blocked = False
                r.private -= (full - r.held) * bt
                r.held = full
            if r.prefilled == r.prompt_tokens:
                r.generated = 1
                r.state = DECODING
                completed.append(r)
                first.append(FirstToken(r.rid, r.prompt_tokens, r.cached))
                decoded.append(r.rid)
                self._prompt_total += r.prompt_tokens
                self._cached_total += r.cached
                self._decode_ctx += r.prompt_tokens + 1
                new_tokens += 1
        if completed:
            self._prefilling = [r for r in self._prefilling if r.state == PREFILLING]
            decoding.extend(completed)
        self._unused_reserved -= new_tokens
        self._generated_total += new_tokens

        steps = 1
        first_end = end
        if (
            max_decode_steps > 1
            and not self._prefilling
            and (not self._waiting or self._head_blocked)
            and not any(r.generated >= r.max_tokens for r in decoding)
        ):
            extra, end = self._fast_forward(max_decode_steps - 1, end, horizon)
            steps += extra
            if extra:  # folded decode steps: their mean length, once per token
                self._count_gaps((end - first_end) / extra, len(decoding) * extra)

        finished = self._finish_done() if decoding else []
        self._steps += steps
        self._busy += end - now
        return StepResult(now, end, first_end, steps, prefill_tokens, first, decoded, finished)

    def _count_gaps(self, gap_s: float, tokens: int) -> None:
        """``tokens`` inter-token gaps of ``gap_s`` each, into the ITL sum, count and histogram."""
        self._itl_sum += gap_s * tokens
        self._itl_count += tokens
        self._itl_hist[bisect.bisect_left(ITL_BUCKETS_S, gap_s)] += tokens

    def _fast_forward(self, limit: int, start: float, horizon: float) -> tuple[int, float]:
        """Fold pure decode steps while nothing can change the batch; returns (steps, end time).

        The end time is accumulated step by step, exactly as a caller stepping one at a time would.
        """
        decoding = self._decoding
        n = len(decoding)
        limit = min(limit, min(r.max_tokens - r.generated for r in decoding))
        profile = self.profile
        speed = self.speed
        ctx = self._decode_ctx
        t = start
        k = 0
        while k < limit and t < horizon:
            t += profile.step_time_s(0, n, ctx) / speed
            ctx += n
            k += 1
        if k:
            for r in decoding:
                r.generated += k
            self._decode_ctx = ctx
            self._unused_reserved -= k * n
            self._generated_total += k * n
        return k, t

    def _finish_done(self) -> list[Finished]:
        done = [r for r in self._decoding if r.generated >= r.max_tokens]
        if not done:
            return []
        self._decoding = [r for r in self._decoding if r.generated < r.max_tokens]
        out = []
        for r in done:
            self._decode_ctx -= r.prompt_tokens + r.generated
            self._release(r)
            del self._reqs[r.rid]
            self._finished += 1
            self._finished_generated += r.generated
            out.append(Finished(r.rid, r.generated, "length"))
        return out

    # -- KV events ------------------------------------------------------------------------------
    def _log_stored(self, r: _Req, blocks: list[int]) -> None:
        """BlockStored events for the blocks (indices into ``r.hashes``) this step cached: one per
        consecutive run, its parent the block before it, as vLLM reports a request's new blocks."""
        assert self._kv_log is not None
        self._flush_removed()
        bt = self.block_tokens
        ids = r.token_ids
        runs: list[list[int]] = []
        for k in blocks:
            if runs and runs[-1][-1] == k - 1:
                runs[-1].append(k)
            else:
                runs.append([k])
        for run in runs:
            k0, k1 = run[0], run[-1] + 1
            tokens = () if ids is None else tuple(ids[k0 * bt : k1 * bt].tolist())
            self._kv_log.append(KVEvent(STORED, tuple(r.hashes[k0:k1]),
                                        r.hashes[k0 - 1] if k0 else None, tokens, bt))

    def _log_removed(self, block_hash: int) -> None:
        self._removed.append(block_hash)

    def _flush_removed(self) -> None:
        if self._removed and self._kv_log is not None:
            self._kv_log.append(KVEvent(REMOVED, tuple(self._removed)))
            self._removed = []

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call (none unless built with ``kv_events``)."""
        self._flush_removed()
        if not self._kv_log:
            return []
        out, self._kv_log = self._kv_log, []
        return out

    # -- observation ------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        cache = self.cache
        cap = cache.capacity_tokens
        return EngineMetrics(
            num_waiting=len(self._waiting),
            num_running=len(self._prefilling) + len(self._decoding),
            num_decoding=len(self._decoding),
            # what the engines' gauges count: blocks allocated a chunk at a time, so neither the
            # output not generated yet nor the prompt not prefilled yet
            kv_usage=(cache.pinned_tokens - self._unused_reserved - self._pending_prefill) / cap,
            cache_usage=(cache.used_tokens - self._unused_reserved - self._pending_prefill) / cap,
            waiting_prompt_tokens=self._waiting_tokens,
            pending_prefill_tokens=self._pending_prefill,
            prompt_tokens_total=self._prompt_total,
            cached_tokens_total=self._cached_total,
            generated_tokens_total=self._generated_total,
            requests_finished=self._finished,
            finished_generated_total=self._finished_generated,
            requests_cancelled=self._cancelled,
            requests_rejected=self._rejected,
            steps_total=self._steps,
            busy_time_s=self._busy,
            itl_sum_s=self._itl_sum,
            itl_count=self._itl_count,
            itl_buckets=tuple(self._itl_hist),
        )

    def cached_prefix_tokens(
        self, block_hashes: np.ndarray, prompt_tokens: int | None = None
    ) -> int:
        """Tokens of the longest cached prefix of ``block_hashes``.

        Given ``prompt_tokens`` it is what admission would serve from cache right now, which keeps
        at least the last prompt token to compute.
        """
        m = self.cache.match(np.asarray(block_hashes, dtype=np.uint64).tolist())
        if prompt_tokens is not None:
            m = min(m, max(0, prompt_tokens - 1) // self.block_tokens)
        return m * self.block_tokens


def idle_latencies(
    profile: EngineProfile, tokenization: Tokenization, prompt_tokens: int, cached_tokens: int = 0
) -> tuple[float, float]:
    """(TTFT, ITL) in seconds of one request alone on an idle engine.

    ``cached_tokens`` (rounded down to whole blocks) are made resident first by a warm-up request
    that shares the prefix.
    """
    eng = Engine(profile, tokenization)
    bt = tokenization.block_tokens
    n_blocks = prompt_tokens // bt
    hashes = np.arange(1, n_blocks + 1, dtype=np.uint64)
    warm = cached_tokens // bt
    t = 0.0
    if warm:
        eng.submit(EngineRequest("warm", warm * bt, hashes[:warm], 1, t), t)
        while eng.has_work():
            t = eng.step(t).end
    eng.submit(EngineRequest("probe", prompt_tokens, hashes, 2, t), t)
    start = t
    ttft = itl = 0.0
    while eng.has_work():
        res = eng.step(t)
        t = res.end
        if res.first_tokens:
            ttft = t - start
        elif res.decoded:
            itl = res.duration
    return ttft, itl
