"""admission: the wait for a free running slot on a replica at its concurrency limit.

An engine runs at most ``max_running`` requests at once (vLLM's ``--max-num-seqs``, SGLang's
``--max-running-requests``); a request that arrives when they are all taken waits in the engine's
queue, not for prefill but for running requests to finish. With ``batch_i`` requests in flight
there, ``k = batch_i + 1 - max_running`` of them must finish first (a request of `n`
sequences needs one slot for its first token: the engine queues the others behind it); running
requests finish at about ``max_running / (out * itl_i)`` per ms (each holds its slot for its
decode time), so

    wait_i = max(k, 0) * out * itl_i / max_running

with ``out`` the typical output length (the running requests' lengths, not this one's: what the
engines report, else the decode term's ``output_tokens``) and ``itl_i`` the decode term's predicted
inter-token latency. The `queue` term prices only prompt tokens waiting for prefill, so without this
term a replica whose slots are full looks free. Measured on the Azure conversation trace, where the
paper's fleet (64 slots per replica) fills them in bursts: gorgo's p95 TTFT went from 1.17x to 0.92x
cache-aware's on fleet `paper` at load 0.8 (docs/results.md); traces that never fill the slots
(Mooncake, `chat`) route as before.

A TTFT term, unweighted like `prefill` (it is a prediction in milliseconds, not an estimate to
scale). Set ``max_running`` per replica in the fleet file (``params: {admission: {max_running:
64}}``); the default is vLLM's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import FIXED, CostTerm
from gorgo.core.terms.decode import batch, predicted_itl, typical_output

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState

PARAMS = {"max_running": 256.0}


def _admission(f: RequestFeatures, s: FleetState) -> np.ndarray:
    slots = s.params["admission"]["max_running"]
    ahead = np.maximum(batch(s) + 1.0 - slots, 0.0)
    if not ahead.any():
        return ahead
    out = typical_output(s)
    return ahead * out * predicted_itl(f, s) / slots


TERM = CostTerm(
    name="admission", doc="wait for a running slot on a replica at its concurrency limit",
    compute=_admission, fit=FIXED, params=PARAMS,
)
