"""Why a request would go where it goes: every replica's cost terms and the winner's margin.

Explaining must not change routing, so the policy decides on a shallow copy (its counters and
cursors stay put) and nothing is counted in flight.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from gorgo.core.cost import cost_terms
from gorgo.core.decision import NoReplicaAvailable
from gorgo.core.features import RequestFeatures
from gorgo.core.router import Router

TERMS = ("rtt_ms", "queue_ms", "prefill_ms", "penalty_ms")


@dataclass(frozen=True, slots=True)
class Explanation:
    policy: str
    winner: str | None
    reason: str
    rows: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "winner": self.winner, "reason": self.reason,
                "replicas": self.rows}

    def table(self) -> str:
        cols = ("replica", "region", "healthy", "rtt_ms", "queue_ms", "prefill_ms",
                "penalty_ms", "uncached_tokens", "predicted_ttft_ms", "policy_score")
        lines = [" ".join(f"{c:>{max(9, len(c))}}" for c in cols)]
        for row in sorted(self.rows, key=lambda r: r["policy_score"]):
            mark = " <" if row["replica"] == self.winner else ""
            lines.append(" ".join(f"{_fmt(row[c]):>{max(9, len(c))}}" for c in cols) + mark)
        return "\n".join([f"policy: {self.policy}", *lines, "", self.reason])


def _fmt(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def explain(router: Router, f: RequestFeatures, now: float) -> Explanation:
    s = router.state
    s.now = now
    policy = copy.copy(router.policy_for(f))
    terms = cost_terms(f, s)
    total = terms.total(s.weights)
    try:
        d = policy.choose(f, s)
        winner: int | None = d.replica
        scores = d.scores if d.scores is not None else total
    except NoReplicaAvailable:
        winner, scores = None, np.full(s.n, np.inf)
    rows = [
        {
            "replica": s.names[i],
            "region": s.regions[s.region_idx[i]],
            "healthy": bool(s.healthy[i]),
            "rtt_ms": float(terms.rtt_ms[i]),
            "queue_ms": float(terms.queue_ms[i]),
            "prefill_ms": float(terms.prefill_ms[i]),
            "penalty_ms": float(terms.penalty_ms[i]),
            "uncached_tokens": int(terms.uncached_tokens[i]),
            "predicted_ttft_ms": float(total[i]),
            "policy_score": float(scores[i]),
            "inflight_requests": int(s.inflight_reqs[i]),
        }
        for i in range(s.n)
    ]
    return Explanation(policy.name, None if winner is None else s.names[winner],
                       _reason(s.names, terms, total, scores, winner, policy.name), rows)


def _reason(names, terms, total, scores, winner, policy: str) -> str:
    if winner is None:
        return "no replica is routable (all ejected)"
    finite = np.flatnonzero(np.isfinite(scores))
    others = [i for i in finite[np.argsort(scores[finite], kind="stable")] if i != winner]
    if not others:
        return f"{names[winner]} is the only routable replica"
    r = others[0]
    if scores[r] <= scores[winner] + 1e-9 * max(1.0, abs(scores[winner])):
        return (f"{names[winner]} ties with {names[r]} at score {scores[winner]:.3g}; "
                "ties rotate so no replica is favoured")
    if policy not in ("gorgo",):
        return (f"{names[winner]} wins under {policy} with score {scores[winner]:.3g} "
                f"against {names[r]}'s {scores[r]:.3g}")
    diffs = {t: float(getattr(terms, t)[r] - getattr(terms, t)[winner]) for t in TERMS}
    biggest = max(diffs, key=lambda t: diffs[t])
    parts = ", ".join(f"{t[:-3]} {v:+.1f} ms" for t, v in diffs.items())
    return (f"{names[winner]} wins: predicted {total[winner]:.1f} ms vs {names[r]} "
            f"{total[r]:.1f} ms (runner-up costs {parts}; mostly {biggest[:-3]})")
