"""The outputs of `gorgo bench tune`: results.json, results.md and the two figures.

results.md and the figures are rendered from results.json's content alone (``--report-only``), so
every name they show comes from the document: ``weight_keys`` (the registry's weighted terms when
it was written), ``grid_points`` (each weight's grid values) and the runs' ``{key: factor}``
weights. The grid table and heat map show the first two weights; with more, each cell is the best
over the others. matplotlib is imported inside the plotting functions only.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gorgo.core.fleet import FleetSpec
from gorgo.sim.stats import jsonable
from gorgo.sim.tunebench.points import KEYS, Point, grid, keys_of, label, point_key, static_key
from gorgo.sim.tunebench.run import NULL_START
from gorgo.sim.tunebench.stats import (
    LIVE_WINDOW,
    OBJECTIVE_METRIC,
    STRETCH_SAMPLES,
    GridBest,
    grid_means,
    null_total,
)
from gorgo.sim.workload import Workload
from tuner.optimizer import OptimizerConfig

RATIO_TICKS = (0.5, 0.7, 0.85, 1, 1.2, 1.5, 2, 3, 5)  # p95 / grid best, on a log axis
COARSE_TICKS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200)


def reproduce_command(args: argparse.Namespace) -> str:
    parts = ["gorgo", "bench", "tune", "--trace", args.trace, "--fleet", str(args.fleet),
             "--load", f"{args.load:g}", "--seeds", str(args.seeds), "--grid", str(args.grid)]
    if args.requests is not None:
        parts += ["--requests", str(args.requests)]
    if getattr(args, "window", None):
        parts += ["--window", args.window]
    if args.capacity is not None:
        parts += ["--capacity", str(args.capacity)]
    for s in args.start or []:
        parts += ["--start", s]
    for o in args.opt:
        parts += ["--opt", o]
    if args.calibrate:
        parts.append("--calibrate")
    if args.tick_s != 0.5:
        parts += ["--tick-s", f"{args.tick_s:g}"]
    if args.publish_delay_s:
        parts += ["--publish-delay-s", f"{args.publish_delay_s:g}"]
    if args.tolerance != 0.05:
        parts += ["--tolerance", f"{args.tolerance:g}"]
    if getattr(args, "objective", None):
        parts += ["--objective", args.objective]
    if getattr(args, "ends_only", False):
        parts.append("--ends-only")
    if getattr(args, "null_only", False):
        parts.append("--null-only")
    parts += ["--out", str(args.out)]
    return " ".join(shlex.quote(p) for p in parts)


# ------------------------------------------------------------------------------------ markdown


def _x(v: float | None, digits: int, unit: float = 1.0) -> str:
    """A number for the tables; null (JSON for +inf: failed requests) shows as ∞."""
    return "∞" if v is None else f"{v / unit:.{digits}f}"


def _ratio(a: float | None, b: float) -> float | None:
    return None if a is None else a / b


def _s(ms: float | None) -> str:
    return "n/a" if ms is None or not math.isfinite(ms) else f"{ms / 1e3:.1f}"


def _num(x: float | None) -> float:
    """A JSON number back as a float (null: not finite, drawn as a gap)."""
    return math.nan if x is None else float(x)


def _samples_text(n: int | None, total: int) -> str:
    return f"not within {total}" if n is None else str(n)


def _median_samples(values: Sequence[int | None], total: int) -> str:
    """Median over seeds, a run that never got there counting as more than any that did."""
    keyed = sorted(values, key=lambda v: math.inf if v is None else v)
    mid = keyed[(len(keyed) - 1) // 2]
    if len(keyed) % 2 == 0:
        hi = keyed[len(keyed) // 2]
        if mid is not None and hi is not None:
            return f"{(mid + hi) / 2:g}"
        return _samples_text(mid, total) if mid is None else f">= {mid}"
    return _samples_text(mid, total)


def _weights_text(p: Mapping[str, float], keys: Sequence[str], digits: str = "g") -> str:
    return ", ".join(f"{float(p[k]):{digits}}" for k in keys)


def _names(keys: Sequence[str]) -> str:
    return ", ".join(f"w_{k}" for k in keys)


def grid_matrix(doc: Mapping[str, Any], metric: str) -> tuple[list[float], list[float], np.ndarray]:
    """``metric`` (mean over seeds) on the first two weights' grid values: rows the first
    weight, columns the second; with more weights each cell is the lowest over the others."""
    keys = doc["weight_keys"]
    axes = doc["grid_points"]
    xs = axes[keys[0]]
    ys = axes[keys[1]] if len(keys) > 1 else [math.nan]
    z = np.full((len(xs), len(ys)), math.nan)
    for p in grid(axes, keys):
        v = _num(doc[metric][point_key(p, keys)])
        i = xs.index(p[keys[0]])
        j = ys.index(p[keys[1]]) if len(keys) > 1 else 0
        if math.isnan(z[i, j]) or v < z[i, j]:  # unset, or lower: the best of the others
            z[i, j] = v
    return xs, ys, z


def _score(v: float, objective: str) -> str:
    """An objective's score as the report shows it: seconds, or the SLO's miss share."""
    return f"{v:.3f}" if objective == "slo" else f"{v / 1e3:.3f} s"


def score_name(doc: Mapping[str, Any]) -> str:
    """What the tuner's objective scores: the grid's best and every ratio to it are of this."""
    objective = doc["optimizer"].get("objective", "ttft")
    return {"ttft": "p95 TTFT", "e2e": "p95 E2E", "slo": "SLO miss share"}[objective]


def summary_markdown(doc: dict[str, Any]) -> str:
    """results.md: setup, the grid, convergence per start and seed, the E2E guard."""
    keys = doc["weight_keys"]
    skeys = doc.get("optimizer_keys") or keys  # what a start names (all the tuner searches)
    best = doc["grid_best"]
    bw = best["weights"]
    runs = doc["runs"]
    tol = doc["tolerance"]
    guarded = [r for r in runs if r["e2e_guard"]]
    free = {(label(r["start"], skeys), r["seed"]): r for r in runs if not r["e2e_guard"]}
    starts = list(dict.fromkeys(label(r["start"], skeys) for r in guarded))
    objective = doc["optimizer"].get("objective", "ttft")
    score = score_name(doc)
    run_score = {"ttft": "run_ttft_p95_ms", "e2e": "run_e2e_p95_ms"}.get(objective)
    non_default = {k: v for k, v in doc["optimizer"].items()
                   if v != doc["optimizer_defaults"].get(k) and k not in ("history", "calibrate")}
    md = [
        "# gorgo bench tune", "", "```", doc["command"], "```", "",
        f"- trace `{doc.get('slice', doc['trace'])}`, {doc['requests']} requests; "
        f"fleet `{doc['fleet']}`; load "
        f"{doc['load']:g} x capacity = {doc['rate_rps']:.3f} req/s (capacity "
        f"{doc['capacity_rps']:.3f} req/s as `gorgo bench sim` defines it)",
        f"- seeds {', '.join(map(str, doc['seeds']))}; the tuner asks for weights every "
        f"{doc['tick_s']:g} simulated s, proposals apply after {doc['publish_delay_s']:g} s; "
        f"prefill-rate calibration {'on' if doc['optimizer']['calibrate'] else 'off'}; router "
        f"and simulation code digest `{doc['model_digest']}`",
        "- optimiser: defaults" + (", except " + ", ".join(
            f"`{k}={v}`" for k, v in non_default.items()) if non_default else ""),
        "- samples: requests routed by `gorgo` whose first sample reached the tuner (" + (
            "at their end" if "--ends-only" in doc["command"] else "early, at their first token,"
            " or at their end") + "), counted from the start; an incumbent's "
        "p95 is its weights re-run statically on the same slice and seed; converged = every "
        f"incumbent from then on within {tol:.0%} of the grid best's p95 on that seed",
    ]
    if objective != "ttft":
        md.append(f"- objective `{objective}`: every p95 of the grid's best and of the "
                  f"convergence tables is its score, {score}; the tuner searches "
                  f"({_names(doc['optimizer_keys'])}), the grid ({_names(keys)}), any other "
                  "weight at its default")
    md += ["", "## Grid: static weights, mean p95 TTFT over seeds (s)", ""]
    xs, ys, z = grid_matrix(doc, "grid_mean_p95_ms")
    if len(keys) > 2:
        md += [f"Each cell is the best over {_names(keys[2:])}.", ""]
    if len(keys) > 1:
        md += [f"| w_{keys[0]} \\ w_{keys[1]} | " + " | ".join(f"{b:.3g}" for b in ys) + " |",
               "|---:|" + "---:|" * len(ys)]
    else:
        md += [f"| w_{keys[0]} | mean p95 |", "|---:|---:|"]
    best_cell = (bw[keys[0]], bw[keys[1]] if len(keys) > 1 else math.nan)
    for i, a in enumerate(xs):
        cells = []
        for j, b in enumerate(ys):
            cell = _x(None if math.isnan(z[i, j]) else float(z[i, j]), 2, 1e3)
            is_best = a == best_cell[0] and (len(keys) == 1 or b == best_cell[1])
            cells.append(f"**{cell}**" if is_best else cell)
        md.append(f"| {a:.3g} | " + " | ".join(cells) + " |")
    # Counted on the objective's own metric, the one the grid's best was chosen on.
    metric = OBJECTIVE_METRIC[objective]
    per_point: dict[str, list[float]] = {}
    for g in doc["grid"].values():
        per_point.setdefault(point_key(g["weights"], keys), []).append(_num(g[metric]))
    within = sum(float(np.mean(v)) <= (1 + tol) * best["mean_p95_ms"]
                 for v in per_point.values())
    md += [
        "", f"Best: ({_names(keys)}) = ({_weights_text(bw, keys, '.3g')}), mean {score} "
        f"{_score(best['mean_p95_ms'], objective)} (per seed: " + ", ".join(
            _score(v, objective) for v in best["per_seed_p95_ms"].values()) + "), p95 E2E "
        + ", ".join(f"{v / 1e3:.1f}" for v in best["per_seed_e2e_ms"].values())
        + f" s; {within} of {len(per_point)} grid points are within {tol:.0%} of it.", "",
        "## Convergence from bad weights (E2E guard on)", "",
        "| start | seed | samples until within for good | first within | evaluations "
        f"(accepted; statically worse by > {tol:.0%}) | final incumbent | final p95 / best "
        "| worst candidate p95 (s; x incumbent) "
        f"| worst live p95, last {LIVE_WINDOW} (s; grid best's) | whole run p95 / best "
        "| optimiser converged at |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in guarded:
        f = r["final"]
        worst = r["worst_candidate_p95_ms"]
        wr = r["worst_candidate_vs_incumbent"]
        md.append(
            f"| {_weights_text(r['start'], skeys)} | {r['seed']} | "
            f"{_samples_text(r['stays_within'], r['samples'])} | "
            f"{_samples_text(r['first_within'], r['samples'])} | {r['evaluations']} "
            f"({r['accepted']}; {r['worse_accepts']}) | "
            f"({_weights_text(f['weights'], keys_of(f['weights']), '.3g')}) | "
            f"{_x(f['ratio'], 3)} | "
            + ("n/a" if worst is None else f"{worst / 1e3:.1f} ({_x(wr, 2)})") + " | "
            f"{_s(r['live_p95_max_ms'])} ({_s(r['best_live_p95_max_ms'])}) | "
            f"{_x(_ratio(r[run_score], r['target_p95_ms']), 2) if run_score else 'n/a'} | "
            f"{r['optimizer_converged_at'] or 'no'} |")
    md.append("")
    for start in starts:
        rs = [r for r in guarded if label(r["start"], skeys) == start]
        med = _median_samples([r["stays_within"] for r in rs], rs[0]["samples"])
        md.append(f"- start ({_weights_text(rs[0]['start'], skeys)}): median samples until "
                  f"within {tol:.0%} for good: {med} (of {rs[0]['samples']} per run)")
    if guarded:
        ignored = [r["final_status"]["ignored_samples"] / r["samples"] for r in guarded]
        per_eval = [r["samples"] / r["evaluations"] for r in guarded if r["evaluations"]]
        per_eval_text = f"{np.mean(per_eval):.0f}" if per_eval else "n/a (no evaluation)"
        md.append(f"- {per_eval_text} samples per evaluation on average; "
                  f"{np.mean(ignored):.0%} of all samples counted for no window (routed under a "
                  "warm-up or bridge version, or by an evaluation that was dropped)")
        fitted = sum(r.get("model_evaluations", 0) for r in guarded)
        md.append(f"- fitted-weights candidates: {fitted} evaluated, "
                  f"{sum(r.get('model_accepted', 0) for r in guarded)} accepted, "
                  f"{sum(r.get('extended', 0) for r in guarded)} extensions")
        adopted = [r for r in guarded if r.get("adopted")]
        if adopted:
            at = sorted(r["adopted"]["samples"] for r in adopted)
            md.append(f"- the start replaced by the fit's nearest plausible weights in "
                      f"{len(adopted)} of {len(guarded)} runs (after {at[0]}-{at[-1]} samples); "
                      f"the start won its place back in "
                      f"{sum(r.get('start_won_back', 0) for r in guarded)}")
        levels = list(guarded[0]["stays_within_by_tolerance"])
        md += ["", "Median over seeds of the samples until the incumbent stays within a "
               "tolerance of the grid best, by tolerance:", "",
               "| start | " + " | ".join(f"within {float(lv):.0%}" for lv in levels) + " |",
               "|---|" + "---:|" * len(levels)]
        for start in starts:
            rs = [r for r in guarded if label(r["start"], skeys) == start]
            md.append(f"| {_weights_text(rs[0]['start'], skeys)} | " + " | ".join(
                _median_samples([r["stays_within_by_tolerance"][lv] for r in rs],
                                rs[0]["samples"]) for lv in levels) + " |")
    md += ["", "## The E2E guard: final incumbent re-run statically, guard on vs off", "",
           f"| start | seed | p95 E2E on (s) | p95 E2E off (s) | {score} / best on | "
           f"{score} / best off | rejected for E2E (on) | final weights off |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in guarded:
        o = free.get((label(r["start"], skeys), r["seed"]))
        if o is None:
            continue
        fo = o["final"]
        md.append(
            f"| {_weights_text(r['start'], skeys)} | {r['seed']} | "
            f"{_x(r['final']['static_e2e_p95_ms'], 1, 1e3)} | "
            f"{_x(fo['static_e2e_p95_ms'], 1, 1e3)} "
            f"| {_x(r['final']['ratio'], 3)} | {_x(fo['ratio'], 3)} | "
            f"{r['reasons'].get('e2e_worse', 0)} | ({_weights_text(fo['weights'], keys, '.3g')}) |")
    md += null_markdown(doc)
    md += ["", "![weights and objective against samples](tune_convergence.png)", "",
           "![grid](tune_grid.png)", ""]
    return "\n".join(md)


def null_markdown(doc: Mapping[str, Any]) -> list[str]:
    """The A/A section of results.md (none without A/A runs)."""
    keys = doc["weight_keys"]
    md: list[str] = []
    total = doc.get("null_total")
    if total:
        held = doc["null_runs"][0].get("weights") or NULL_START
        md += ["", "## False accepts (A/A: every candidate is the incumbent itself)", "",
               f"Weights held at ({_weights_text(held, keys)}); every acceptance is a "
               f"false one. Configured `fpr` {doc['optimizer']['fpr']:g}.", "",
               "| seed | evaluations | accepted | rejected for E2E "
               "| median (p95_c - p95_i) / p95_i |",
               "|---:|---:|---:|---:|---:|"]
        for r in doc["null_runs"]:
            gap = "n/a" if r["median_gap"] is None else f"{r['median_gap']:+.3f}"
            md.append(f"| {r['seed']} | {r['evaluations']} | {r['accepted']} | "
                      f"{r['rejected_for_e2e']} | {gap} |")
        rate = total["rate"]
        md += ["", f"Total: {total['accepted']} of {total['evaluations']} accepted = "
               + ("n/a" if rate is None else f"{rate:.1%}") + " (95 % Wilson interval "
               f"{total['ci95'][0]:.1%} to {total['ci95'][1]:.1%})."]
        if "ci95_stretches" in total:
            lo, hi = total["ci95_stretches"]
            md += ["", f"The seeds share the trace, so an evaluation meets the same burst in "
                   f"every seed: resampling whole stretches of {STRETCH_SAMPLES} samples "
                   f"({total['stretches']} of them) instead, 95 % interval {lo:.1%} to {hi:.1%}."]
    return md


# --------------------------------------------------------------------------------- documents


def write_outputs(
    out: Path, args: argparse.Namespace, spec: FleetSpec, workload: Workload, capacity: float,
    scale: float, config: OptimizerConfig, axes: Mapping[str, Sequence[float]],
    seeds: Sequence[int], static: Mapping[str, Mapping[str, float]], best: GridBest,
    runs: list[dict[str, Any]], nulls: list[dict[str, Any]], digest: str,
) -> dict[str, Any]:
    """results.json, results.md, tune_convergence.png and tune_grid.png in ``out``."""
    points: list[Point] = grid(axes)
    doc: dict[str, Any] = {
        "command": reproduce_command(args),
        "trace": args.trace,
        "slice": workload.trace,
        "fleet": str(args.fleet),
        "requests": workload.n,
        "load": args.load,
        "capacity_rps": capacity,
        "rate_rps": args.load * capacity,
        "time_scale": scale,
        "model_digest": digest,
        "seeds": list(seeds),
        "tick_s": args.tick_s,
        "publish_delay_s": args.publish_delay_s,
        "tolerance": args.tolerance,
        "optimizer": asdict(config),
        "optimizer_defaults": asdict(OptimizerConfig()),
        "weight_keys": list(KEYS),
        "optimizer_keys": list(config.keys),
        "grid_points": {k: list(v) for k, v in axes.items()},
        "grid": {f"{point_key(p)}|{s}": {"weights": p, "seed": s,
                                         **static[static_key(p, {}, s)]}
                 for p in points for s in seeds},
        "grid_mean_p95_ms": grid_means(points, seeds, static, "ttft_p95_ms"),
        "grid_mean_e2e_p95_ms": grid_means(points, seeds, static, "e2e_p95_ms"),
        "grid_best": asdict(best),
        "runs": runs,
        "null_runs": nulls,
        "null_total": null_total(nulls),
    }
    (out / "results.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    return render(out, json.loads((out / "results.json").read_text()))


def write_null_outputs(
    out: Path, args: argparse.Namespace, workload: Workload, config: OptimizerConfig,
    seeds: Sequence[int], nulls: list[dict[str, Any]], digest: str,
) -> dict[str, Any]:
    """results.json and results.md of ``--null-only``: the A/A runs alone (no grid, no
    figures), for measuring the false-accept rate over many seeds cheaply."""
    doc: dict[str, Any] = {
        "command": reproduce_command(args), "trace": args.trace, "slice": workload.trace,
        "fleet": str(args.fleet), "requests": workload.n, "load": args.load,
        "model_digest": digest, "seeds": list(seeds),
        "optimizer": asdict(config), "weight_keys": list(KEYS), "null_runs": nulls,
        "null_total": null_total(nulls),
    }
    (out / "results.json").write_text(json.dumps(jsonable(doc), indent=1) + "\n")
    return render(out, json.loads((out / "results.json").read_text()))


def render(out: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """results.md and the figures from results.json's content (also for --report-only)."""
    if "grid" not in doc:  # --null-only
        doc["summary_md"] = "\n".join(["# gorgo bench tune (A/A runs only)", "", "```",
                                       doc["command"], "```", "",
                                       f"Trace `{doc.get('slice', doc['trace'])}`.",
                                       *null_markdown(doc), ""])
        (out / "results.md").write_text(doc["summary_md"])
        return doc
    doc["summary_md"] = summary_markdown(doc)
    (out / "results.md").write_text(doc["summary_md"])
    plot_convergence(doc, out / "tune_convergence.png")
    plot_grid(doc, out / "tune_grid.png")
    return doc


