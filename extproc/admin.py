"""The router's admin API on the metrics port: `GET/PUT /admin/weights`, `POST /admin/explain`,
and the fleet's membership under `/admin/fleet` (extproc/reload.py).

The tuner publishes through it, and so can an operator. It changes routing for every request, so
it is closed unless a token is configured (403 "admin API disabled"), every call must carry
``Authorization: Bearer <token>`` (compared in constant time), and a PUT is checked completely
before anything is applied: weights inside bounds, only known replicas, positive finite rates, and
a version above the active one (409 otherwise), so a delayed or replayed update cannot roll the
router back. The router never calls out to the tuner: if the tuner dies, the last weights stay.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from extproc.bodies import TooLarge, read_capped
from extproc.reload import FleetReloader
from extproc.telemetry import log_event
from gorgo.core.contract import PREFILL_RATE_BOUNDS, VERSION_MAX, WEIGHT_BOUNDS
from gorgo.core.explain import explain
from gorgo.core.features import RequestError, extract_features, parse_json_body
from gorgo.core.fleet import FleetError
from gorgo.core.membership import FleetDiff
from gorgo.core.router import Router
from gorgo.core.weights import Weights
from gorgo.errors import UserError, header_token

log = logging.getLogger("gorgo.admin")

TOKEN_ENV = "GORGO_ADMIN_TOKEN"
DISABLED = "admin API disabled"
WEIGHTS_MAX_BYTES = 1 << 20  # a weights update, prefill rates of thousands of replicas included
DOCUMENT_MAX_BYTES = 8 << 20  # a whole fleet document, as YAML text in JSON
MAX_DEPTH = 8  # nesting of an admin body (a weights update needs 2 levels)
_FIELDS = (*WEIGHT_BOUNDS, "version", "prefill_rate")


class AdminTokenError(UserError, ValueError):
    """The configured token file cannot be used."""


def load_admin_token(path: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The token from ``path`` if given, else from $GORGO_ADMIN_TOKEN; None disables the API."""
    where = path or f"${TOKEN_ENV}"
    if path:
        try:
            token = Path(path).read_bytes().decode("ascii", "replace").strip()
        except OSError as exc:
            raise AdminTokenError(f"{path}: cannot read admin token: {exc.strerror}") from None
        if not token:
            raise AdminTokenError(f"{path}: admin token file is empty")
    else:
        token = env.get(TOKEN_ENV, "").strip()
        if not token:
            return None
    if not header_token(token):
        raise AdminTokenError(f"{where}: admin token must be printable ASCII without spaces")
    return token


