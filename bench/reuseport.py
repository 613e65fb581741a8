"""Does one SO_REUSEPORT port spread Envoy's ext_proc traffic over several router processes?

Two no-op ext_proc servers (the data-plane bench's, `python -m bench.dataplane --serve-noop`)
listen on one port (grpc's default `grpc.so_reuseport=1`); a front Envoy rendered by
`gorgo envoy-config` (`--concurrency 2`, as on a 2-core host) sends 200 requests through them; `ss`
then says which process holds each established connection. Each round starts a fresh Envoy, so
the kernel hashes new connections. Why `gorgo extproc --workers N` gives each worker its own port
instead: docs/benchmarks.md.

Usage, from the repository root: .venv/bin/python -m bench.reuseport [ROUNDS]
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import re
import subprocess
import sys
import urllib.request

from bench.dataplane.run import NoopProcess
from bench.dataplane.workload import CHAT_PATH, bench_fleet
from gorgo.core.fleet import parse_fleet
from gorgo.envoy_config import render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import free_port

BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'


def _hit(url: str) -> None:
    req = urllib.request.Request(url, data=BODY, headers={"content-type": "application/json"})
    # No upstream behind this Envoy: only the ext_proc connections matter.
    with contextlib.suppress(OSError):
        urllib.request.urlopen(req, timeout=5).read()


def _connections(port: int, pids: list[int]) -> tuple[int, ...]:
    out = subprocess.run(["ss", "-tnpH", "state", "established", f"sport = :{port}"],
                         capture_output=True, text=True, check=True).stdout
    per = collections.Counter(int(m.group(1)) for m in re.finditer(r"pid=(\d+)", out))
    return tuple(per.get(p, 0) for p in pids)


def main(rounds: int) -> None:
    port = free_port()
    noops = [NoopProcess(port), NoopProcess(port)]
    pids = [n.p.pid for n in noops]
    spec = parse_fleet(bench_fleet([f"127.0.0.1:{free_port()}" for _ in range(6)]))
    splits: collections.Counter[tuple[int, ...]] = collections.Counter()
    try:
        for r in range(rounds):
            listen = free_port()
            boot = render_bootstrap(spec, listen=f"127.0.0.1:{listen}",
                                    admin=f"127.0.0.1:{free_port()}",
                                    extproc=f"127.0.0.1:{port}")
            with EnvoyProcess(boot, concurrency=2), \
                    concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(_hit, [f"http://127.0.0.1:{listen}{CHAT_PATH}"] * 200))
                split = _connections(port, pids)
            splits[split] += 1
            print(f"round {r}: connections per no-op process {split}", flush=True)
    finally:
        for n in noops:
            n.stop()
    one_sided = sum(c for s, c in splits.items() if min(s) == 0)
    print(f"all connections on one process in {one_sided} of {rounds} rounds; "
          f"splits {dict(splits)}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
