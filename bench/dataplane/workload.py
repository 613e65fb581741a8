"""What the bench sends: the fleet, the multi-turn chat bodies, and the ext_proc messages."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from gorgo._xds.envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from gorgo._xds.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gorgo.core.contract import ATTEMPT_COUNT_HEADER, METADATA_NAMESPACE, ROUTER_READS

KB = 1024
SIZES = (8 * KB, 32 * KB, 256 * KB)
E2E_SIZE = 8 * KB
REGIONS = ("us-east", "eu-frankfurt", "ap-seoul")
N_REPLICAS = 6
CHAT_PATH = "/v1/chat/completions"
# The front Envoys, measured side by side: no ext_proc, a do-nothing one, the router (one worker),
# the router with two workers (`--workers 2`), one worker with the response-headers round trip
# skipped (fleet extproc.response_headers: skip), and one with both headers messages skipped
# (request_headers: skip too: one ext_proc message per request, the body); and the do-nothing one
# with both skipped, the floor of a one-message Python ext_proc (it routes nothing: default route).
PATHS = ("alone", "noop", "routed", "workers2", "skip", "skip-both", "noop-skip-both")
NOOP_PATHS = ("noop", "noop-skip-both")
ROUTED_PATHS = ("routed", "workers2", "skip", "skip-both")
WORKERS = {"routed": 1, "workers2": 2, "skip": 1, "skip-both": 1}
# The extproc section of each path's fleet that skips a headers message (the others send all).
ONE_MESSAGE = {"response_headers": "skip", "request_headers": "skip"}
EXTPROC_MODES: dict[str, dict[str, str]] = {
    "skip": {"response_headers": "skip"}, "skip-both": ONE_MESSAGE, "noop-skip-both": ONE_MESSAGE,
}
_PROSE = (
    "the router sends each request to the replica with the lowest predicted time to first "
    "token which adds network round trip queue wait and prefill of the uncached prompt prefix "
    "a long conversation keeps its earlier turns cached so the next turn only pays for new text "
    "regions differ in distance and load while engines report their queues every second"
)
WORDS = tuple(_PROSE.split())


@dataclass(frozen=True)
class Plan:
    decisions: int  # in-process iterations per body size, half of them with the wire work
    grpc: int  # gRPC round trips per body size
    rounds: int  # concurrency-1 requests per path
    warm: int  # background requests that fill the prefix index
    saturate_s: float
    connections: int


FULL = Plan(decisions=4000, grpc=2000, rounds=2000, warm=1500, saturate_s=10.0, connections=32)
QUICK = Plan(decisions=300, grpc=150, rounds=150, warm=150, saturate_s=2.0, connections=32)


def _text(rng: random.Random, n_chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n_chars]


def _body(messages: list[dict[str, str]]) -> bytes:
    return json.dumps({"model": "m", "messages": messages, "max_tokens": 64}).encode()


@dataclass
class Workload:
    """Background traffic, the previous turn of every measured conversation, and the bodies."""

    warm: list[bytes]
    measured: dict[int, list[bytes]]


def make_workload(n_warm: int, per_size: int = 12, seed: int = 7,
                  sizes: tuple[int, ...] = SIZES) -> Workload:
    """Multi-turn chats over shared system prompts, as agent and chat traffic looks: ``per_size``
    measured bodies of each of ``sizes`` bytes.

    Each measured body is the next turn of a conversation whose previous turn is in the warm
    traffic, so prefix matching walks most of the body's blocks instead of finding nothing.
    """
    rng = random.Random(seed)
    systems = [_text(rng, rng.randint(1500, 6000)) for _ in range(12)]
    warm = []
    for _ in range(n_warm):
        msgs = [{"role": "system", "content": rng.choice(systems)}]
        for _ in range(rng.randint(0, 3)):
            msgs.append({"role": "user", "content": _text(rng, rng.randint(100, 1500))})
            msgs.append({"role": "assistant", "content": _text(rng, rng.randint(100, 1500))})
        msgs.append({"role": "user", "content": _text(rng, rng.randint(100, 3000))})
        warm.append(_body(msgs))
    previous: list[bytes] = []
    measured: dict[int, list[bytes]] = {}
    for size in sizes:
        bodies = []
        for _ in range(per_size):
            history = [{"role": "system", "content": rng.choice(systems)}]
            turn = max(200, size // 10)
            while len(_body(history)) < 0.85 * size:
                history.append({"role": "user", "content": _text(rng, turn)})
                history.append({"role": "assistant", "content": _text(rng, turn)})
            previous.append(_body(history[:-1]))
            last = {"role": "user", "content": ""}
            room = size - len(_body([*history, last]))
            last["content"] = _text(rng, max(1, room))
            bodies.append(_body([*history, last]))
        measured[size] = bodies
    return Workload(warm + previous, measured)


def _forwarded(hdrs: dict[str, str]) -> HeaderMap:
    """The headers of ``hdrs`` Envoy forwards to the router: those it reads (the rendered
    bootstrap's allowed headers, `contract.ROUTER_READS`)."""
    return HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode())
                              for k, v in hdrs.items() if k in ROUTER_READS])


def headers_msg(body: bytes) -> pb.ProcessingRequest:
    hdrs = {":method": "POST", ":path": CHAT_PATH, ":authority": "bench", ":scheme": "http",
            "content-type": "application/json", "content-length": str(len(body)),
            "x-request-id": "bench", "user-agent": "dataplane-bench"}
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_forwarded(hdrs),
                                                               end_of_stream=False))


def body_msg(body: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))



# A first attempt's answer (the rendered route counts attempts in the response).
RESPONSE_HEADERS = pb.ProcessingRequest(response_headers=pb.HttpHeaders(
    headers=_forwarded({":status": "200", "content-type": "application/json",
                        ATTEMPT_COUNT_HEADER: "1"}),
    end_of_stream=False))



def cached_share(answer: pb.ProcessingResponse) -> float:
    """Share of the prompt the chosen replica was believed to cache, from the decision metadata."""
    fields = answer.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
    prompt = fields["prompt_tokens"].number_value
    return 1.0 - fields["uncached_tokens"].number_value / prompt if prompt else 0.0


def bench_fleet(addresses: list[str], probe_s: float = 2.0,
                extproc: dict[str, str] | None = None) -> dict[str, Any]:
    """Six replicas, two per region, with the regions' preset link RTTs; ``extproc``: the
    fleet's extproc section (which headers messages Envoy skips)."""
    return {
        **({"extproc": extproc} if extproc else {}),
        "name": "dataplane-bench",
        "regions": {r: {"sim": {"link": r}} for r in REGIONS},
        "replicas": [{"name": f"r{k}", "region": REGIONS[k // 2], "address": a,
                      "engine": "sglang", "prefill_rate": 12000}
                     for k, a in enumerate(addresses)],
        "policy": "gorgo",
        "signals": {"probe_interval_s": probe_s, "scrape_interval_s": probe_s},
    }
