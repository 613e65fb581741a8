"""The precise cache view (`cache: precise`): what it costs a decision, what it buys under
cache pressure.

``decision``: extract_features + Router.route + complete for one request on a 4-replica fleet,
approximate vs precise, at 8 / 32 / 256 KB prompts (one chat message of word text), with the
simulated tokenizer and, given ``--tokenizer DIR``, a served model's (the engine tests' tiny
byte-level BPE). Four cases: ``cold`` (nothing cached anywhere: the lookup stops at the first
block); ``next turn`` (the prompt extends one this router routed before, which the engine has
cached: the conversation's next turn; the router warmed its memos with the earlier prompt off the
request path, as extproc does in a worker thread); ``first sight`` (a replica's engine reported
the whole prompt, which this router never saw, e.g. another router sent it: the lookup walks
``limits.precise_lookup_tokens``, 256 by default, and the engine's chain of blocks beyond);
``first sight, unbounded`` (the same with no bound: all of it tokenized and hashed on the request
path).

``offline``: the offline simulation (gorgo.sim) of four simulated vLLMs with a KV pool smaller
than the working set (``sim.kv_tokens``), a multi-turn chat trace, the gorgo policy; p95 TTFT of
approximate vs precise over several seeds.

    .venv/bin/python bench/precise_cache.py decision [--tokenizer .engines/model] [--write-docs]
    .venv/bin/python bench/precise_cache.py offline [--seeds 5] [--write-docs]

The live comparison on two real vLLM instances is bench/precise_live.py.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

from gorgo.core.block_hashes import BlockHasher
from gorgo.core.fleet import FleetSpec, parse_fleet
from gorgo.core.kv_events import STORED, KVEvent
from gorgo.core.prompt_tokens import load_tokenizer
from gorgo.core.router import Router
from gorgo.harness.docblock import public_args, write_block
from gorgo.sim.workload import build_workload, simulate, tokenization

ROOT = Path(__file__).resolve().parents[1]
SIZES_KB = (8, 32, 256)
BATCH = 25  # prompts set up, then decided (25 x 256 KB warmed stays well inside the memos)
VOCAB = ("route", "cache", "prefix", "engine", "token", "block", "region", "replica", "queue",
         "the", "of", "and", "latency", "envoy", "router", "fleet", "model", "request")


def words(n_chars: int, seed: int) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(VOCAB) + ("." if rng.random() < 0.08 else "")
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


UNBOUND = 8 * 1024 * 1024  # limits.precise_lookup_tokens of the "first sight, unbounded" case
UNBOUNDED = "first sight, unbounded"


def decision_fleet(cache: str, tokenizer: str, bound: int | None = None) -> FleetSpec:
    reps = []
    for i in range(4):
        r = {"name": f"r{i}", "region": "local", "address": f"127.0.0.1:{20000 + i}",
             "engine": "vllm"}
        if cache == "precise":
            r.update(cache="precise", tokenizer=tokenizer)
        reps.append(r)
    limits = {"precise_lookup_tokens": bound} if bound else {}
    return parse_fleet({"regions": {"local": None}, "replicas": reps, "limits": limits})


def body_of(text: str) -> bytes:
    return json.dumps({"model": "m", "max_tokens": 16, "stream": True,
                       "messages": [{"role": "user", "content": text}]}).encode()


def time_decisions(cache: str, tokenizer: str, kb: int, case: str, n: int) -> np.ndarray:
    """Seconds per decision (features + route + complete) for ``n`` requests of ``kb`` KB."""
    from gorgo.core.features import extract_features

    router = Router(decision_fleet(cache, tokenizer, UNBOUND if case == UNBOUNDED else None))
    s = router.state
    block = 64 if tokenizer == "sim" else 128  # the simulated engine's; vLLM's on CPU
    engine_tok = load_tokenizer(tokenizer, s.spec.chars_per_token)  # the engine's own copy
    if s.precise is not None:
        for i in range(s.n):
            s.observe_cache_config(i, block, 1 << 20, "sha256_cbor")
            s.set_kv_synced(i, True)
    for i in range(s.n):
        s.observe_rtt(i, 1.0)
    out = np.empty(n)
    for start in range(0, n, BATCH):
        # Set up a batch (the engine's events, the earlier turn warmed), then time its decisions
        # back to back: the setup tokenizes whole prompts, which must not run just before each
        # timed decision (its cache churn cost the next decision 0.2 ms more, features alone).
        raws = []
        for k in range(start, min(start + BATCH, n)):
            text = words(kb * 1024, k + 1)
            raws.append(body_of(text))
            if s.precise is not None and case != "cold":
                earlier = text[: len(text) - 512] if case == "next turn" else text
                f0 = extract_features("/v1/chat/completions", {}, body_of(earlier), s.tok)
                hasher = BlockHasher("sha256_cbor", block)  # the engine's, not the router's memo
                hashes = list(hasher.iter_hashes(c for c, _, _ in engine_tok.token_chunks(f0)))
                s.apply_kv_events(1, [KVEvent(STORED, tuple(hashes), None, (), block)])
                if case == "next turn":
                    s.precise.warm(f0)  # what extproc's worker thread did after routing it
        for k, raw in enumerate(raws, start):
            t0 = time.perf_counter()
            f = extract_features("/v1/chat/completions", {}, raw, s.tok)
            d = router.route(f, float(k))
            router.complete(d.id)  # type: ignore[union-attr]
            out[k] = time.perf_counter() - t0
    return out


def run_decision(args: argparse.Namespace) -> str:
    tokenizers = ["sim"] + ([args.tokenizer] if args.tokenizer else [])
    rows = ["| tokenizer | prompt | case | approximate p50 / p99 ms | precise p50 / p99 ms | "
            "added p99 ms |", "|---|---|---|---|---|---|"]
    for tok in tokenizers:
        label = "sim" if tok == "sim" else "tiny BPE (6k vocab) + chat template"
        for kb in SIZES_KB:
            n = args.n if kb < 256 else max(20, args.n // 5)
            base = time_decisions("approximate", tok, kb, "cold", n)
            for case in ("cold", "next turn", "first sight", UNBOUNDED):
                prec = time_decisions("precise", tok, kb, case, n)
                a50, a99 = np.percentile(base, [50, 99]) * 1000
                p50, p99 = np.percentile(prec, [50, 99]) * 1000
                rows.append(f"| {label} | {kb} KB | {case} | {a50:.2f} / {a99:.2f} | "
                            f"{p50:.2f} / {p99:.2f} | {p99 - a99:+.2f} |")
                print(rows[-1], flush=True)
    return "\n".join(rows) + "\n"


def offline_fleet(cache: str, kv_tokens: int) -> FleetSpec:
    reps = []
    for i in range(4):
        r = {"name": f"r{i}", "region": "us-east", "address": f"127.0.0.1:{20000 + i}",
             "engine": "sim", "kv_capacity_tokens": kv_tokens,
             "sim": {"profile": "h100-llama3-8b", "flavor": "vllm", "kv_tokens": kv_tokens}}
        if cache == "precise":
            r.update(cache="precise", tokenizer="sim")
        reps.append(r)
    return parse_fleet({"regions": {"us-east": None}, "replicas": reps})


def run_offline(args: argparse.Namespace) -> str:
    rows = ["| KV pool per replica | load | approximate p95 TTFT s | precise p95 TTFT s | "
            "precise / approximate (95 % CI over seeds) | hit tokens approx / precise |",
            "|---|---|---|---|---|---|"]
    wl = build_workload(args.trace, tokenization(offline_fleet("approximate", 1)), args.requests)
    for kv in args.kv_tokens:
        for scale in args.scales:
            p95 = {"approximate": [], "precise": []}
            hits = {"approximate": [], "precise": []}
            for seed in range(args.seeds):
                for cache in p95:
                    res = simulate(offline_fleet(cache, kv), "gorgo", wl, scale, seed)
                    ttft = np.array([r.ttft for r in res.records])
                    p95[cache].append(float(np.percentile(ttft, 95)))
                    hits[cache].append(float(np.mean([r.cached_tokens for r in res.records])))
            ratio = np.array(p95["precise"]) / np.array(p95["approximate"])
            half = 1.96 * ratio.std(ddof=1) / np.sqrt(len(ratio)) if len(ratio) > 1 else 0.0
            rows.append(
                f"| {kv:,} tokens | {1 / scale:.1f}x trace rate | "
                f"{np.mean(p95['approximate']):.2f} | {np.mean(p95['precise']):.2f} | "
                f"{ratio.mean():.3f} ± {half:.3f} | {np.mean(hits['approximate']):.0f} / "
                f"{np.mean(hits['precise']):.0f} |")
            print(rows[-1], flush=True)
    note = (f"\nTrace `{args.trace}`, first {wl.n} requests (mean prompt "
            f"{wl.mean_prompt_tokens:.0f} tokens), {args.seeds} seeds, 4 replicas of "
            "h100-llama3-8b in one region, policy gorgo; hit tokens = the engines' real prefix "
            "hits per request.\n")
    return "\n".join(rows) + "\n" + note


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("decision")
    d.add_argument("--tokenizer", default=None, help="a served model's directory")
    d.add_argument("--n", type=int, default=200, help="decisions per cell (256 KB: a fifth)")
    o = sub.add_parser("offline")
    o.add_argument("--trace", default="chat:users=100,rate=4")
    o.add_argument("--requests", type=int, default=1000)
    o.add_argument("--seeds", type=int, default=5)
    o.add_argument("--kv-tokens", type=int, nargs="+", default=[20_000, 40_000])
    o.add_argument("--scales", type=float, nargs="+", default=[1.0, 0.5],
                   help="arrival-time factors (0.5 = twice the trace's rate)")
    for q in (d, o):
        q.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    t0 = time.time()
    block = run_decision(args) if args.cmd == "decision" else run_offline(args)
    cmd = " ".join(["bench/precise_cache.py", *public_args(sys.argv[1:])])
    block += f"\nGenerated by `{cmd}` in {time.time() - t0:.0f} s on the 2-core dev machine.\n"
    if args.write_docs:
        if args.cmd == "decision":
            write_block(ROOT / "docs" / "benchmarks.md", "## Precise cache view: decision cost",
                        "<!-- precise-decision:begin (generated by bench/precise_cache.py "
                        "decision --write-docs) -->", "<!-- precise-decision:end -->", block,
                        "# Benchmarks")
        else:
            write_block(ROOT / "docs" / "results.md", "## Precise cache view under cache pressure",
                        "<!-- precise-offline:begin (generated by bench/precise_cache.py "
                        "offline --write-docs) -->", "<!-- precise-offline:end -->", block,
                        "# Results")
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
