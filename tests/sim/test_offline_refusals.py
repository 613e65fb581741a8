"""The offline simulator frees what an engine refused, as the live router does (issue 12, 3).

Both drivers release a request through `Router.complete` when its answer is back, whatever it
was; an engine refusal (`EngineRejected`) is answered after one return trip, so the refused
prompt's booked prefill is gone as soon as the router could know of it.
"""

from __future__ import annotations

import json

from gorgo.core.features import extract_features
from gorgo.core.fleet import parse_fleet
from gorgo.sim.offline import Simulation
from gorgo.sim.presets import fleet_document
from gorgo.sim.profiles import get_profile
from gorgo.sim.workload import tokenization

PROFILE = "h100-llama3-8b"


def test_a_refused_prompt_is_not_priced_as_queue_for_later_requests() -> None:
    capacity = get_profile(PROFILE).kv_capacity_tokens
    doc = fleet_document({"near": 2}, profile=PROFILE, links={"near": {"rtt_ms": 10.0}})
    for r in doc["replicas"]:
        r["kv_capacity_tokens"] = 10 * capacity  # the router believes the engines hold it
    spec = parse_fleet(doc)
    tok = tokenization(spec)

    def chat(text: str) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": text}]}).encode()

    big = extract_features("/v1/chat/completions", {}, chat("b" * 4 * (capacity + 1000)), tok)
    small = [extract_features("/v1/chat/completions", {}, chat(f"{k} " * 200), tok)
             for k in range(20)]
    arrivals = [0.0] + [0.5 + 0.1 * k for k in range(20)]
    sim = Simulation(spec, "gorgo")
    res = sim.run(arrivals, [big, *small], [16] * 21)
    refused, *served = res.records
    assert refused.status == 400
    assert all(r.status == 200 for r in served)
    # 401k tokens at the profile's 20k tokens/s: 20 s of queue, of which about 18 s would still be
    # booked when the last request closes; released with the refusal instead.
    s = sim.router.state
    assert s.now > 2.0
    assert s.own_backlog()[refused.replica] == 0
    assert res.leaked_inflight == 0
