"""Figures of `gorgo bench sim`: TTFT CDFs per load and p95 TTFT against load, as PNG files.

Matplotlib runs on the Agg backend (no display on servers and in CI). Failed requests are part of
the CDF's population at +inf, so a policy that drops requests never reaches 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported: no display on servers
import matplotlib.pyplot as plt
import numpy as np

EMPHASIS = {"gorgo": {"color": "black", "linewidth": 2.2}, "oracle": {"linestyle": "--"}}


def _styles(policies: Sequence[str]) -> dict[str, dict[str, Any]]:
    cmap = plt.get_cmap("tab20")
    out = {}
    for k, p in enumerate(policies):
        style: dict[str, Any] = {"color": cmap(k % 20), "linewidth": 1.2}
        style.update(EMPHASIS.get(p, {}))
        out[p] = style
    return out


def ttft_cdf(
    samples: Mapping[str, Mapping[str, np.ndarray]], policies: Sequence[str], path: Path
) -> None:
    """One panel per load: empirical CDF of TTFT (s, log axis) per policy, seeds pooled."""
    loads = sorted(samples, key=float)
    styles = _styles(policies)
    fig, axes = plt.subplots(1, len(loads), figsize=(5.2 * len(loads), 4.4), squeeze=False,
                             sharey=True)
    for ax, load in zip(axes[0], loads, strict=True):
        for p in policies:
            ms = samples[load].get(p)
            if ms is None or ms.size == 0:
                continue
            s = np.sort(np.asarray(ms, dtype=float)) / 1000.0
            y = np.arange(1, s.size + 1) / s.size
            ok = np.isfinite(s)
            ax.step(s[ok], y[ok], where="post", label=p, **styles[p])
        ax.set_xscale("log")
        ax.set_title(f"load {load} x capacity")
        ax.set_xlabel("TTFT (s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def p95_vs_load(
    agg: Mapping[str, Mapping[str, Mapping[str, Any]]], policies: Sequence[str], path: Path
) -> None:
    """p95 TTFT (mean over seeds, 95 % CI bars) against load, one line per policy."""
    loads = sorted(agg, key=float)
    styles = _styles(policies)
    fig, ax = plt.subplots(figsize=(7.5, 5.0))
    for p in policies:
        xs, ys, err = [], [], []
        for load in loads:
            st = agg[load].get(p, {}).get("ttft_p95_ms")
            if st is None or not np.isfinite(st.mean):
                continue
            xs.append(float(load))
            ys.append(st.mean / 1000.0)
            err.append(st.ci95 / 1000.0 if np.isfinite(st.ci95) else 0.0)
        if xs:
            ax.errorbar(xs, ys, yerr=err, marker="o", markersize=3.5, capsize=3, label=p,
                        **styles[p])
    ax.set_yscale("log")
    ax.set_xlabel("load (x round-robin capacity)")
    ax.set_ylabel("p95 TTFT (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
