"""bench/precise_live.py's replay: each user's turns reach the server in order."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from bench.precise_live import replay


async def _replay_in_order_of_arrival(requests: list[tuple[int, str]]) -> list[str]:
    arrived: list[str] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        prompt = json.loads(await request.read())["messages"][0]["content"]
        arrived.append(prompt)
        resp = web.StreamResponse()
        await resp.prepare(request)
        await asyncio.sleep(0.05 if prompt.endswith("0") else 0.01)  # a slower first turn
        await resp.write(b"data: {}\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        ttfts = await replay(f"http://{host}:{port}", requests, workers=2, max_tokens=1)
    finally:
        await runner.cleanup()
    assert len(ttfts) == len(requests)
    return arrived


def test_a_users_turns_are_sent_in_order() -> None:
    """Before: the client that finished turn 0 took turn 2 and sent it while the other client
    still waited with turn 1."""
    requests = [(0, "u0 t0"), (0, "u0 t1"), (0, "u0 t2"), (1, "u1 t0"), (0, "u0 t3")]
    arrived = asyncio.run(_replay_in_order_of_arrival(requests))
    assert [p for p in arrived if p.startswith("u0")] == ["u0 t0", "u0 t1", "u0 t2", "u0 t3"]
    assert "u1 t0" in arrived
