"""Why a request would go where it goes: every replica's cost terms and the winner's margin.

Explaining must not change routing: the policy decides on a deep copy (its counters, cursors,
caches and random generators stay put), the fleet state's clock is restored, and nothing is
counted in flight.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from gorgo.core.cost import cost_terms
from gorgo.core.decision import NoReplicaAvailable, Rejection
from gorgo.core.features import RequestFeatures
from gorgo.core.router import Router
from gorgo.core.terms import TERMS


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
        cols = ("replica", "region", "healthy", *(t.field for t in TERMS), "uncached_tokens",
                "predicted_ttft_ms", "policy_score")
        lines = [" ".join(f"{c:>{max(9, len(c))}}" for c in cols)]
        for row in sorted(self.rows, key=lambda r: r["policy_score"]):
            mark = " <" if row["replica"] == self.winner else ""
            lines.append(" ".join(f"{_fmt(row[c]):>{max(9, len(c))}}" for c in cols) + mark)
        return "\n".join([f"policy: {self.policy}", *lines, "", self.reason])


def _fmt(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def explain(router: Router, f: RequestFeatures, now: float) -> Explanation:
    s = router.state
    live = router.policy_for(f)
    # The copy shares the fleet spec (immutable) but nothing the policy mutates.
    policy = copy.deepcopy(live, {id(live.spec): live.spec, id(s): s})
    was = s.now
    s.now = now
    refused: Rejection | None = None
    try:
        mask = router.admissible(f)  # the replicas routing would consider, as Router.route
        if isinstance(mask, Rejection):
            refused, mask = mask, None
        s.candidates, s.model_settings = mask, router.settings_for(f)
        terms = cost_terms(f, s)
        weights, _ = s.scoring()
        total = terms.total(weights, latency_only=True)  # as the decision predicts it
        if refused is None:
            refused = router.shed_check(f, total)  # as `route` sheds it
        winner: int | None = None
        scores = np.full(s.n, np.inf)
        if refused is None:
            try:
                d = policy.choose(f, s)
                winner = d.replica
                scores = d.scores if d.scores is not None else total
            except NoReplicaAvailable:
                pass
    finally:
        s.now = was
        s.candidates = s.model_settings = None
    rows = [
        {
            "replica": s.names[i],
            "region": s.regions[s.region_idx[i]],
            "healthy": bool(s.healthy[i]),
            **{t.field: float(terms[t.name][i]) for t in TERMS},
            "uncached_tokens": int(terms.uncached_tokens[i]),
            "predicted_ttft_ms": float(total[i]),
            "policy_score": float(scores[i]),
            "inflight_requests": int(s.inflight_reqs[i]),
        }
        for i in range(s.n)
    ]
    reason = (f"the router refuses it ({refused.status}): {refused.message}" if refused
              else _reason(s.names, terms, total, scores, winner, policy.name))
    return Explanation(policy.name, None if winner is None else s.names[winner], reason, rows)


def _reason(names, terms, total, scores, winner, policy: str) -> str:
    if winner is None:
        return "no replica is routable (ejected, draining, or not serving the model)"
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
    diffs = {t.name: float(terms[t.name][r] - terms[t.name][winner]) for t in TERMS}
    biggest = max(diffs, key=lambda t: diffs[t])
    parts = ", ".join(f"{t} {v:+.1f} ms" for t, v in diffs.items())
    return (f"{names[winner]} wins: predicted {total[winner]:.1f} ms vs {names[r]} "
            f"{total[r]:.1f} ms (runner-up costs {parts}; mostly {biggest})")
