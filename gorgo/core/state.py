"""Fleet state as numpy arrays indexed by replica: what every policy scores from.

Written by the router's accounting (route/complete), the signal tasks (RTT probes, engine metric
scrapes, health) and the tuner's published weights; read by policies. No I/O and no clock: the
caller passes ``now`` (seconds, any monotonic origin) so the simulator can drive it on a virtual
clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from gorgo.core.features import RequestFeatures
from gorgo.core.fleet import FleetSpec, ModelSettings
from gorgo.core.kv_events import KVEvent
from gorgo.core.outputs import MAX_COUNTER, FleetOutputs
from gorgo.core.precise import PreciseCache
from gorgo.core.prefix_index import PrefixIndex
from gorgo.core.terms import TERMS
from gorgo.core.terms.reuse import REUSE_EWMA_ALPHA, cached_tokens
from gorgo.core.tokens import Tokenization
from gorgo.core.weights import Weights

FAILURES_TO_EJECT = 3
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 30.0
DEMAND_TAU_S = 10.0  # time constant of the demand estimate (request rate, prompt size)
# A scraped request count is read within [0, this]: an engine that reports NaN, a negative or an
# absurd count (inf, 1e308) must not turn the cost terms' products into NaN.
MAX_ENGINE_REQS = 1e6
# Per-replica arrays that follow the new fleet file, never the old state (`reindexed`): where a
# replica is, what it is configured to be, and per-request memos.
_PER_SPEC = frozenset({"region_idx", "prefill_rate", "draining", "_match", "_uncached"})


def scraped(value: float, most: float, if_nan: float) -> float:
    """A scraped reading within [0, ``most``], ``if_nan`` for NaN."""
    return min(max(value, 0.0), most) if value == value else if_nan


def _blocks(spec: FleetSpec, i: int) -> int:
    """The prefix blocks replica i's KV pool holds by the fleet file (until its engine says)."""
    return max(1, spec.replicas[i].kv_capacity_tokens // spec.block_tokens)


class FleetState:
    """Per-replica arrays plus the prefix index; one instance per router process."""

    def __init__(self, spec: FleetSpec, *, unbounded_prefix: bool = False) -> None:
        self.spec = spec
        self.tok = Tokenization(spec.chars_per_token, spec.block_tokens, spec.media_tokens)
        n = self.n = len(spec.replicas)
        self.names = [r.name for r in spec.replicas]
        self.index = {name: i for i, name in enumerate(self.names)}
        self.clusters = [r.cluster for r in spec.replicas]
        self.regions = spec.region_names
        self.region_idx = np.array([self.regions.index(r.region) for r in spec.replicas])
        self.weights: Weights = spec.weights
        self.now = 0.0
        # Network: RTT EWMA in ms; NaN until the first probe answers.
        self.rtt_ms = np.full(n, np.nan)
        self.rtt_samples = np.zeros(n, dtype=np.int64)
        # Capacity model: prefill tokens/s per replica (fleet hint, refined by the tuner).
        self.prefill_rate = np.array([r.prefill_rate for r in spec.replicas], dtype=float)
        # Each term's per-replica constants (CostTerm.params): the fleet file's, else defaults.
        self.params: dict[str, dict[str, np.ndarray]] = {
            t.name: {k: np.full(n, float(v)) for k, v in t.params.items()} for t in TERMS}
        for i, r in enumerate(spec.replicas):
            for term, key, value in r.params:
                self.params[term][key][i] = value
        # This router's own accounting of what it has sent.
        self.inflight_reqs = np.zeros(n, dtype=np.int64)
        self.inflight_prompt_tokens = np.zeros(n, dtype=np.int64)
        # The same as the engines' decode batches see it: a request of `n` sequences (or a
        # completions batch) is that many running requests, each attending over its prompt.
        self.inflight_seqs = np.zeros(n, dtype=np.int64)
        self.inflight_context = np.zeros(n, dtype=np.int64)
        # Uncached tokens of the requests still open: no more than these can wait for prefill.
        self.inflight_uncached = np.zeros(n, dtype=np.int64)
        self.backlog_tokens = np.zeros(n)  # uncached prompt tokens waiting for prefill ...
        self.backlog_at = np.zeros(n)  # ... as of this time; it drains at prefill_rate
        self.sent_since_scrape = np.zeros(n)  # uncached tokens routed since the last scrape
        # The engine's view of the same: its queue as last scraped (in tokens, held until the
        # next scrape) plus what this router sent since, which drains at prefill_rate.
        self.eng_queue_tokens = np.zeros(n)  # the scraped queue, as of eng_scraped_at
        self.eng_backlog_tokens = np.zeros(n)  # sent since the scrape, as of eng_backlog_at
        self.eng_backlog_at = np.zeros(n)
        self.mean_uncached = np.full(n, 1000.0)  # EWMA of uncached tokens per request
        # EWMA over routed requests of the share of the prompt already cached on its best
        # replica: how much of what is routed is seen again (the `reuse` term's turns).
        self.reuse_share = 0.0
        # Engine metrics from scrapes; NaN when unknown, with the time they were read.
        self.eng_queue_reqs = np.full(n, np.nan)
        self.eng_running_reqs = np.full(n, np.nan)
        self.eng_kv_usage = np.full(n, np.nan)
        self.eng_scraped_at = np.full(n, -np.inf)
        # The engines' generated-token and finished-request counters as last scraped (NaN: not
        # reported), whose increments teach ``outputs`` the typical output length.
        self.eng_generated = np.full(n, np.nan)
        self.eng_finished = np.full(n, np.nan)
        self.outputs = FleetOutputs([r.model_names for r in spec.replicas])
        # Anomaly penalty in ms (failed responses here, slow-vs-predicted from the tuner), as of
        # ``penalty_at``; it halves every ``penalties.half_life_s``.
        self.penalty_ms = np.zeros(n)
        self.penalty_at = np.zeros(n)
        # Health: routable or not, consecutive failures, and when to try again.
        self.healthy = np.ones(n, dtype=bool)
        self.failures = np.zeros(n, dtype=np.int64)
        self.retry_at = np.zeros(n)
        # Membership: a draining replica takes no new request (its open streams finish).
        self.draining = np.array([r.drain for r in spec.replicas], dtype=bool)
        # Which replicas serve each model name (aliases included); empty when the fleet lists no
        # models. `Router.route` sets ``candidates`` to the request's mask while it is scored.
        self.model_masks = {m: np.array([m in r.model_names for r in spec.replicas], dtype=bool)
                            for m in dict.fromkeys(m for r in spec.replicas
                                                   for m in r.model_names)}
        self.candidates: np.ndarray | None = None
        # Also while a request is scored: its model's settings from the fleet file's ``models:``
        # (None: the fleet's), read through `scoring`.
        self.model_settings: ModelSettings | None = None
        blocks = [_blocks(spec, i) for i in range(n)]
        self.prefix = PrefixIndex(n, None if unbounded_prefix else blocks)
        # The engines' own block sets, for `cache: precise` replicas (None when there is none).
        self.precise = PreciseCache(spec) if any(r.precise for r in spec.replicas) else None
        # Bumped by every writer, so the memos keyed on it (prefix match, uncached tokens, cost
        # terms, `derived`) never go stale: code that writes the arrays directly must bump it.
        self.version = 0
        self.terms_memo: tuple | None = None
        # Demand this router has seen: arrivals and their prompt tokens, each decayed with
        # time constant DEMAND_TAU_S, as of the last arrival (see demand()).
        self._arrivals = 0.0
        self._arrival_tokens = 0.0
        # The same per replica booked, so a model's demand is its replicas' sum (`demand`), and
        # the uncached tokens booked there: the prefill work each takes in (`prefill_booked`).
        self._arrivals_on = np.zeros(n)
        self._arrival_tokens_on = np.zeros(n)
        self._uncached_on = np.zeros(n)
        self._arrivals_at = 0.0
        self._first_arrival: float | None = None
        self._match_for: tuple | None = None
        self._match: np.ndarray = np.zeros(n, dtype=np.int64)
        self._uncached_for: tuple | None = None
        self._uncached: np.ndarray = np.zeros(n, dtype=np.int64)
        self._derived_for: tuple[float, int] | None = None
        self._derived: dict[str, np.ndarray] = {}

    # --- derived per-request and per-replica quantities -------------------------------------

    def matched_blocks(self, features: RequestFeatures) -> np.ndarray:
        """Prefix blocks each replica is believed to cache for this request (memoised)."""
        key = (features, self.version)
        if self._match_for != key:
            self._match = self.prefix.match(features.block_hashes)
            if self.precise is not None:
                self._match = self.precise.overlay(features, self._match,
                                                   self.spec.limits.precise_lookup_tokens)
            self._match_for = key
        return self._match

    def uncached_tokens(self, features: RequestFeatures) -> np.ndarray:
        """Prompt tokens each replica would prefill for this request (memoised like the match;
        several terms read it). An engine computes at least the prompt's last token, so a
        prompt cached whole is prefilled from its last full block on (vLLM and SGLang match
        the prompt less its last token; the simulated engine does the same)."""
        key = (features, self.version)
        if self._uncached_for != key:
            bt = self.spec.block_tokens
            most = max(features.prompt_tokens - 1, 0) // bt
            cached = np.minimum(self.matched_blocks(features), most) * bt
            self._uncached = np.maximum(features.prompt_tokens - cached, 0)
            self._uncached_for = key
        return self._uncached

    def derived(self, name: str, compute: Callable[[FleetState], np.ndarray]) -> np.ndarray:
        """``compute(self)`` once per state version and time: a per-replica quantity that
        several cost terms derive alike (the decode batch, the slowdown). Read-only."""
        key = (self.now, self.version)
        if self._derived_for != key:
            self._derived.clear()
            self._derived_for = key
        out = self._derived.get(name)
        if out is None:
            out = self._derived[name] = compute(self)
        return out

    def rtt_or_default(self) -> np.ndarray:
        """RTT in ms with unprobed replicas priced at the worst known RTT (never as free)."""
        fill = float(np.fmax.reduce(self.rtt_ms, initial=np.nan))  # NaN: none probed yet
        return np.where(np.isnan(self.rtt_ms), fill if fill == fill else 0.0, self.rtt_ms)

    def waiting_tokens(self) -> np.ndarray:
        """Prompt tokens waiting for prefill per replica, at ``self.now``.

        Our own backlog (`own_backlog`). A fresh scrape of the engine queue also counts requests
        other routers sent, so where it is fresh it is used if larger, with what we sent after it
        was read queued behind (`engine_backlog`). What we sent drains at the prefill rate: an
        engine view that only grew until the next scrape (2,500-3,600 tokens above the engines'
        true queues on the Azure trace) made the queue term chase the most recently scraped
        replica. Computed once per state version and time (`derived`): several terms read it.
        """
        return self.derived("waiting_tokens", FleetState._waiting_tokens)

    def _waiting_tokens(self) -> np.ndarray:
        local = self.own_backlog()
        fresh = (self.now - self.eng_scraped_at) <= self.spec.signals.metrics_stale_s
        return np.where(fresh, np.maximum(local, self.engine_backlog()), local)

    def engine_backlog(self, i: int | slice = slice(None)) -> np.ndarray | float:
        """The scraped queue, held until the next scrape, plus what this router sent after it,
        drained at the prefill rate since (`waiting_tokens`). The scraped part is not drained:
        it is the one signal of an engine slower than its hinted rate, which a drain at that
        rate would hide until the tuner's calibration, itself fed by it, caught up."""
        return self.eng_queue_tokens[i] + self._sent_left(i)

    def _sent_left(self, i: int | slice = slice(None)) -> np.ndarray | float:
        """What this router sent since each replica's last scrape, still waiting for prefill."""
        return self._drained(self.eng_backlog_tokens, self.eng_backlog_at, i)

    def own_backlog(self, i: int | slice = slice(None)) -> np.ndarray | float:
        """Uncached tokens this router sent that still wait for prefill, at ``self.now``: booked
        work drains at the prefill rate, and `release_inflight` keeps it within the requests
        still open."""
        return self._drained(self.backlog_tokens, self.backlog_at, i)

    def _drained(self, tokens: np.ndarray, at: np.ndarray, i: int | slice) -> np.ndarray | float:
        """``tokens`` booked as of ``at``, drained at the prefill rate until ``self.now`` (a time
        ahead of it, a scrape read after the last decision, drains nothing)."""
        if isinstance(i, int):  # one replica (a booking): plain floats, no numpy scalars
            elapsed = max(self.now - float(at[i]), 0.0)
            return max(float(tokens[i]) - float(self.prefill_rate[i]) * elapsed, 0.0)
        elapsed = np.maximum(self.now - at[i], 0.0)
        return np.maximum(tokens[i] - self.prefill_rate[i] * elapsed, 0.0)

    def penalty(self) -> np.ndarray:
        """Each replica's anomaly penalty in ms at ``self.now``, decayed."""
        half_life = self.spec.penalties.half_life_s
        age = np.maximum(self.now - self.penalty_at, 0.0)
        return self.penalty_ms * np.exp2(-age / half_life)

    def scoring(self) -> tuple[Weights, str]:
        """The weights and objective the request being scored routes by: its model's fixed ones
        where the fleet file sets them, else the live (tuned) weights and the fleet's objective."""
        m = self.model_settings
        if m is None or m.weights is None:
            return self.weights, self.spec.objective
        return m.weights, m.objective or self.spec.objective

    def routable(self) -> np.ndarray:
        """Healthy, not draining and, while a request is scored, serving its model."""
        ok = self.serving()
        return ok if self.candidates is None else ok & self.candidates

    def serving(self) -> np.ndarray:
        """Healthy and not draining, whatever request is scored: the replicas that take traffic."""
        return self.healthy & ~self.draining

    # --- membership ----------------------------------------------------------------------------

    def reindexed(self, spec: FleetSpec, carried: dict[str, str]) -> FleetState:
        """A state for ``spec`` in which each replica named in ``carried`` (new name -> old name)
        keeps its row of every per-replica array (RTT, scrapes, health, backlog, penalty,
        calibrated prefill rate), its prefix-index entries and its KV capacity; the others
        start fresh, unroutable until probed. Draining and the term params (configured, not
        learned) follow ``spec``. The weights and the demand estimate carry over whole, the
        learned output lengths by model name (`FleetOutputs.reindexed`)."""
        new = FleetState(spec, unbounded_prefix=self.prefix.capacity is None)
        pairs = [(j, self.index[carried[name]]) for j, name in enumerate(new.names)
                 if name in carried]
        dst = np.array([j for j, _ in pairs], dtype=np.int64)
        src = np.array([i for _, i in pairs], dtype=np.int64)
        fresh = set(vars(new))
        for attr, old in vars(self).items():
            if (attr in _PER_SPEC or attr not in fresh or not isinstance(old, np.ndarray)
                    or old.shape[:1] != (self.n,)):
                continue
            getattr(new, attr)[dst] = old[src]
        # A rate still at the old file's hint follows the new hint; a calibrated one stays.
        for j, i in pairs:
            if self.prefill_rate[i] != self.spec.replicas[i].prefill_rate:
                new.prefill_rate[j] = self.prefill_rate[i]
        # An added replica takes requests once its first probe answers: by then Envoy has loaded
        # its cluster too (filesystem CDS), and it has an RTT of its own.
        added = np.ones(new.n, dtype=bool)
        added[dst] = False
        new.healthy[added] = False
        new.prefix = self.prefix.reindexed(
            [self.index[carried[name]] if name in carried else None for name in new.names],
            new.prefix.capacity)
        # So does a prefix capacity still at the old file's `kv_capacity_tokens`: an edit there
        # reached the size check but never the index of an engine that reports none (SGLang).
        if self.prefix.capacity is not None:
            for j, i in pairs:
                if self.prefix.capacity[i] == _blocks(self.spec, i):
                    new.prefix.set_capacity(j, _blocks(spec, j))
        # Weights an admin PUT or the tuner set (version > 0) stand; the file's own follow the
        # file (an edited `weights:` was reloaded "successfully" and never applied, and a
        # restarted worker then ran the new file's weights beside its peers' old ones).
        if self.weights.version > 0:
            new.weights = self.weights
        new.now = self.now
        new.reuse_share = self.reuse_share
        new.outputs = self.outputs.reindexed([r.model_names for r in spec.replicas])
        new._arrivals, new._arrival_tokens = self._arrivals, self._arrival_tokens
        new._arrivals_at, new._first_arrival = self._arrivals_at, self._first_arrival
        new.version = self.version + 1
        return new

    def demand(self) -> tuple[float, float]:
        """(requests/s, mean prompt tokens) arriving at this router, as of ``self.now``: for the
        request's model while one is scored (``candidates``: the arrivals booked on its
        replicas), else for the whole fleet.

        An exponentially decayed count over DEMAND_TAU_S, divided by the window it has actually
        covered so the estimate is unbiased in the first seconds (the window is at least 1 s,
        so a burst at one instant reads as that many requests in a second).
        """
        if self._first_arrival is None:
            return 0.0, 0.0
        arrivals, tokens = self._arrivals, self._arrival_tokens
        if self.candidates is not None:
            arrivals = float(self._arrivals_on[self.candidates].sum())
            tokens = float(self._arrival_tokens_on[self.candidates].sum())
            if arrivals <= 0.0:
                return 0.0, 0.0
        return arrivals * self._per_second(), tokens / arrivals

    def prefill_booked(self) -> np.ndarray:
        """Uncached prompt tokens/s booked on each replica (routed here, or a peer's), as of
        ``self.now``, over `demand`'s window: the prefill work each is taking in. Counted per
        request as booked, so each is charged what it was predicted to prefill (requests/s x a
        running average of the last ~10 requests' uncached size mixed two windows, and lost
        p95 TTFT on Azure's one-region fleet: docs/results.md). A booking
        a retry moves stays counted where it was first booked: moves are rare, and the prefill
        share is an estimate over seconds."""
        if self._first_arrival is None:
            return np.zeros(self.n)
        return self._uncached_on * self._per_second()

    def _per_second(self) -> float:
        """What turns the decayed arrival counts into rates now: their decay since the last
        arrival over the window they have actually covered (at least 1 s)."""
        assert self._first_arrival is not None
        decay = math.exp(-max(self.now - self._arrivals_at, 0.0) / DEMAND_TAU_S)
        elapsed = max(self.now - self._first_arrival, 1.0)
        return decay / (-DEMAND_TAU_S * math.expm1(-elapsed / DEMAND_TAU_S))

    # --- writers ------------------------------------------------------------------------------

    def record_sent(self, i: int, f: RequestFeatures, uncached: int) -> None:
        """A request was routed to replica i: count it in flight and in its prefix cache.
        Called while it is scored: the reuse share is over its model's replicas (another
        model's copy of the same text is no cache of this one's)."""
        if f.prompt_tokens > 0:
            cached = cached_tokens(f, self)
            if self.candidates is not None:
                cached = cached[self.candidates]
            seen = float(cached.max(initial=0)) / f.prompt_tokens
            self.reuse_share += REUSE_EWMA_ALPHA * (seen - self.reuse_share)
        self.outputs.sent(i, f.max_tokens)
        self.book(i, f.block_hashes, f.prompt_tokens, uncached, f.choices,
                  f.context_tokens)

    def book(self, i: int, block_hashes: np.ndarray, prompt_tokens: int, uncached: int,
             seqs: int = 1, context: int | None = None, arrival: bool = True) -> None:
        """A request is open on replica i (routed here, moved here by a retry, or another
        router's, `gorgo.core.peers`): in flight, and its blocks in the prefix views; counted in
        the demand unless it only moved (``arrival`` False: a retry served it elsewhere)."""
        self.prefix.insert(i, block_hashes)
        if self.precise is not None:
            self.precise.sent(i, block_hashes)
        self.add_inflight(i, prompt_tokens, uncached, seqs, context, arrival)

    def unbook(self, i: int, block_hashes: np.ndarray, prompt_tokens: int, uncached: int,
               served: bool = True, seqs: int = 1, context: int | None = None) -> None:
        """`book` undone: the request ended (``served``), or a retry moved it off replica i."""
        self.release_inflight(i, prompt_tokens, uncached, seqs, context)
        if self.precise is not None:
            self.precise.closed(i, block_hashes, served=served)

    def add_inflight(self, i: int, prompt_tokens: int, uncached: int, seqs: int = 1,
                     context: int | None = None, arrival: bool = True) -> None:
        """A request in flight on replica i: ``seqs`` sequences decoding (`n`, a completions
        batch: the engines count each as a running request) over ``context`` prompt tokens
        between them (default: the prompt), its prompt prefilled once."""
        self.version += 1
        self.backlog_tokens[i] = self.own_backlog(i) + uncached
        self.backlog_at[i] = self.now
        self.eng_backlog_tokens[i] = self._sent_left(i) + uncached
        self.eng_backlog_at[i] = self.now
        self.sent_since_scrape[i] += uncached
        self.mean_uncached[i] += 0.1 * (uncached - self.mean_uncached[i])
        self.inflight_reqs[i] += 1
        self.inflight_prompt_tokens[i] += prompt_tokens
        self.inflight_seqs[i] += seqs
        self.inflight_context[i] += prompt_tokens if context is None else context
        self.inflight_uncached[i] += uncached
        if arrival:
            self._note_arrival(i, prompt_tokens, uncached)

    def echo(self, i: int, prompt_tokens: int, uncached: int, copies: int,
             engine_view: bool = True) -> None:
        """``copies`` more requests like one just routed to replica i counted in flight and in
        its backlog (negative: the same taken back), for `gorgo.core.peers.Echoes`; not counted
        as arrivals. ``engine_view`` False leaves out what this router sent since the last
        scrape: an echo taken back after a scrape, which already started that count afresh
        (taking it back there took a request routed since instead)."""
        self.version += 1
        self.inflight_reqs[i] += copies
        self.inflight_prompt_tokens[i] += copies * prompt_tokens
        self.inflight_seqs[i] += copies
        self.inflight_context[i] += copies * prompt_tokens
        self.inflight_uncached[i] += copies * uncached
        self.backlog_tokens[i] = max(float(self.own_backlog(i)) + copies * uncached, 0.0)
        self.backlog_at[i] = self.now
        if engine_view:
            self.eng_backlog_tokens[i] = max(float(self._sent_left(i)) + copies * uncached, 0.0)
            self.eng_backlog_at[i] = self.now
            self.sent_since_scrape[i] = max(self.sent_since_scrape[i] + copies * uncached, 0)

    def _note_arrival(self, i: int, prompt_tokens: int, uncached: int) -> None:
        if self._first_arrival is None:
            self._first_arrival = self.now
        decay = math.exp(-max(self.now - self._arrivals_at, 0.0) / DEMAND_TAU_S)
        self._arrivals = self._arrivals * decay + 1.0
        self._arrival_tokens = self._arrival_tokens * decay + prompt_tokens
        if decay != 1.0:
            self._arrivals_on *= decay
            self._arrival_tokens_on *= decay
            self._uncached_on *= decay
        self._arrivals_on[i] += 1.0
        self._arrival_tokens_on[i] += prompt_tokens
        self._uncached_on[i] += uncached
        self._arrivals_at = max(self.now, self._arrivals_at)

    def release_inflight(self, i: int, prompt_tokens: int, uncached: int = 0,
                         seqs: int = 1, context: int | None = None) -> None:
        """A request's stream ended: it is no longer in flight, and no more than the ``uncached``
        tokens of the requests still open can wait for prefill. A request that ended (refused by
        the engine, cut, or served) waits for nothing, whatever the drain model says, and what is
        left drains on from here."""
        self.version += 1
        self.inflight_reqs[i] -= 1
        self.inflight_prompt_tokens[i] -= prompt_tokens
        self.inflight_seqs[i] -= seqs
        self.inflight_context[i] -= prompt_tokens if context is None else context
        self.inflight_uncached[i] -= uncached
        open_tokens = self.inflight_uncached[i]
        self.backlog_tokens[i] = min(self.own_backlog(i), open_tokens)
        self.backlog_at[i] = self.now
        self.eng_backlog_tokens[i] = min(self._sent_left(i), open_tokens)
        self.eng_backlog_at[i] = self.now
        self.sent_since_scrape[i] = min(self.sent_since_scrape[i], open_tokens)

    def observe_rtt(self, i: int, rtt_ms: float) -> None:
        """An RTT sample of replica i; one that no clock could measure (negative, infinite, NaN)
        is dropped: an infinite RTT priced every replica out (a 503) and broke irb's solver."""
        if not 0.0 <= rtt_ms < math.inf:
            return
        self.version += 1
        alpha = self.spec.signals.rtt_ewma_alpha
        old = self.rtt_ms[i]
        self.rtt_ms[i] = rtt_ms if np.isnan(old) else old + alpha * (rtt_ms - old)
        self.rtt_samples[i] += 1

    def observe_engine(
        self, i: int, now: float, queue_reqs: float, running_reqs: float, kv_usage: float,
        generated: float = math.nan, finished: float = math.nan,
    ) -> None:
        """A scrape of replica i's engine, read at ``now``. An idle engine (nothing waiting or
        running) owes no prefill but for what was sent after it was read: our backlog is cut to
        that (tokens sent since the previous scrape, a bound that errs on the high side). The
        counts are read within [0, MAX_ENGINE_REQS], NaN (which stands for "never scraped") as
        0; the KV use is a share, within [0, 1] (NaN: not reported). ``generated`` and
        ``finished``: the engine's counters of tokens generated and requests finished (NaN: not
        reported): the increments since the previous scrape teach ``outputs``."""
        self.version += 1
        queue_reqs = scraped(queue_reqs, MAX_ENGINE_REQS, 0.0)
        running_reqs = scraped(running_reqs, MAX_ENGINE_REQS, 0.0)
        before = float(self.eng_queue_reqs[i] + self.eng_running_reqs[i])  # NaN: first scrape
        self._count_outputs(i, generated, finished,
                            max(queue_reqs + running_reqs, before if before == before else 0.0))
        if queue_reqs == 0 and running_reqs == 0:
            self.backlog_tokens[i] = min(self.backlog_tokens[i], self.sent_since_scrape[i])
        self.eng_queue_reqs[i] = queue_reqs
        self.eng_running_reqs[i] = running_reqs
        self.eng_kv_usage[i] = scraped(kv_usage, 1.0, math.nan)
        self.eng_scraped_at[i] = now
        self.eng_queue_tokens[i] = queue_reqs * self.mean_uncached[i]
        self.eng_backlog_tokens[i] = 0.0  # what this router sends from now on
        self.eng_backlog_at[i] = now
        self.sent_since_scrape[i] = 0.0

    def _count_outputs(self, i: int, generated: float, finished: float, active: float) -> None:
        """Teach ``outputs`` the increments of replica i's counters since its last scrape. A
        counter that went down is an engine restart: the new values are only a baseline, and
        the approximate view forgets what it believed the engine cached. An
        increment no engine could generate (`gorgo.core.outputs`) is skipped the same way."""
        g = scraped(generated, MAX_COUNTER, math.nan)
        d = scraped(finished, MAX_COUNTER, math.nan)
        if g != g or d != d:
            return
        old_g, old_d = float(self.eng_generated[i]), float(self.eng_finished[i])
        self.eng_generated[i], self.eng_finished[i] = g, d
        if old_g != old_g:  # the first scrape: a baseline
            return
        if g < old_g or d < old_d:  # the engine restarted, its prefix cache empty
            self.prefix.clear(i)
            return
        # every request that could have generated them (finished since, or ``active``: running or
        # waiting at either scrape), each at most the largest output a request may ask for, nor
        # more than the KV pool holds
        most = min(self.spec.limits.max_output_tokens,
                   self.spec.replicas[i].kv_capacity_tokens)
        if g - old_g <= (d - old_d + active) * most:
            self.outputs.observe(i, g - old_g, d - old_d)

    def observe_cache_config(
        self, i: int, block_size: int, capacity_blocks: int, algorithm: str | None = None
    ) -> None:
        """What replica i's engine says of its KV cache (vLLM's cache_config_info): the
        approximate view is bounded by its real capacity, the precise one hashes its way."""
        self.version += 1
        self.prefix.set_capacity(i, capacity_blocks * block_size // self.spec.block_tokens)
        if self.precise is not None:
            self.precise.configure(i, block_size, algorithm)

    def apply_kv_events(self, i: int, events: tuple[KVEvent, ...] | list[KVEvent]) -> None:
        """One batch of replica i's KV events (precise replicas only)."""
        if self.precise is not None:
            self.version += 1
            self.precise.apply(i, events)

    def expire_pending(self, now: float) -> None:
        """End the precise view's holds on closed requests' blocks that are over (the tick)."""
        if self.precise is not None and self.precise.tick(now):
            self.version += 1

    def set_kv_synced(self, i: int, synced: bool, clear: bool = False) -> None:
        """Whether replica i's event stream is whole (else it is looked up approximately);
        ``clear`` first forgets its block set (an engine restart, a gap the replay cannot fill)."""
        if self.precise is not None:
            self.version += 1
            if clear:
                self.precise.clear(i)
            self.precise.set_synced(i, synced)

    def set_weights(
        self, weights: Weights, prefill_rate: dict[str, float | None] | None = None
    ) -> None:
        """New weights and prefill rates; a rate of None goes back to the fleet file's hint."""
        self.version += 1
        self.weights = weights
        for name, rate in (prefill_rate or {}).items():
            i = self.names.index(name)
            self.prefill_rate[i] = self.spec.replicas[i].prefill_rate if rate is None else rate

    # --- health ------------------------------------------------------------------------------

    def record_success(self, i: int) -> None:
        """A probe answered: replica i is healthy (re-admitted if it was ejected)."""
        self.version += 1
        self.failures[i] = 0
        self.healthy[i] = True
        self.retry_at[i] = 0.0

    def record_good_response(self, i: int) -> None:
        """A 2xx or 4xx answer from replica i: its failures start over, while it is healthy.

        An ejected replica is re-admitted by its probes alone: an answer to a request routed
        before the ejection (a draining engine's, or one whose health path fails while serving
        still works) put it back on at once, taking new requests while /health still failed.
        """
        if self.healthy[i]:
            self.version += 1
            self.failures[i] = 0

    def add_penalty(self, i: int, ms: float, now: float) -> None:
        """Add to replica i's decaying penalty (a failed response, or a tuner's anomaly)."""
        self.version += 1
        half_life = self.spec.penalties.half_life_s
        decayed = self.penalty_ms[i] * 2.0 ** (-max(now - self.penalty_at[i], 0.0) / half_life)
        self.penalty_ms[i] = decayed + ms
        self.penalty_at[i] = now

    def record_failed_response(self, i: int, now: float) -> None:
        """A 5xx or failed connection from replica i: penalise it and count towards ejection.

        Once it is ejected only probes count: answers to requests routed before the ejection keep
        arriving (a stalled stream ends at the idle timeout), and each would otherwise double the
        backoff and push back the probe that re-admits the replica.
        """
        self.add_penalty(i, self.spec.penalties.error_ms, now)
        if self.healthy[i]:
            self.record_failure(i, now)

    def record_failed_probe(self, i: int, now: float) -> None:
        """A failed health probe: priced at once, counts towards ejection and, while ejected,
        doubles the backoff."""
        self.add_penalty(i, self.spec.penalties.error_ms, now)
        self.record_failure(i, now)

    def record_failure(self, i: int, now: float) -> None:
        """A failed probe or a 5xx/connect failure; repeated failures eject with backoff."""
        self.version += 1
        self.failures[i] += 1
        excess = self.failures[i] - FAILURES_TO_EJECT
        if excess >= 0:
            self.healthy[i] = False
            self.retry_at[i] = now + min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** excess)

    def probe_due(self, now: float) -> np.ndarray:
        """Replicas to probe now: healthy ones always, ejected ones once their backoff passed, and
        every one while none is routable: backoff spares the healthy ones a flapping replica's
        traffic, and with none healthy there is no traffic to spare, so the first replica back
        is re-admitted within one probe interval."""
        if not self.serving().any():  # a draining replica takes no traffic
            return np.ones(self.n, dtype=bool)
        return self.healthy | (now >= self.retry_at)

