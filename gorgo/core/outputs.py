"""How many tokens a request will generate, learned from what the engines report.

The decode and interference terms price a request's output. A client's ``max_tokens`` is a
bound, not a length: some clients send the length they want (a batch job, the replay of a
trace), most send a generous cap (4,096 for every request) or none, and the engine stops at
end of sequence long before it. Taken at face value, a cap of 4,096 priced every request at
4,096 tokens of decoding and made the decode terms drown the first-token ones (Mooncake x
`paper` at load 0.8: E2E p95 +5-6 % against the exact lengths; docs/results.md, "What the
client's max_tokens tells the router").

The engines count what they generate: vLLM's ``vllm:generation_tokens_total`` and
``vllm:request_success_total``, SGLang's ``sglang:generation_tokens_total`` and
``sglang:num_requests_total``. Between two scrapes their increments give the tokens generated
per finished request; summed over the model's replicas and decayed (half-life
`HALF_LIFE_REQS` finished requests) that is the typical output ``L`` (vLLM's
``vllm:request_generation_tokens`` histogram, whose sum and count are of the same finished
requests, is read first where the page has it: the counters also count the tokens of aborted
requests, which finish as no success). The
router also keeps the typical bound ``B`` of the requests it routes that set one, and the share
of those that set none. Then a request's expected output is

    no max_tokens:     L
    max_tokens m:      min(m, max(r * m, L)),   r = min(L / B, 1)

When bounds are the lengths, L = B and the estimate is m itself (r of at least `EXACT_RATIO`
reads as 1: the two sums are of different requests); when they are one cap,
r * m = L; when they are caps of several sizes, a small cap is still a bound and a large one
counts as r of itself. ``L`` and ``B`` compare only when (nearly) every request sets a bound:
where more than `MIXED_SHARE` of the routed requests set none, ``L`` is also theirs, and a bound
stands as given. Until `MIN_REQS` requests have been counted on either side, ``m`` (else the decode
term's ``output_tokens`` parameter) stands as before.

An increment no engine could have generated (more tokens than its finished, running and waiting
requests could hold at the largest output a request may ask for: a duplicated series, a counter
gone wild) is no sample: it is skipped and the counters re-read from there
(`FleetState._count_outputs`), or one page could price every request at 10^16 tokens for tens of
thousands of requests.

One estimate per model (`FleetOutputs`): a model's replicas learn it from their engines'
counters and the bounds of the requests routed to them. Models served together on one replica
share theirs (its engine's counters mix them), and a fleet that lists no models has one. (One
estimate for the whole fleet priced a model of long answers and a busier one of short answers
both at the mix: 2,000 and 100 tokens a request, three requests of the short one to one of the
long, made both 575.) A reload keeps each model's estimate by its name, wherever its replicas
now are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

HALF_LIFE_REQS = 500.0  # the estimates follow a change of traffic within a few hundred requests
MIN_REQS = 20.0  # counted (decayed) requests before an estimate is used
MAX_COUNTER = 2.0**63  # an engine's counter is read within [0, this]
# L / B at or above this reads as bounds that are the lengths: the counters include the partial
# outputs of running requests and the bounds are of requests sent later than those finished, so
# exact bounds measure 0.9-1.1, caps far below.
EXACT_RATIO = 0.8
MIXED_SHARE = 0.1  # routed requests without a bound above this share: L and B do not compare


class OutputModel:
    """Decayed sums of tokens generated per finished request (from the engines' counters) and of
    the bounds routed requests set (from this router's requests)."""

    __slots__ = ("bound_n", "bound_sum", "finished", "generated", "unbounded_n")

    def __init__(self) -> None:
        self.generated = 0.0  # tokens the engines generated, decayed per finished request
        self.finished = 0.0  # requests they finished, decayed alike
        self.bound_sum = 0.0  # max_tokens of routed requests that set it, decayed per request
        self.bound_n = 0.0
        self.unbounded_n = 0.0  # routed requests that set none, decayed alike

    @classmethod
    def merged(cls, models: Sequence[OutputModel]) -> OutputModel:
        """One model holding the sums of ``models`` (none: a fresh one)."""
        new = cls()
        for m in models:
            for attr in cls.__slots__:
                setattr(new, attr, getattr(new, attr) + getattr(m, attr))
        return new

    def observe(self, generated: float, finished: float) -> None:
        """The engines generated ``generated`` tokens and finished ``finished`` requests since
        their previous scrape (one replica's counters' increments)."""
        if not (finished >= 0.0 and generated >= 0.0) or finished + generated == 0.0:
            return
        keep = math.exp2(-finished / HALF_LIFE_REQS)
        self.generated = self.generated * keep + generated
        self.finished = self.finished * keep + finished

    def sent(self, max_tokens: int | None) -> None:
        """A routed request set ``max_tokens`` (None: no bound)."""
        keep = math.exp2(-1.0 / HALF_LIFE_REQS)
        self.bound_sum *= keep
        self.bound_n *= keep
        self.unbounded_n *= keep
        if max_tokens is None:
            self.unbounded_n += 1.0
        else:
            self.bound_sum += max_tokens
            self.bound_n += 1.0

    def typical(self) -> float | None:
        """Tokens a finished request generated, on average (None until `MIN_REQS`)."""
        return self.generated / self.finished if self.finished >= MIN_REQS else None

    def typical_bound(self) -> float | None:
        """The max_tokens of routed requests that set one, on average (None: none yet)."""
        return self.bound_sum / self.bound_n if self.bound_n > 0 else None

    def expected(self, max_tokens: int | None) -> float | None:
        """The output tokens to price for a request that set ``max_tokens`` (None: no bound);
        None when nothing is known yet (no bound, and no typical output reported)."""
        typical = self.typical()
        if max_tokens is None:
            return typical
        if (typical is None or self.bound_n < MIN_REQS
                or self.unbounded_n > MIXED_SHARE * (self.bound_n + self.unbounded_n)):
            return float(max_tokens)
        r = typical * self.bound_n / self.bound_sum if self.bound_sum > 0 else 1.0
        if r >= EXACT_RATIO:
            return float(max_tokens)
        return min(float(max_tokens), max(r * max_tokens, typical))


def output_groups(names: Sequence[Sequence[str]]) -> np.ndarray:
    """Each replica's estimate, from the model names it serves (aliases included): replicas that
    share a name share one (transitively); a fleet that lists no models has one."""
    parent = list(range(len(names)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, served in enumerate(names):
        for name in served:
            parent[root(i)] = root(first.setdefault(name, i))
    if not any(names):
        return np.zeros(len(names), dtype=np.int64)
    roots = [root(i) for i in range(len(names))]
    index = {r: k for k, r in enumerate(dict.fromkeys(roots))}
    return np.array([index[r] for r in roots], dtype=np.int64)


class FleetOutputs:
    """An `OutputModel` per model (`output_groups`): a replica's counters and the bounds routed to
    it teach its model's. The estimates come back per replica (one value when the fleet has
    one estimate, the usual case, so nothing is spent on arrays there)."""

    __slots__ = ("group", "models", "served")

    def __init__(self, names: Sequence[Sequence[str]]) -> None:
        """``names``: the model names each replica serves (aliases included; none listed: every
        replica serves everything, one estimate)."""
        self.group = output_groups(names)
        self.models = [OutputModel() for _ in range(int(self.group.max(initial=0)) + 1)]
        self.served: dict[str, int] = {n: int(self.group[i]) for i, ns in enumerate(names)
                                       for n in ns}  # model name -> its estimate

    def of(self, i: int) -> OutputModel:
        """Replica i's model's estimate."""
        return self.models[self.group[i]]

    def observe(self, i: int, generated: float, finished: float) -> None:
        """Replica i's engine generated and finished so many since its previous scrape."""
        self.of(i).observe(generated, finished)

    def sent(self, i: int, max_tokens: int | None) -> None:
        """A request that set ``max_tokens`` (None: no bound) was routed to replica i."""
        self.of(i).sent(max_tokens)

    def expected(self, max_tokens: int | None) -> float | np.ndarray | None:
        """`OutputModel.expected` on each replica's model (None, or NaN for a replica, where
        nothing is known)."""
        return self._each([m.expected(max_tokens) for m in self.models])

    def typical(self) -> float | np.ndarray | None:
        """`OutputModel.typical` on each replica's model (None, or NaN: not yet known)."""
        return self._each([m.typical() for m in self.models])

    def typical_bound(self) -> float | np.ndarray | None:
        """`OutputModel.typical_bound` on each replica's model (None, or NaN: none yet)."""
        return self._each([m.typical_bound() for m in self.models])

    def _each(self, values: list[float | None]) -> float | np.ndarray | None:
        if len(values) == 1:
            return values[0]
        return np.array([math.nan if v is None else v for v in values])[self.group]

    def reindexed(self, names: Sequence[Sequence[str]]) -> FleetOutputs:
        """The estimates for a reloaded fleet whose replicas serve ``names``: each model keeps
        what it had learned, wherever its replicas now are (the names it serves, summed where
        a replica now ties several; a model new to the fleet starts fresh). Where either fleet
        lists no models, what was learned is every model's."""
        new = FleetOutputs(names)
        for k in range(len(new.models)):
            if self.served and new.served:
                old = {self.served[n] for n, g in new.served.items()
                       if g == k and n in self.served}
            else:
                old = set(range(len(self.models)))
            new.models[k] = OutputModel.merged([self.models[g] for g in sorted(old)])
        return new
