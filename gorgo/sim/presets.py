"""Named simulated fleets for the offline bench, and `--fleet` resolution (preset or YAML path).

Every preset goes through `parse_fleet`, so it is validated exactly like a fleet file. Addresses
are fake loopback ones: the offline simulation opens no socket, it only needs them to be unique.
The prefill-rate hint the router starts from is what the engine profile really does
(1000 / ms-per-token, scaled by the replica's speed), so the bench measures routing rather than a
mis-set hint; the online tuner exists to correct hints on real fleets.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gorgo.core.fleet import FleetSpec, load_fleet, parse_fleet
from gorgo.sim.profiles import get_profile

PAPER_PROFILE = "2xl40s-qwen3.5-35b-a3b-fp8"
PAPER_REGIONS = ("us-east", "eu-frankfurt", "ap-seoul")  # link presets; the proxy is in us-east
BASE_PORT = 20000


def fleet_document(
    replicas: Mapping[str, int],
    *,
    profile: str = PAPER_PROFILE,
    speed: Mapping[str, float] | None = None,
    links: Mapping[str, Mapping[str, Any]] | None = None,
    proxy_region: str | None = None,
    name: str = "fleet",
    cache: str = "approximate",
) -> dict[str, Any]:
    """A fleet document: ``replicas[region]`` replicas per region, all on one engine profile.

    ``cache: precise`` makes every replica a simulated vLLM that publishes KV events, which the
    router follows (tokenizer ``sim``).

    ``links`` overrides a region's link (default: the link preset of the region's name);
    ``speed`` sets a region's relative GPU speed, and its prefill-rate hint with it.
    """
    prof = get_profile(profile)
    speed = speed or {}
    links = links or {}
    regions = {r: {"sim": dict(links.get(r, {"link": r}))} for r in replicas}
    reps = []
    for region, count in replicas.items():
        s = float(speed.get(region, 1.0))
        for k in range(count):
            sim: dict[str, Any] = {"profile": profile}
            if s != 1.0:
                sim["speed"] = s
            reps.append(with_cache({
                "name": f"{region}-{k}",
                "engine": "sim",
                "region": region,
                "address": f"127.0.0.1:{BASE_PORT + len(reps)}",
                "prefill_rate": s * 1000.0 / prof.c_prefill_ms_per_token,
                "kv_capacity_tokens": prof.kv_capacity_tokens,
                # The engine's concurrency limit, as an operator states it for a real engine.
                "params": {"admission": {"max_running": prof.max_running}},
                "sim": sim,
            }, cache))
    return {
        "name": name,
        "proxy_region": proxy_region or next(iter(replicas)),
        "regions": regions,
        "replicas": reps,
    }


def with_cache(replica: dict[str, Any], cache: str) -> dict[str, Any]:
    """A replica document with the router's cache view ``cache``: ``precise`` makes it a
    simulated vLLM that publishes KV events, followed with the simulator's tokenizer."""
    if cache != "precise":
        return replica
    return {**replica, "cache": cache, "tokenizer": "sim",
            "sim": {**replica["sim"], "flavor": "vllm"}}


PRESETS: dict[str, dict[str, Any]] = {
    # The GORGO paper's fleet: 3 regions x 2 replicas of Qwen3.5-35B-A3B-FP8 on 2xL40S each,
    # RTTs from a proxy in us-east (37/279/456 ms, sd 8/80/138).
    "paper": fleet_document({r: 2 for r in PAPER_REGIONS}, name="paper"),
    # The same six replicas in the proxy's region: routing without geography.
    "one-region": fleet_document({"us-east": 6}, name="one-region"),
    # The paper's regions, with the far region's GPUs half as fast.
    "hetero": fleet_document({r: 2 for r in PAPER_REGIONS}, speed={"ap-seoul": 0.5},
                             name="hetero"),
}


def preset_fleet(name: str) -> FleetSpec:
    try:
        doc = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown fleet preset {name!r} (known: {', '.join(PRESETS)})") from None
    return parse_fleet(doc, source=f"preset:{name}")


def resolve_fleet(arg: str) -> FleetSpec:
    """A preset name, else a fleet YAML path."""
    if arg in PRESETS:
        return preset_fleet(arg)
    path = Path(arg)
    if not path.exists():
        raise ValueError(f"--fleet {arg!r}: neither a preset ({', '.join(PRESETS)}) nor a file")
    return load_fleet(path)
