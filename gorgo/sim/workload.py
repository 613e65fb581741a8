"""A trace slice prepared once for many offline runs: arrivals, request features, output lengths.

Features are what the router parses from each request body; building them (synthetic prompt text
plus chained block hashes) costs far more than routing, so a bench builds them once and every run
reuses the same immutable objects. Runs differ only in the time scale applied to the arrivals,
the policy and the seed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gorgo.core.features import RequestFeatures, extract_features, token_count
from gorgo.core.fleet import FleetSpec, Limits
from gorgo.core.tokens import Tokenization
from gorgo.sim.lookahead import LOOKAHEAD, lookahead_factory
from gorgo.sim.offline import SimResult, Simulation
from gorgo.sim.oracle import oracle_factory
from gorgo.sim.routers import SAME
from gorgo.sim.traces import TraceRequest, load_trace

ORACLE = "oracle"
# The bounds: simulation-only policies built on the run's engines (and trace), not the registry.
BOUNDS = {ORACLE: oracle_factory, LOOKAHEAD: lookahead_factory}
CHAT_PATH = "/v1/chat/completions"
MODEL = "sim"


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order; ``arrivals`` are seconds from the first one, in trace time."""

    trace: str
    arrivals: np.ndarray
    features: tuple[RequestFeatures, ...]
    output_tokens: tuple[int, ...]
    # Turns that wait for their answers (`TURNS_OPTION`): the position of the request each one
    # continues, whose answer must have ended before it is sent; None: every request at its time.
    follows: tuple[int | None, ...] | None = None

    @property
    def n(self) -> int:
        return len(self.features)

    @property
    def span_s(self) -> float:
        return float(self.arrivals[-1] - self.arrivals[0]) if self.n else 0.0

    @property
    def mean_rate_rps(self) -> float:
        """Mean arrival rate at time scale 1: requests per second between first and last arrival."""
        if self.n < 2 or self.span_s <= 0:
            raise ValueError(f"{self.trace}: need two or more distinct arrival times for a rate")
        return (self.n - 1) / self.span_s

    @property
    def mean_prompt_tokens(self) -> float:
        return float(np.mean([f.prompt_tokens for f in self.features])) if self.n else 0.0

    def scale_for_rate(self, rate_rps: float) -> float:
        """Factor on the arrival times that makes the mean arrival rate ``rate_rps``."""
        return self.mean_rate_rps / rate_rps

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (sharing the feature objects)."""
        return replace(self, arrivals=self.arrivals[:n], features=self.features[:n],
                       output_tokens=self.output_tokens[:n],
                       follows=None if self.follows is None else self.follows[:n])


def build_workload(trace: str, tok: Tokenization, requests: int | None = None) -> Workload:
    """Load ``trace`` (a `load_trace` spec), keep the first ``requests`` and parse each body."""
    reqs = load_trace(trace)
    return workload_from_requests(trace, reqs[:requests] if requests is not None else reqs, tok)


# What a replayed client sends as max_tokens (`gorgo bench sim` and `gorgo replay`, `--trace
# NAME:[...,]max_tokens=`): EXACT, the request's own output length (the traces' replay, and the
# default); None, no bound; or one cap N for every request, which cuts an output longer than N to
# N. The engine always generates the output (cut at the cap), never the bound: only what the
# router is told changes (live, the replay tells the simulated engine in `SIM_OUTPUT_KEY`).
EXACT = "exact"
BOUND_OPTION = "max_tokens"
ClientBound = int | str | None


def parse_client_bound(value: str) -> ClientBound:
    """``exact``, ``none`` or a cap of 1 to the largest ``max_tokens`` a request may ask for;
    ValueError otherwise."""
    v = value.strip().lower()
    if v in (EXACT, "none"):
        return EXACT if v == EXACT else None
    n = token_count(v)
    if n is None:
        raise ValueError(f"{BOUND_OPTION}={value!r}: expected exact, none or a number of tokens "
                         f"from 1 to {Limits().max_output_tokens}")
    return n


# How a replayed client sends a conversation's turns (`--trace NAME:[...,]turns=`): OPEN, each at
# its trace time (the default: a follow-up may leave before the answer it continues has ended,
# 24.7-81.8 % of `chat`'s at loads 0.5-0.95, docs/simulator.md); CLOSED, no earlier than that
# answer's end, as a person in a chat does (the traces that mark turns: `chat`).
TURNS_OPTION, OPEN, CLOSED = "turns", "open", "closed"


def split_client(trace: str) -> tuple[str, ClientBound, bool]:
    """``trace`` without the client's options (``max_tokens=``, ``turns=``: the loaders do not
    know them), the bound it names (EXACT when absent) and whether its turns are CLOSED."""
    name, sep, rest = trace.partition(":")
    if not sep or "=" not in rest:
        return trace, EXACT, False
    items = rest.split(",")
    kept: list[str] = []
    given: dict[str, list[str]] = {BOUND_OPTION: [], TURNS_OPTION: []}
    for item in items:
        key, _, value = item.partition("=")
        if key.strip() in given:
            given[key.strip()].append(value)
        else:
            kept.append(item)
    for key, values in given.items():
        if len(values) > 1:
            raise ValueError(f"{trace}: {key} given {len(values)} times")
    turns = [v.strip().lower() for v in given[TURNS_OPTION]]
    if turns and turns[0] not in (OPEN, CLOSED):
        raise ValueError(f"{TURNS_OPTION}={given[TURNS_OPTION][0]!r}: expected {OPEN} or {CLOSED}")
    bound = parse_client_bound(given[BOUND_OPTION][0]) if given[BOUND_OPTION] else EXACT
    base = trace if len(kept) == len(items) else (f"{name}:{','.join(kept)}" if kept else name)
    return base, bound, turns == [CLOSED]


def with_client_bound(body: dict[str, Any], bound: ClientBound) -> dict[str, Any]:
    """``body`` (whose max_tokens is the request's output) as a client sending ``bound`` writes
    it."""
    if bound is None:
        body.pop("max_tokens", None)
    elif bound != EXACT:
        body["max_tokens"] = bound
    return body


def generated(output_tokens: int, bound: ClientBound) -> int:
    """The output the engine generates for a request of ``output_tokens`` whose client sends
    ``bound``: cut at a cap."""
    return min(output_tokens, bound) if isinstance(bound, int) else output_tokens


def workload_from_requests(
    name: str, reqs: Sequence[TraceRequest], tok: Tokenization, bound: ClientBound = EXACT,
    closed: bool = False,
) -> Workload:
    """Parse each request's chat body as the router would; ``name`` labels the workload,
    ``bound`` is the max_tokens its client sends (see EXACT), ``closed`` whether its turns wait
    for their answers (a turn whose previous one is not among ``reqs`` is sent at its time)."""
    if not reqs:
        raise ValueError(f"{name}: no requests")
    follows = None
    if closed:
        require_marked_turns(name, reqs)
        at = {r.index: k for k, r in enumerate(reqs)}
        follows = tuple(None if r.follows is None else at.get(r.follows) for r in reqs)
    outputs = [generated(r.output_tokens, bound) for r in reqs]
    bodies = (with_client_bound(r.chat_body(tok, MODEL), bound) for r in reqs)
    features = tuple(
        extract_features(CHAT_PATH, {}, json.dumps(body).encode(), tok) for body in bodies)
    arrivals = np.array([r.arrival_s for r in reqs], dtype=float)
    return Workload(
        trace=name,
        arrivals=arrivals - arrivals[0],
        features=features,
        output_tokens=tuple(outputs),
        follows=follows,
    )


def require_marked_turns(name: str, reqs: Sequence[TraceRequest]) -> None:
    """ValueError unless some of ``reqs`` continue another (`TraceRequest.follows`): closed
    turns on a trace that marks none would silently replay it open."""
    if not any(r.follows is not None for r in reqs):
        raise ValueError(f"{name}: {TURNS_OPTION}={CLOSED} needs a trace that marks its turns "
                         "(chat)")


def refuse_with_closed_turns(policy: str) -> None:
    """ValueError for a policy that cannot run on turns that wait for their answers: the
    lookahead bound rolls the trace's next arrivals forward at their trace times, and a turn held
    for its answer leaves later (its index of the arrivals then ran past its end)."""
    if policy.startswith(LOOKAHEAD):
        raise ValueError(f"{policy} rolls the trace's arrivals forward at their own times, and a "
                         f"turn held for its answer leaves later: leave it out with "
                         f"{TURNS_OPTION}={CLOSED}")


def tokenization(spec: FleetSpec) -> Tokenization:
    return Tokenization(spec.chars_per_token, spec.block_tokens)


def simulate(
    spec: FleetSpec, policy: str, workload: Workload, scale: float, seed: int,
    routers: int = 1, placement: str = SAME,
) -> SimResult:
    """One offline run with the arrivals multiplied by ``scale``, behind ``routers`` routers
    placed as ``placement`` says (`sim.routers`).

    The fleet is renamed per seed because policies seed their own generators from the fleet name
    (random does): the seed then changes the link jitter and every policy RNG together.
    """
    if workload.follows is not None:
        refuse_with_closed_turns(policy)
    spec = replace(spec, name=f"{spec.name}/seed{seed}")
    factory = BOUNDS.get(policy)
    sim = Simulation(spec, policy, seed=seed, policy_factory=factory, routers=routers,
                     placement=placement)
    return sim.run((workload.arrivals * scale).tolist(), workload.features, workload.output_tokens,
                   follows=workload.follows)
