"""The admin API: token, bounds, unknown replicas, stale versions; applied weights route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from extproc.admin import (
    DISABLED,
    TOKEN_ENV,
    AdminTokenError,
    load_admin_token,
)
from extproc.http_api import make_app
from extproc.telemetry import RouterMetrics
from gorgo.core.contract import WEIGHT_BOUNDS
from gorgo.core.features import extract_features
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def make_router() -> Router:
    return Router(parse_fleet({
        "regions": {"local": {}},
        "replicas": [
            {"name": "a", "engine": "sim", "region": "local", "address": "127.0.0.1:1",
             "prefill_rate": 1000},
            {"name": "b", "engine": "sim", "region": "local", "address": "127.0.0.1:2",
             "prefill_rate": 2000},
        ],
    }))


Call = Callable[..., Awaitable[tuple[int, Any]]]


def with_admin(router: Router, token: str | None, body: Callable[[Call], Awaitable[None]],
               app: web.Application | None = None) -> None:
    """Serve the router's HTTP app (or ``app``) on a free port and run ``body`` with a request
    helper."""

    async def go() -> None:
        nonlocal app
        if app is None:
            app = make_app(RouterMetrics(router.state, lambda: 0), router, token)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as s:
                async def call(method: str, path: str = "/admin/weights", *,
                               headers: dict | None = None, data: Any = None) -> tuple[int, Any]:
                    raw = data if isinstance(data, bytes | str | type(None)) else json.dumps(data)
                    async with s.request(method, base + path, headers=headers, data=raw) as r:
                        text = await r.text()
                        try:
                            return r.status, json.loads(text)
                        except ValueError:
                            return r.status, text

                await body(call)
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_no_token_configured_disables_admin_but_not_metrics() -> None:
    router = make_router()

    async def body(call: Call) -> None:
        status, doc = await call("GET", headers=AUTH)
        assert status == 403 and doc["error"]["message"] == DISABLED
        status, doc = await call("PUT", headers=AUTH, data={"rtt": 1, "queue": 1, "version": 1})
        assert status == 403 and doc["error"]["message"] == DISABLED
        status, _ = await call("GET", "/metrics")
        assert status == 200

    with_admin(router, None, body)
    assert router.state.weights.version == 0


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", "Bearer",
                                    f"Bearer {TOKEN}x"])
def test_missing_or_wrong_token_is_401(header: str | None) -> None:
    router = make_router()

    async def body(call: Call) -> None:
        headers = {"authorization": header} if header else {}
        for method, data in (("GET", None), ("PUT", {"rtt": 2, "queue": 2, "version": 9})):
            status, doc = await call(method, headers=headers, data=data)
            assert status == 401, (method, header)
            assert "token" in doc["error"]["message"]

    with_admin(router, TOKEN, body)
    assert router.state.weights.version == 0


def test_get_and_put_apply_weights_and_rates_to_routing() -> None:
    router = make_router()

    async def body(call: Call) -> None:
        status, doc = await call("GET", headers=AUTH)
        assert status == 200
        assert doc == {"rtt": 1.0, "queue": 1.0, "decode": 1.0, "interference": 0.25, "reuse": 1.0,
                       "version": 0,
                       "prefill_rate": {"a": 1000.0, "b": 2000.0},
                       "prefill_rate_hint": {"a": 1000.0, "b": 2000.0}, "routed": {},
                       "router": router.router_id}
        status, doc = await call("PUT", headers=AUTH, data={
            "rtt": 2.5, "queue": 0.25, "version": 7, "prefill_rate": {"b": 4000}})
        assert status == 200
        assert doc == {"rtt": 2.5, "queue": 0.25, "decode": 1.0, "interference": 0.25, "reuse": 1.0,
                       "version": 7,
                       "prefill_rate": {"a": 1000.0, "b": 4000.0},
                       "prefill_rate_hint": {"a": 1000.0, "b": 2000.0}, "routed": {},
                       "router": router.router_id}
        status, doc = await call("GET", headers={"authorization": f"bearer {TOKEN}"})
        assert status == 200 and doc["version"] == 7
        # null withdraws a rate: back to the fleet file's hint.
        status, doc = await call("PUT", headers=AUTH, data={
            "rtt": 2.5, "queue": 0.25, "version": 8, "prefill_rate": {"b": None}})
        assert status == 200 and doc["prefill_rate"] == {"a": 1000.0, "b": 2000.0}
        status, doc = await call("PUT", headers=AUTH, data={
            "rtt": 2.5, "queue": 0.25, "version": 9, "prefill_rate": {"b": 4000}})
        assert status == 200 and doc["prefill_rate"]["b"] == 4000.0

    with_admin(router, TOKEN, body)
    w = router.state.weights
    assert (w["rtt"], w["queue"], w.version) == (2.5, 0.25, 9)
    # Every later decision is stamped with the active version and priced at the new rate.
    f = extract_features("/v1/completions", {}, b'{"prompt": "' + b"x" * 4000 + b'"}',
                         router.state.tok)
    d = router.route(f, now=0.0)
    assert d.weights_version == 9
    rate = 1000.0 if d.replica == 0 else 4000.0
    assert d.terms["prefill"] == pytest.approx(d.uncached_tokens * 1000.0 / rate)
    # ... and counted under it, which is how the tuner knows when a window has reported back.
    assert router.routed == {9: {d.policy: 1}}


@pytest.mark.parametrize(("payload", "field"), [
    ({"rtt": WEIGHT_BOUNDS["rtt"][0] / 2, "queue": 1, "version": 1}, "rtt"),
    ({"rtt": 1, "queue": WEIGHT_BOUNDS["queue"][1] * 2, "version": 1}, "queue"),
    ({"rtt": 0, "queue": 1, "version": 1}, "rtt"),
    ({"rtt": -1, "queue": 1, "version": 1}, "rtt"),
    ({"rtt": "1", "queue": 1, "version": 1}, "rtt"),
    ({"rtt": True, "queue": 1, "version": 1}, "rtt"),
    ({"version": 1}, None),  # no weight at all
    ({"rtt": 1, "queue": 1}, "version"),
    ({"rtt": 1, "queue": 1, "version": 1.5}, "version"),
    ({"rtt": 1, "queue": 1, "version": -3}, "version"),
    ({"rtt": 1, "queue": 1, "version": 1, "extra": 1}, "extra"),
    ({"rtt": 1, "queue": 1, "version": 1, "prefill_rate": {"zz": 100}}, "prefill_rate.zz"),
    ({"rtt": 1, "queue": 1, "version": 1, "prefill_rate": {"a": 0}}, "prefill_rate.a"),
    ({"rtt": 1, "queue": 1, "version": 1, "prefill_rate": {"a": -5}}, "prefill_rate.a"),
    ({"rtt": 1, "queue": 1, "version": 1, "prefill_rate": [1, 2]}, "prefill_rate"),
])
def test_invalid_update_is_400_naming_the_field(payload: dict, field: str) -> None:
    router = make_router()

    async def body(call: Call) -> None:
        status, doc = await call("PUT", headers=AUTH, data=payload)
        assert status == 400, doc
        assert doc["error"]["field"] == field

    with_admin(router, TOKEN, body)
    assert router.state.weights.version == 0
    assert list(router.state.prefill_rate) == [1000.0, 2000.0]


@pytest.mark.parametrize("raw", [b"{nope", b"[1, 2]", b'"x"', b"NaN", b"\xff\xfe"])
def test_non_object_body_is_400(raw: bytes) -> None:
    async def body(call: Call) -> None:
        status, doc = await call("PUT", headers=AUTH, data=raw)
        assert status == 400 and doc["error"]["field"] is None

    with_admin(make_router(), TOKEN, body)


def test_non_finite_weight_is_400() -> None:
    async def body(call: Call) -> None:
        status, doc = await call("PUT", headers=AUTH,
                                 data='{"rtt": Infinity, "queue": 1, "version": 1}')
        assert status == 400 and doc["error"]["field"] == "rtt"

    with_admin(make_router(), TOKEN, body)


def test_stale_or_equal_version_is_409_with_active_version() -> None:
    router = make_router()

    async def body(call: Call) -> None:
        assert (await call("PUT", headers=AUTH, data={"rtt": 2, "queue": 2, "version": 5}))[0] \
            == 200
        for version in (5, 4, 0):
            status, doc = await call("PUT", headers=AUTH,
                                     data={"rtt": 3, "queue": 3, "version": version})
            assert status == 409
            assert doc["error"]["field"] == "version"
            assert doc["error"]["active_version"] == 5
        assert (await call("PUT", headers=AUTH, data={"rtt": 3, "queue": 3, "version": 6}))[0] \
            == 200

    with_admin(router, TOKEN, body)
    assert (router.state.weights["rtt"], router.state.weights.version) == (3.0, 6)


def test_token_from_file_wins_over_env(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("  from-file \n")
    assert load_admin_token(str(f), {TOKEN_ENV: "from-env"}) == "from-file"
    assert load_admin_token(None, {TOKEN_ENV: " from-env "}) == "from-env"
    assert load_admin_token(None, {TOKEN_ENV: ""}) is None
    assert load_admin_token(None, {}) is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AdminTokenError, match="empty"):
        load_admin_token(str(tmp_path / "empty"), {})
    with pytest.raises(AdminTokenError, match="cannot read"):
        load_admin_token(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("token", ["a b", "a\nb", "a\tb", "t\u00f6k"])
def test_a_token_no_header_carries_as_written_is_refused(tmp_path: Path, token: str) -> None:
    """One check for every bearer token (gorgo.errors.header_token): the tuner sends this one."""
    (tmp_path / "token").write_text(f"{token}\n")
    with pytest.raises(AdminTokenError, match="printable ASCII without spaces"):
        load_admin_token(str(tmp_path / "token"), {})
    with pytest.raises(AdminTokenError, match="printable ASCII without spaces"):
        load_admin_token(None, {TOKEN_ENV: token})


def test_explain_shows_terms_without_routing() -> None:
    router = make_router()
    router.state.observe_rtt(0, 5.0)
    router.state.observe_rtt(1, 50.0)
    request = {"path": "/v1/chat/completions",
               "body": json.dumps({"messages": [{"role": "user", "content": "q" * 400}]})}

    async def body(call: Call) -> None:
        status, out = await call("POST", "/admin/explain", headers=AUTH, data=request)
        assert status == 200
        rows = {r["replica"]: r for r in out["replicas"]}
        # a: 5 ms + 100 tokens at 1000/s = 105 ms; b: 50 ms + 100 tokens at 2000/s = 100 ms.
        assert out["winner"] == "b" and rows["b"]["rtt_ms"] == 50.0
        assert rows["a"]["predicted_ttft_ms"] == pytest.approx(105.0)
        assert rows["a"]["uncached_tokens"] == 100
        status, _ = await call("POST", "/admin/explain", data=request)
        assert status == 401
        status, err = await call("POST", "/admin/explain", headers=AUTH,
                                 data={"body": "{not json"})
        assert status == 400 and err["error"]["type"] == "invalid_request_error"

    with_admin(router, TOKEN, body)
    assert router.open_requests == 0 and router.state.inflight_reqs.sum() == 0


def test_a_weight_left_out_keeps_its_active_value() -> None:
    """A publisher that tunes only some weights (the tuner leaves decode alone) changes those."""
    router = make_router()

    async def body(call: Call) -> None:
        status, _ = await call("PUT", headers=AUTH, data={"decode": 2.5, "version": 1})
        assert status == 200
        status, doc = await call("PUT", headers=AUTH, data={"rtt": 3, "queue": 0.5, "version": 2})
        assert status == 200
        assert (doc["rtt"], doc["queue"], doc["decode"], doc["version"]) == (3.0, 0.5, 2.5, 2)

    with_admin(router, TOKEN, body)
