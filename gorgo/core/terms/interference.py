"""interference: the delay this request adds to the requests already decoding on the replica.

Each of the ``batch_i`` requests there loses, while they overlap (on average half this request's
expected output), the per-step cost of one more sequence of this request's length; and every one
of them stalls once for this request's uncached prefill chunks:

    batch_i * (out / 2) * (choices * per_seq + per_kctx * context / 1000) * slowdown_i
    + batch_i * uncached_i * prefill_ms_per_token_i

(``choices``: the sequences it decodes, `n` per prompt; ``context``: their prompts and half
their output, summed; a prompt is prefilled once).

A greedy choice on the request's own latency piles requests on the replica that looks fastest
and slows everything decoding there; this term prices that. Its weight (default 0.25, the best
compromise of 0.05-1 across the project's traces, docs/results.md) says how much of the others'
delay a request is charged: 1 counts every other request's time like its own.

The `e2e` and `slo` objectives count this term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import E2E, EXCLUDED, SLO, CostTerm
from gorgo.core.terms.decode import batch, expected_output, own_context, slowdown

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState


def _interference(f: RequestFeatures, s: FleetState) -> np.ndarray:
    p = s.params["decode"]
    out = expected_output(f, s)
    n = batch(s)
    # each of the request's sequences (`n` per prompt) is one more in every step; a prompt
    # fills once
    per_seq = p["itl_per_seq_ms"] if f.choices == 1 else f.choices * p["itl_per_seq_ms"]
    marginal = per_seq + p["itl_per_kctx_ms"] * own_context(f, out) / 1000
    stall = s.uncached_tokens(f) * (1000.0 / s.prefill_rate)
    return n * (out / 2) * marginal * slowdown(s) + n * stall


TERM = CostTerm(
    name="interference", doc="delay this request adds to the requests decoding there",
    compute=_interference, weight="interference", default=0.25, bounds=(0.05, 20.0),
    fit=EXCLUDED, objectives=frozenset({E2E, SLO}),
)
