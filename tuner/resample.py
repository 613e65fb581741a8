"""Circular block resampling: requests of one burst queue together, so a resample keeps runs of
consecutive arrivals together instead of passing a burst off as independent evidence."""

from __future__ import annotations

import numpy as np


def block_indices(n: int, block: int, reps: int, rng: np.random.Generator) -> np.ndarray:
    """``reps`` rows of ``n`` indices into ``range(n)``, each row drawn as circular blocks of
    ``block`` consecutive indices (the last one cut to length)."""
    length = min(block, n)
    k = -(-n // length)
    starts = rng.integers(0, n, size=(reps, k))
    return ((starts[:, :, None] + np.arange(length)) % n).reshape(reps, k * length)[:, :n]