class Invalid(Exception):
    def __init__(self, status: int, message: str, field: str | None, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.extra = extra

    def response(self) -> web.Response:
        return _error(self.status, self.message, self.field, **self.extra)


def _error(status: int, message: str, field: str | None = None, **extra: Any) -> web.Response:
    body = {"error": {"message": message, "field": field, **extra}}
    headers = {"www-authenticate": "Bearer"} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused (413, an `Invalid`) before it can cost more than ``limit`` bytes."""
    if (request.content_length or 0) > limit:
        raise Invalid(413, f"body is over {limit} bytes", None)
    try:
        return await read_capped(request.content, limit, "body")
    except TooLarge:
        raise Invalid(413, f"body is over {limit} bytes", None) from None


async def _read_json(request: web.Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, refused (413, 400) before it can cost more than ``limit``
    bytes or ``MAX_DEPTH`` levels of nesting."""
    raw = await read_body(request, limit)
    try:
        return parse_json_body(raw, MAX_DEPTH)
    except RequestError as err:
        raise Invalid(400, err.message, None) from None


def authorize(request: web.Request, token: bytes | None) -> web.Response | None:
    """None when ``request`` carries the operator's bearer token; else the error to answer
    (403 while the admin API is off: no token configured)."""
    if token is None:
        return _error(403, DISABLED)
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given = given.strip()
    # A token is ASCII (load_admin_token): anything else is wrong, not a decoding error.
    ok = scheme.lower() == "bearer" and given.isascii() and hmac.compare_digest(given.encode(),
                                                                                 token)
    return None if ok else _error(401, "missing or wrong bearer token")


def _number(value: Any, field: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(400, f"{field} must be a number", field)
    try:
        x = float(value)
    except OverflowError:  # an integer of hundreds of digits: a 500 with a traceback
        raise Invalid(400, f"{field} is outside [{lo:g}, {hi:g}]", field) from None
    if not math.isfinite(x) or not lo <= x <= hi:
        raise Invalid(400, f"{field}={value!r} is outside [{lo:g}, {hi:g}]", field)
    return x


class AdminApi:
    def __init__(self, router: Router, token: str | None, registry: CollectorRegistry | None):
        self.router = router
        self._token = token.encode() if token else None
        self.updates = Counter(
            "gorgo_admin_weight_updates", "PUT /admin/weights by outcome", ["result"],
            registry=registry,
        )

    def _authorize(self, request: web.Request) -> web.Response | None:
        return authorize(request, self._token)

    def current(self) -> dict[str, Any]:
        s = self.router.state
        w = s.weights
        return {**w, "version": w.version,
                "prefill_rate": {name: float(r) for name, r in zip(s.names, s.prefill_rate,
                                                                    strict=True)},
                "prefill_rate_hint": {r.name: float(r.prefill_rate)
                                      for r in self.router.spec.replicas},
                "routed": {str(v): dict(c) for v, c in self.router.routed.items()},
                "router": self.router.router_id}

    async def get(self, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        return denied or web.json_response(self.current())

    async def put(self, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        if denied is not None:
            self.updates.labels("denied").inc()
            return denied
        try:
            weights, rates = self._validate(await _read_json(request, WEIGHTS_MAX_BYTES))
        except Invalid as exc:
            self.updates.labels(str(exc.status)).inc()
            return exc.response()
        self.router.state.set_weights(weights, rates)
        self.updates.labels("applied").inc()
        log_event(log, "weights_applied", version=weights.version, **weights,
                  **({"prefill_rate": ",".join(f"{k}:{v}" for k, v in rates.items())}
                     if rates else {}))
        return web.json_response(self.current())

    def _validate(self, body: dict[str, Any]) -> tuple[Weights, dict[str, float | None]]:
        for key in body:
            if key not in _FIELDS:
                raise Invalid(400, f"unknown field {key!r} (allowed: {', '.join(_FIELDS)})", key)
        if "version" not in body:
            raise Invalid(400, "version is required", "version")
        if not set(WEIGHT_BOUNDS) & set(body):
            raise Invalid(400, f"at least one weight is required ({', '.join(WEIGHT_BOUNDS)})",
                           None)
        # A weight left out keeps its active value (a publisher that tunes only some of them).
        values = {k: _number(body[k], k, lo, hi) for k, (lo, hi) in WEIGHT_BOUNDS.items()
                  if k in body}
        version = body["version"]
        if (isinstance(version, bool) or not isinstance(version, int)
                or not 0 <= version <= VERSION_MAX):
            raise Invalid(400, f"version must be an integer in [0, {VERSION_MAX}]", "version")
        rates: dict[str, float | None] = {}
        raw_rates = body.get("prefill_rate")
        if raw_rates is not None:
            if not isinstance(raw_rates, dict):
                raise Invalid(400, "prefill_rate must be an object {replica: tokens/s or null}",
                               "prefill_rate")
            names = self.router.state.names
            for name, value in raw_rates.items():
                field = f"prefill_rate.{name}"
                if name not in names:
                    raise Invalid(400, f"unknown replica {name!r}", field)
                # null: back to the fleet file's hint (an operator undoing a calibrated rate)
                rates[name] = None if value is None else _number(value, field,
                                                                 *PREFILL_RATE_BOUNDS)
        active = self.router.state.weights.version
        if version <= active:
            raise Invalid(409, f"version {version} is not above the active version {active}",
                           "version", active_version=active)
        return self.router.state.weights.replace(values, version), rates


    async def explain(self, request: web.Request) -> web.Response:
        """Each replica's terms for a request, on the live state, without routing it."""
        denied = self._authorize(request)
        if denied is not None:
            return denied
        try:
            # The request's own body rides as a JSON string: room for it escaped.
            spec = await _read_json(request, 2 * self.router.spec.limits.max_body_bytes + 65536)
        except Invalid as exc:
            return exc.response()
        try:
            path = str(spec.get("path", "/v1/chat/completions"))
            headers = {str(k).lower(): str(v) for k, v in (spec.get("headers") or {}).items()}
            body = str(spec.get("body", "")).encode()
        except (ValueError, AttributeError) as exc:
            return _error(400, f"expected {{path, headers, body}}: {exc}")
        try:
            f = extract_features(path, headers, body, self.router.state.tok,
                                 policies=self.router.policies, limits=self.router.spec.limits)
        except RequestError as err:
            return web.json_response(err.to_body(), status=err.status)
        return web.json_response(explain(self.router, f, time.monotonic()).to_dict())


class FleetAdmin:
    """`/admin/fleet`: the fleet as the router runs it, and its membership changes (reload from
    the file, add, remove, drain), each validated whole before anything changes (400 naming the
    field otherwise, the old fleet routing on)."""

    def __init__(self, api: AdminApi, reloader: FleetReloader) -> None:
        self.api = api
        self.reloader = reloader

    async def _change(self, request: web.Request, change: Callable[[], FleetDiff]) -> web.Response:
        denied = self.api._authorize(request)
        if denied is not None:
            return denied
        try:
            diff = change()
        except KeyError as exc:
            return _error(404, f"unknown replica {exc.args[0]!r}", "name")
        except Invalid as exc:
            return exc.response()
        except FleetError as exc:
            return _error(400, f"fleet not changed: {exc}")
        return web.json_response({**diff.to_dict(), **self.reloader.status()})

    async def get(self, request: web.Request) -> web.Response:
        denied = self.api._authorize(request)
        return denied or web.json_response(self.reloader.status())

    async def reload(self, request: web.Request) -> web.Response:
        return await self._change(request, lambda: self.reloader.reload_file("admin reload"))

    async def add(self, request: web.Request) -> web.Response:
        if self.api._authorize(request) is not None:
            return self.api._authorize(request)
        try:
            raw = await _read_json(request, WEIGHTS_MAX_BYTES)
        except Invalid as exc:
            return exc.response()
        return await self._change(request, lambda: self.reloader.add(raw))

    async def remove(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return await self._change(request, lambda: self.reloader.remove(name))

    async def get_document(self, request: web.Request) -> web.Response:
        denied = self.api._authorize(request)
        if denied is not None:
            return denied
        try:
            return web.json_response(self.reloader.document())
        except FleetError as exc:
            return _error(404, str(exc))

    async def put_document(self, request: web.Request) -> web.Response:
        """Run another document (a restarted worker takes its peers'), validated whole."""
        if self.api._authorize(request) is not None:
            return self.api._authorize(request)
        try:
            body = await _read_json(request, DOCUMENT_MAX_BYTES)
        except Invalid as exc:
            return exc.response()
        text, stamp = body.get("document"), body.get("file_stamp")
        if not isinstance(text, str) or set(body) - {"document", "file_stamp"}:
            return _error(400, "expected {\"document\": YAML text, \"file_stamp\": "
                               "[inode, mtime_ns, size] or null}", "document")
        if stamp is not None and not (isinstance(stamp, list) and len(stamp) == 3 and all(
                type(v) is int and 0 <= v < 1 << 64 for v in stamp)):
            return _error(400, "file_stamp: expected [inode, mtime_ns, size] or null",
                          "file_stamp")
        return await self._change(request, lambda: self.reloader.adopt(
            text, None if stamp is None else tuple(stamp)))

    async def drain(self, request: web.Request) -> web.Response:
        if self.api._authorize(request) is not None:
            return self.api._authorize(request)
        name = request.match_info["name"]
        try:
            body = await _read_json(request, WEIGHTS_MAX_BYTES) if request.can_read_body else {}
        except Invalid as exc:
            return exc.response()
        drain = body.get("drain", True)
        if not isinstance(drain, bool) or set(body) - {"drain"}:
            return _error(400, "expected {\"drain\": true|false}", "drain")
        return await self._change(request, lambda: self.reloader.drain(name, drain))


def add_admin_routes(
    app: web.Application,
    router: Router,
    token: str | None,
    registry: CollectorRegistry | None = None,
    reloader: FleetReloader | None = None,
) -> AdminApi:
    api = AdminApi(router, token, registry)
    app.router.add_get("/admin/weights", api.get)
    app.router.add_put("/admin/weights", api.put)
    app.router.add_post("/admin/explain", api.explain)
    if reloader is not None:
        fleet = FleetAdmin(api, reloader)
        app.router.add_get("/admin/fleet", fleet.get)
        app.router.add_post("/admin/fleet/reload", fleet.reload)
        app.router.add_get("/admin/fleet/document", fleet.get_document)
        app.router.add_put("/admin/fleet/document", fleet.put_document)
        app.router.add_post("/admin/fleet/replicas", fleet.add)
        app.router.add_delete("/admin/fleet/replicas/{name}", fleet.remove)
        app.router.add_post("/admin/fleet/replicas/{name}/drain", fleet.drain)
    return api
