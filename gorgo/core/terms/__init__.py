"""The registry of cost terms, in the order they are reported.

Adding a term: write its module (a `CostTerm` named ``TERM``), add it to ``TERMS`` and describe it
in docs/architecture.md. Everything else (the total, decision fields, span tags, admin validation,
explain, the tuner's samples, search space and fit) iterates over this tuple.
"""

from __future__ import annotations

from gorgo.core.terms import (
    admission,
    congestion,
    decode,
    interference,
    penalty,
    prefill,
    queue,
    reuse,
    rtt,
)
from gorgo.core.terms.base import (
    ANCHOR,
    E2E,
    EXCLUDED,
    FIXED,
    FREE,
    OBJECTIVES,
    SLO,
    TTFT,
    CostTerm,
)

TERMS: tuple[CostTerm, ...] = (
    rtt.TERM, queue.TERM, admission.TERM, prefill.TERM, congestion.TERM, penalty.TERM,
    decode.TERM, interference.TERM, reuse.TERM)
BY_NAME: dict[str, CostTerm] = {t.name: t for t in TERMS}
# Terms that carry a weight, keyed by weight name (what Weights holds).
WEIGHTED: dict[str, CostTerm] = {t.weight: t for t in TERMS if t.weight is not None}


def weight_keys(objective: str) -> tuple[str, ...]:
    """The weights that matter under ``objective`` (what a tuner for it searches)."""
    return tuple(k for k, t in WEIGHTED.items() if objective in t.objectives)

__all__ = ["ANCHOR", "BY_NAME", "E2E", "EXCLUDED", "FIXED", "FREE", "OBJECTIVES", "SLO", "TERMS",
           "TTFT",
           "WEIGHTED", "CostTerm", "weight_keys"]