# --------------------------------------------------------------------------------------- plots


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    return plt


def plot_convergence(doc: Mapping[str, Any], path: Path) -> None:
    """Per start (columns): the incumbent's weights (a row each), and its static p95 / target,
    against samples."""
    plt = _pyplot()
    keys, axes_values = doc["weight_keys"], doc["grid_points"]
    skeys = doc.get("optimizer_keys") or keys
    best, tolerance = doc["grid_best"], doc["tolerance"]
    guarded = [r for r in doc["runs"] if r["e2e_guard"]]
    starts = list(dict.fromkeys(label(r["start"], skeys) for r in guarded))
    seeds = sorted({r["seed"] for r in guarded})
    colors = {s: plt.get_cmap("tab10")(k % 10) for k, s in enumerate(seeds)}
    rows = len(keys) + 1
    fig, axes = plt.subplots(rows, len(starts), figsize=(6.0 * len(starts), 10.0 * rows / 3),
                             squeeze=False, sharex="col")
    for col, start in enumerate(starts):
        weight_axes, bottom = [axes[k][col] for k in range(len(keys))], axes[-1][col]
        start_point = next(r["start"] for r in guarded if label(r["start"], skeys) == start)
        for r in (r for r in guarded if label(r["start"], skeys) == start):
            c = colors[r["seed"]]
            n = [i["samples"] for i in r["incumbents"]] + [r["samples"]]
            for ax, key in zip(weight_axes, keys, strict=True):
                ys = [i["weights"][key] for i in r["incumbents"]]
                ax.step(n, ys + ys[-1:], where="post", color=c, label=f"seed {r['seed']}")
            ratio = [i["ratio"] for i in r["incumbents"]]
            bottom.step(n, ratio + ratio[-1:], where="post", color=c,
                        label=f"seed {r['seed']} incumbent (static re-run)")
            live = r["live_p95_ms"]
            bottom.plot([x[0] for x in live], [_num(x[1]) / r["target_p95_ms"] for x in live],
                        color=c, linewidth=0.6, alpha=0.5)
            ev = r["evaluations_log"]
            bottom.scatter([e["samples"] for e in ev],
                           [_num(e["p95_candidate"]) / r["target_p95_ms"] for e in ev],
                           s=9, color=c, alpha=0.45, marker="x")
        for ax, key in zip(weight_axes, keys, strict=True):
            ax.axhline(best["weights"][key], color="black", linestyle=":", label="grid best")
            ax.set_ylabel(f"incumbent w_{key}")
            lo, hi = axes_values[key][0], axes_values[key][-1]
            ax.set_ylim(lo / 1.5, hi * 1.5)
        bottom.axhline(1.0 + tolerance, color="black", linestyle=":",
                       label=f"grid best + {tolerance:.0%}")
        weight_axes[0].set_title(f"start ({_names(skeys)}) = ({_weights_text(start_point, skeys)})")
        bottom.set_ylabel(f"{score_name(doc)} / grid best")
        bottom.set_title(f"step: incumbent re-run statically; thin: live traffic (last "
                         f"{LIVE_WINDOW}); x: candidate arm", fontsize=8)
        bottom.set_xlabel("samples (first tokens, or ends without early samples)")
        for ax in (*weight_axes, bottom):
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
        lo, hi = bottom.get_ylim()
        ticks = [t for t in (RATIO_TICKS if hi / lo < 8 else COARSE_TICKS) if lo <= t <= hi]
        bottom.set_yticks(ticks, [f"{t:g}" for t in ticks])
        bottom.set_yticks([], minor=True)
        weight_axes[0].legend(fontsize=7)
        bottom.legend(fontsize=7)
    fig.subplots_adjust(left=0.08, right=0.98, top=0.96, bottom=0.06, hspace=0.25, wspace=0.2)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _edges(values: Sequence[float]) -> np.ndarray:
    """Cell edges of log-spaced grid values (midpoints in log space, half a step beyond)."""
    logs = np.log(np.asarray(values, dtype=float))
    step = (logs[-1] - logs[0]) / max(len(logs) - 1, 1) / 2 if len(logs) > 1 else 0.5
    return np.exp(np.concatenate([logs - step, [logs[-1] + step]]))


