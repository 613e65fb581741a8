"""Rendezvous (highest-random-weight) hashing over numpy arrays, shared by the hashing policies.

Each replica has a salt derived from its name, not its position, so adding, removing or ejecting
one replica moves only the keys that replica owned: every other key keeps its winner. A key and
a salt are mixed with splitmix64, which is cheap on uint64 arrays and spreads nearby inputs
across the whole range, so one mix per replica gives an independent-looking uniform draw.
"""

from __future__ import annotations

import numpy as np

from gorgo.core.features import RequestFeatures, stable_hash
from gorgo.core.fleet import FleetSpec
from gorgo.core.hashing import splitmix64

_S11 = np.uint64(11)
_TWO_M53 = 2.0**-53


def replica_salts(spec: FleetSpec) -> np.ndarray:
    """One stable 64-bit salt per replica, from its name."""
    raw = np.array([stable_hash(r.name) for r in spec.replicas], dtype=np.uint64)
    return splitmix64(raw)


def request_key(f: RequestFeatures) -> int:
    """The affinity key: the session when the client names one, else the prompt's head."""
    return stable_hash(f.session_key) if f.session_key else f.head_hash


def uniforms(key: int, salts: np.ndarray) -> np.ndarray:
    """A uniform draw in (0, 1) per replica, fixed for this key and replica."""
    k = splitmix64(np.array([key & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    h = splitmix64(salts ^ k)
    return ((h >> _S11).astype(float) + 0.5) * _TWO_M53


def rendezvous_scores(key: int, salts: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Weighted rendezvous scores ``-ln(u) / w``; the lowest wins (inf where ``w == 0``).

    ``-ln(u)`` is Exp(1), and the minimum of independent Exp(w_i) variables falls on replica i
    with probability ``w_i / sum(w)``: over many keys traffic splits by weight, while any one key
    keeps its replica for as long as the weights do not change. Without weights this is plain
    highest-random-weight hashing (the lowest ``-ln(u)`` is the highest ``u``).
    """
    e = -np.log(uniforms(key, salts))
    if weights is None:
        return e
    with np.errstate(divide="ignore"):
        return np.where(weights > 0, e / weights, np.inf)
