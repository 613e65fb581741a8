"""Issue 18: first-token times reach the tuner while their streams are still open (Envoy's
periodic access log over OTLP logs), and the span that ends each stream completes the same
decision instead of counting it again. Real Envoy, router, simulated fleet and tuner (LiveStack)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from gorgo.harness.procs import wait_for
from gorgo.harness.stack import LiveStack, StackOptions, with_free_ports
from gorgo.sim.presets import fleet_document

pytestmark = [pytest.mark.envoy, pytest.mark.slow]

STREAMS = 6


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    doc = fleet_document({"near": 2}, profile="h100-llama3-8b",
                         links={"near": {"rtt_ms": 2.0, "jitter_ms": 0.2}}, name="ttft-log")
    doc["timeouts"] = {"request_s": 60}
    opts = StackOptions(tuner=True, tuner_optimizer={"window_samples": 50, "model_step": False},
                        speed=0.5)  # engines at half speed: streams of a few seconds
    with LiveStack(with_free_ports(doc), tmp_path_factory.mktemp("ttft"), opts) as s:
        yield s


def receiver(stack: LiveStack) -> dict[str, Any]:
    return stack.tuner_status()["receiver"]


def test_ttft_samples_reach_the_tuner_before_their_streams_end_and_count_once(
    stack: LiveStack,
) -> None:
    before = receiver(stack)
    seen_open: dict[str, Any] = {}

    async def go() -> list[tuple[int, bool]]:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            started = asyncio.Event()
            first = 0

            async def one(k: int) -> tuple[int, bool]:
                nonlocal first
                body = {"model": "m", "stream": True, "max_tokens": 200, "messages": [
                    {"role": "user", "content": f"stream {k}: " + "lorem ipsum " * 30}]}
                async with s.post(stack.url + "/v1/chat/completions", json=body) as r:
                    await r.content.readany()  # the first chunk
                    first += 1
                    if first == STREAMS:
                        started.set()
                    await started.wait()
                    # every stream has its first token; hold them open until the tuner has
                    # their TTFT (or gives up waiting)
                    ok = await asyncio.to_thread(
                        wait_for, lambda: receiver(stack).get("early_ttft", 0)
                        >= before.get("early_ttft", 0) + STREAMS, 15, 0.2)
                    if not seen_open:
                        seen_open.update(receiver(stack))
                    rest = await r.read()
                    return r.status, ok and bool(rest)
            return list(await asyncio.gather(*(one(k) for k in range(STREAMS))))

    t0 = time.monotonic()
    results = asyncio.run(go())
    assert [status for status, _ in results] == [200] * STREAMS
    assert all(still_open for _, still_open in results), seen_open  # bytes were still to come
    assert seen_open["early_ttft"] - before.get("early_ttft", 0) == STREAMS
    assert seen_open.get("ends_joined", 0) == before.get("ends_joined", 0)  # none had ended
    # Envoy then exports each stream's span: it completes the decision, it is not a new one.
    assert wait_for(lambda: receiver(stack).get("ends_joined", 0)
                    >= before.get("ends_joined", 0) + STREAMS, 20, 0.2), receiver(stack)
    after = receiver(stack)
    counted = (after["early_ttft"] + after.get("late_ttft", 0)
               - before.get("early_ttft", 0) - before.get("late_ttft", 0))
    assert counted == STREAMS
    assert after["ends_joined"] - before.get("ends_joined", 0) == STREAMS
    assert after["log_samples"] - before.get("log_samples", 0) >= STREAMS  # and repeats ...
    assert after.get("duplicates", 0) - before.get("duplicates", 0) == (
        after["log_samples"] - before.get("log_samples", 0) - STREAMS)  # ... counted for nothing
    print(f"{STREAMS} streams in {time.monotonic() - t0:.1f} s; receiver {after}")