def plot_grid(doc: Mapping[str, Any], path: Path) -> None:
    """Mean p95 TTFT and E2E over seeds on the grid (the first two weights; with more, the best
    over the others), with the tuned runs' incumbent paths."""
    plt = _pyplot()
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    keys, runs, best = doc["weight_keys"], doc["runs"], doc["grid_best"]["weights"]
    fig, axes = plt.subplots(1, 2, figsize=(13.0, 5.4))
    for ax, metric, title in ((axes[0], "grid_mean_p95_ms", "p95 TTFT (s)"),
                              (axes[1], "grid_mean_e2e_p95_ms", "p95 E2E (s)")):
        xs, ys, z = grid_matrix(doc, metric)
        z = z / 1e3
        if len(keys) < 2:  # one weight: a curve
            ax.plot(xs, z[:, 0], "-o")
            ax.axvline(best[keys[0]], color="black", linestyle=":", label="grid best")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(f"w_{keys[0]}")
            ax.set_ylabel(f"mean {title} over seeds")
            ax.legend(fontsize=7)
            continue
        zt = z.T  # rows: the second weight, columns: the first
        ex, ey = _edges(xs), _edges(ys)
        norm = LogNorm(vmin=float(np.nanmin(zt)), vmax=float(np.nanmax(zt)))
        mesh = ax.pcolormesh(ex, ey, zt, norm=norm, cmap="viridis_r")
        fig.colorbar(mesh, ax=ax, label=f"mean {title} over seeds"
                     + (f", best over {_names(keys[2:])}" if len(keys) > 2 else ""))
        for a_i, a in enumerate(xs):
            for b_i, b in enumerate(ys):
                ax.text(a, b, f"{zt[b_i, a_i]:.3g}", ha="center", va="center", fontsize=6,
                        color="white" if norm(zt[b_i, a_i]) > 0.55 else "black")
        for r in runs:
            if not r["e2e_guard"]:
                continue
            px = [i["weights"][keys[0]] for i in r["incumbents"]]
            py = [i["weights"][keys[1]] for i in r["incumbents"]]
            ax.plot(px, py, "-o", markersize=2.5, linewidth=1.0, color="red", alpha=0.6)
            ax.plot(px[-1:], py[-1:], "s", markersize=5, color="red")
        b_a, b_b = xs.index(best[keys[0]]), ys.index(best[keys[1]])
        ax.add_patch(Rectangle((ex[b_a], ey[b_b]), ex[b_a + 1] - ex[b_a], ey[b_b + 1] - ey[b_b],
                               fill=False, edgecolor="black", linewidth=2.0,
                               label=f"grid best {score_name(doc)}"))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"w_{keys[0]}")
        ax.set_ylabel(f"w_{keys[1]}")
        ax.set_title(f"{title}; red: incumbents of the tuned runs (square: final)", fontsize=10)
        ax.legend(fontsize=7, loc="lower left")
    fig.subplots_adjust(left=0.06, right=0.93, top=0.93, bottom=0.1, wspace=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)
