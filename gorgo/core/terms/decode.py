"""decode: the time this request will spend decoding on the replica.

A replica runs one batch step per generated token; a step costs about

    itl = base + per_seq * batch + per_kctx * context_tokens / 1000       (ms)

(the step-time shape of docs/simulator.md: a fixed forward pass, a share per decoding sequence,
attention over the KV cache in use), so the term is ``out * itl_i(batch_i + choices)``, with
``batch_i`` the sequences decoding there (this router's count, or the engine's own running and
waiting requests when a fresh scrape says more), ``choices`` this request's own (`n` per
prompt), ``context`` every sequence's prompt tokens plus half its expected output, and ``out``
the expected output length: the request's ``max_tokens`` (a completion's default is the API's
16) read as the bound it is, against the output the engines report (`gorgo.core.outputs`);
without either, the ``output_tokens`` parameter. A replica whose prefill rate is below the
fleet's fastest is assumed to decode as much slower. While the request decodes, the replica takes
in the prompts that keep arriving, and under chunked prefill their chunks ride in its decode
steps: the term is stretched by ``1 + share_i``, the share of i's time its prefill takes
(`prefill_share`: the uncached tokens booked there per second over its prefill rate, at most
0.9). First order on purpose: the queueing factor ``1 / (1 - share)``
herds requests onto whichever replica looked idle and was measured worse (docs/results.md).
The constants are per replica (``FleetState.params["decode"]``); their defaults are an H100
running an 8B model. (Calibrating
them from the engines' inter-token latency histograms was tried and measured worse: under chunked
prefill most decode steps carry prefill chunks, so the engines' gaps mostly price prefill, which
the `interference` term already counts; docs/results.md.) What this request costs the requests
already decoding there is the `interference` term.

The `e2e` and `slo` objectives count this term (TTFT does not include decoding); `slo` also
compares ``predicted_itl`` (stretched the same) with the request's time-per-output-token
target, and `admission` prices the wait for a batch slot with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gorgo.core.terms.base import E2E, EXCLUDED, SLO, CostTerm

if TYPE_CHECKING:
    from gorgo.core.features import RequestFeatures
    from gorgo.core.state import FleetState

PARAMS = {"itl_base_ms": 6.0, "itl_per_seq_ms": 0.03, "itl_per_kctx_ms": 0.04,
          "output_tokens": 256.0}
PREFILL_SHARE_MAX = 0.9  # the booked load is an estimate: a replica is never priced past 1.9x


def expected_output(f: RequestFeatures, s: FleetState) -> np.ndarray | float:
    """Output tokens expected (one value when the fleet has one model's estimate): from the
    request's max_tokens (0: a prompt's logprobs only, `echo`) and the engines' typical output
    of each replica's model (`OutputModel.expected`), else the parameter per replica."""
    return _or_parameter(s.outputs.expected(f.max_tokens), s)


def typical_output(s: FleetState) -> np.ndarray | float:
    """Output tokens of a typical request of each replica's model (one already running): what
    the engines report, else the parameter."""
    return _or_parameter(s.outputs.typical(), s)


def _or_parameter(out: np.ndarray | float | None, s: FleetState) -> np.ndarray | float:
    """``out``, the ``output_tokens`` parameter where it is unknown (None, or NaN per replica)."""
    if out is None:
        return s.params["decode"]["output_tokens"]
    if isinstance(out, np.ndarray):
        return np.where(np.isnan(out), s.params["decode"]["output_tokens"], out)
    return out


def own_context(f: RequestFeatures, out: np.ndarray | float) -> np.ndarray | float:
    """KV context the request's own sequences attend over, summed, halfway through their
    output: each of a prompt's `n` sequences over that prompt and its output so far."""
    if f.choices == 1:
        return f.prompt_tokens + out / 2
    return f.context_tokens + (f.choices / 2) * out


def batch(s: FleetState) -> np.ndarray:
    """Sequences decoding per replica: ours, or the engine's own count when fresher and larger
    (engines count each of a request's `n` sequences as a running request)."""
    return s.derived("decode.batch", _batch)


def _batch(s: FleetState) -> np.ndarray:
    ours = s.inflight_seqs.astype(float)
    fresh = (s.now - s.eng_scraped_at) <= s.spec.signals.metrics_stale_s
    # A replica never scraped holds NaN counts, but is never fresh: `where` drops them.
    engine = s.eng_running_reqs + s.eng_queue_reqs
    return np.where(fresh, np.maximum(ours, engine), ours)


def slowdown(s: FleetState) -> np.ndarray:
    """How much slower than the fastest of the request's candidates (its model's replicas, while
    one is scored) each replica computes (prefill as the proxy): the decode constants are that
    replica's, and another model's hardware is no reference (one fast replica of another model
    made every replica of this one 20x slower)."""
    if s.candidates is not None and s.candidates.any():
        rate = s.prefill_rate
        return rate[s.candidates].max() / rate
    return s.derived("decode.slowdown", _slowdown)


def _slowdown(s: FleetState) -> np.ndarray:
    return s.prefill_rate.max() / s.prefill_rate


def predicted_itl(f: RequestFeatures, s: FleetState) -> np.ndarray:
    """Milliseconds per output token this request would see on each replica (its TPOT); its
    ``choices`` sequences decode side by side, all in the batch, in steps stretched by the
    prefill the replica takes in meanwhile (`prefill_share`): the SLO objective's TPOT and
    the admission term's wait for a slot see the same steps as this term."""
    p = s.params["decode"]
    out = expected_output(f, s)
    n = batch(s)
    context = s.inflight_context + n * out / 2 + own_context(f, out)
    itl = (p["itl_base_ms"] + p["itl_per_seq_ms"] * (n + f.choices)
           + p["itl_per_kctx_ms"] * context / 1000)
    return itl * slowdown(s) * (1.0 + prefill_share(s))


def prefill_share(s: FleetState) -> np.ndarray:
    """The share of each replica's time its prefill takes, from what is booked there: the
    uncached tokens per second (`FleetState.prefill_booked`) over its prefill rate, at most
    PREFILL_SHARE_MAX."""
    return s.derived("decode.prefill_share", _prefill_share)


def _prefill_share(s: FleetState) -> np.ndarray:
    return np.minimum(s.prefill_booked() / s.prefill_rate, PREFILL_SHARE_MAX)


def _decode(f: RequestFeatures, s: FleetState) -> np.ndarray:
    return expected_output(f, s) * predicted_itl(f, s)


TERM = CostTerm(
    name="decode", doc="this request's own decode time on the replica", compute=_decode,
    weight="decode", default=1.0, bounds=(0.05, 20.0), fit=EXCLUDED,
    objectives=frozenset({E2E, SLO}), params=PARAMS,
)
