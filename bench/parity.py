"""Driver parity on a real trace: every policy, offline and through the live server's code.

For each registered policy the Mooncake slice runs in the offline simulator with every router call
recorded (`gorgo.harness.drivers`), then the same calls go through the live ext_proc service on a
fake clock. The table says whether the two decision sequences are identical and, for `irb`, how
its traffic splits over the replicas: offline, live, and live with the router's tick left out (what
the live server did before `Router.tick` existed: one solve at zero demand, kept forever).

    .venv/bin/python bench/parity.py [--requests 2000] [--rate 6]

Writes its table into docs/policies.md ("Live and offline drive the same policy").
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

from gorgo.core.policies import REGISTRY
from gorgo.harness.docblock import public_args, write_block
from gorgo.harness.drivers import Recording, record_offline, replay_live
from gorgo.sim.presets import preset_fleet
from gorgo.sim.traces import load_trace
from gorgo.sim.workload import tokenization, workload_from_requests

DOC = Path(__file__).resolve().parents[1] / "docs" / "policies.md"
SECTION = "## Live and offline drive the same policy"
BEGIN, END = "<!-- bench/parity.py begin -->", "<!-- bench/parity.py end -->"


def _shares(replicas: list[str | None], names: list[str]) -> str:
    counts = Counter(replicas)
    return " / ".join(f"{counts.get(n, 0)}" for n in names)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=6.0, help="mean arrival rate, requests/s")
    p.add_argument("--fleet", default="paper")
    args = p.parse_args(argv)
    spec = preset_fleet(args.fleet)
    reqs = load_trace(f"mooncake:limit={args.requests}")
    scale = workload_from_requests("m", reqs, tokenization(spec)).scale_for_rate(args.rate)
    names = [r.name for r in spec.replicas]
    rows = ["| policy | identical decisions | live wall s |", "|---|---|---:|"]
    irb: dict[str, list[str | None]] = {}
    for policy in sorted(REGISTRY):
        rec = record_offline(spec, policy, reqs, scale)
        t0 = time.perf_counter()
        live = replay_live(rec)
        wall = time.perf_counter() - t0
        same = live == rec.replicas
        rows.append(f"| {policy} | {'yes' if same else 'NO'} | {wall:.1f} |")
        print(rows[-1], flush=True)
        if policy == "irb":
            untick = Recording(rec.spec, rec.bodies,
                               [e for e in rec.events if e.kind != "tick"], rec.replicas)
            irb = {"offline": rec.replicas, "live": live, "live, no tick": replay_live(untick)}
    share_rows = [f"| irb driven | {' / '.join(names)} |", "|---|---|"]
    share_rows += [f"| {k} | {_shares(v, names)} |" for k, v in irb.items()]
    cmd = " ".join(["python bench/parity.py", *public_args(sys.argv[1:] if argv is None else argv)])
    block = (f"`{cmd}` — Mooncake, first {args.requests} requests at {args.rate:g} req/s, fleet "
             f"`{args.fleet}`.\n\n" + "\n".join(rows) + "\n\nRequests per replica under irb:\n\n"
             + "\n".join(share_rows) + "\n")
    print(block)
    write_block(DOC, SECTION, BEGIN, END, block, "# Policies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
