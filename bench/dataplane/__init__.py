"""Data-plane benchmark: what the router adds on top of Envoy, measured against Envoy alone.

Three measurements, all in one run on one machine so they share its noise:

1. Decision latency (body received -> answer sent) for 8/32/256 KB chat bodies on a 6-replica,
   3-region fleet whose prefix index was warmed with multi-turn traffic. In-process it times the
   servicer's body handler exactly (plus, separately, the protobuf decode/encode gRPC does around
   it); over gRPC a client plays Envoy against a real `gorgo extproc` process.
2. Added end-to-end latency at concurrency 1: Envoy alone, Envoy + a no-op Python ext_proc, and
   Envoy + `gorgo extproc` (one worker; two workers, `--workers 2`; one worker with the fleet's
   `extproc: {response_headers: skip}`), in front of the same upstreams, requests rotated between
   them so drift hits all alike. The no-op path separates the cost of any Python ext_proc from the
   router's.
3. Saturated throughput through each of them, with the CPU every process (and the whole
   machine) used, so the saturated one is named rather than guessed.

Upstreams are an Envoy answering with direct responses (after buffering the request body, as an
engine would read it), so the upstream costs as little CPU as possible on a small machine. The load
generator is `wrk` when installed (`apt-get install wrk`), else a Python aiohttp loop that is
likely to be the bottleneck itself.

Usage, from the repository root: .venv/bin/python -m bench.dataplane [--quick] [--write-docs]
[--connections N] [--python-load]

Modules, by job: `workload` (fleet, bodies, ext_proc messages), `run` (in-process and gRPC
decision latency, the process stack, concurrency-1 latency), `load` (saturated throughput: wrk),
`stats` (distributions, CPU readings), `report` (markdown, docs/benchmarks.md), `cli`.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
