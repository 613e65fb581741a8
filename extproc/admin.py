"""The router's admin API: `GET/PUT /admin/weights` and `POST /admin/explain` on the metrics port.

The tuner publishes through it, and so can an operator. It changes routing for every request, so
it is closed unless a token is configured (403 "admin API disabled"), every call must carry
``Authorization: Bearer <token>`` (compared in constant time), and a PUT is checked completely
before anything is applied: weights inside bounds, only known replicas, positive finite rates, and
a version above the active one (409 otherwise), so a delayed or replayed update cannot roll the
router back. The router never calls out to the tuner: if the tuner dies, the last weights stay.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from gorgo.core.contract import PREFILL_RATE_BOUNDS, VERSION_MAX, WEIGHT_BOUNDS
from gorgo.core.explain import explain
from gorgo.core.features import RequestError, extract_features
from gorgo.core.router import Router
from gorgo.core.weights import Weights
from gorgo.errors import UserError

log = logging.getLogger("gorgo.admin")

TOKEN_ENV = "GORGO_ADMIN_TOKEN"
DISABLED = "admin API disabled"
_FIELDS = (*WEIGHT_BOUNDS, "version", "prefill_rate")


class AdminTokenError(UserError, ValueError):
    """The configured token file cannot be used."""


def load_admin_token(path: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The token from ``path`` if given, else from $GORGO_ADMIN_TOKEN; None disables the API."""
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise AdminTokenError(f"{path}: cannot read admin token: {exc.strerror}") from None
        if not token:
            raise AdminTokenError(f"{path}: admin token file is empty")
        return token
    token = env.get(TOKEN_ENV, "").strip()
    return token or None


class _Invalid(Exception):
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


def _number(value: Any, field: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(400, f"{field} must be a number", field)
    x = float(value)
    if not math.isfinite(x) or not lo <= x <= hi:
        raise _Invalid(400, f"{field}={value!r} is outside [{lo:g}, {hi:g}]", field)
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
        if self._token is None:
            return _error(403, DISABLED)
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                                 self._token)
        return None if ok else _error(401, "missing or wrong bearer token")

    def current(self) -> dict[str, Any]:
        s = self.router.state
        w = s.weights
        return {**w, "version": w.version,
                "prefill_rate": {name: float(r) for name, r in zip(s.names, s.prefill_rate,
                                                                    strict=True)},
                "prefill_rate_hint": {r.name: float(r.prefill_rate)
                                      for r in self.router.spec.replicas},
                "routed": {str(v): dict(c) for v, c in self.router.routed.items()}}

    async def get(self, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        return denied or web.json_response(self.current())

    async def put(self, request: web.Request) -> web.Response:
        denied = self._authorize(request)
        if denied is not None:
            self.updates.labels("denied").inc()
            return denied
        try:
            weights, rates = self._validate(await request.read())
        except _Invalid as exc:
            self.updates.labels(str(exc.status)).inc()
            return exc.response()
        self.router.state.set_weights(weights, rates)
        self.updates.labels("applied").inc()
        log.info("weights v%d applied: %s%s", weights.version,
                 " ".join(f"{k}={v:g}" for k, v in weights.items()),
                 f" prefill_rate={rates}" if rates else "")
        return web.json_response(self.current())

    def _validate(self, raw: bytes) -> tuple[Weights, dict[str, float | None]]:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise _Invalid(400, "body is not valid JSON", None) from None
        if not isinstance(body, dict):
            raise _Invalid(400, "body must be a JSON object", None)
        for key in body:
            if key not in _FIELDS:
                raise _Invalid(400, f"unknown field {key!r} (allowed: {', '.join(_FIELDS)})", key)
        for key in (*WEIGHT_BOUNDS, "version"):
            if key not in body:
                raise _Invalid(400, f"{key} is required", key)
        values = {k: _number(body[k], k, lo, hi) for k, (lo, hi) in WEIGHT_BOUNDS.items()}
        version = body["version"]
        if (isinstance(version, bool) or not isinstance(version, int)
                or not 0 <= version <= VERSION_MAX):
            raise _Invalid(400, f"version must be an integer in [0, {VERSION_MAX}]", "version")
        rates: dict[str, float | None] = {}
        raw_rates = body.get("prefill_rate")
        if raw_rates is not None:
            if not isinstance(raw_rates, dict):
                raise _Invalid(400, "prefill_rate must be an object {replica: tokens/s or null}",
                               "prefill_rate")
            names = self.router.state.names
            for name, value in raw_rates.items():
                field = f"prefill_rate.{name}"
                if name not in names:
                    raise _Invalid(400, f"unknown replica {name!r}", field)
                # null: back to the fleet file's hint (an operator undoing a calibrated rate)
                rates[name] = None if value is None else _number(value, field,
                                                                 *PREFILL_RATE_BOUNDS)
        active = self.router.state.weights.version
        if version <= active:
            raise _Invalid(409, f"version {version} is not above the active version {active}",
                           "version", active_version=active)
        return Weights(values, version), rates


    async def explain(self, request: web.Request) -> web.Response:
        """Each replica's terms for a request, on the live state, without routing it."""
        denied = self._authorize(request)
        if denied is not None:
            return denied
        try:
            spec = json.loads(await request.read())
            if not isinstance(spec, dict):
                raise ValueError("body must be a JSON object")
            path = str(spec.get("path", "/v1/chat/completions"))
            headers = {str(k).lower(): str(v) for k, v in (spec.get("headers") or {}).items()}
            body = str(spec.get("body", "")).encode()
        except (ValueError, AttributeError) as exc:
            return _error(400, f"expected {{path, headers, body}}: {exc}")
        depth = self.router.spec.limits.max_json_depth
        try:
            f = extract_features(path, headers, body, self.router.state.tok, depth)
        except RequestError as err:
            return web.json_response(err.to_body(), status=err.status)
        return web.json_response(explain(self.router, f, time.monotonic()).to_dict())


def add_admin_routes(
    app: web.Application,
    router: Router,
    token: str | None,
    registry: CollectorRegistry | None = None,
) -> AdminApi:
    api = AdminApi(router, token, registry)
    app.router.add_get("/admin/weights", api.get)
    app.router.add_put("/admin/weights", api.put)
    app.router.add_post("/admin/explain", api.explain)
    return api
