"""Publishes the tuner's weights to every router's admin API (`PUT /admin/weights`).

The body (`Proposal.body`) carries the weights the tuner searches (its objective's keys; the admin
API takes any of the contract's ``WEIGHT_BOUNDS``, at least one, and keeps the others), the
version and, when calibrated, the prefill rates.

Publishing is a reconciliation, not a fire-and-forget: each router's acknowledged version is
tracked and a router that missed an update (down, slow, restarted) gets it on a later tick, with a
backoff. A 409 means the router already holds a version at or above ours (a previous tuner run
whose state was lost, an operator's manual update, or an ack that got lost): `sync` reports that
version so the caller can renumber the proposal above it.

The routers are the truth about themselves: every tick the caller hands over each router's
``GET /admin/weights`` (`observe`). A router whose active version is not the one it acknowledged
(restarted on its fleet file's weights, or updated by someone else) is due again; and a router is
only ever sent rates for the replicas it reported, so a name it does not know (one a span made up,
or a replica removed from its fleet file) can never get the update refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from tuner.optimizer import Proposal

log = logging.getLogger("gorgo.tuner.publisher")
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0
# How long a tick waits for the routers' answers. A router that answers later (a hung one: up to
# the publish timeout, 12 s) is taken at a later tick and held no one else's: one hung router
# kept every tick for the whole timeout (1 tick in 20 s where 40 ran), and the healthy routers
# got no weights until it answered.
ANSWER_WAIT_S = 1.0


@dataclass(frozen=True, slots=True)
class RouterTarget:
    url: str  # base URL of the router's metrics/admin port, e.g. http://127.0.0.1:50052
    token: str

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/admin/weights"


@dataclass(frozen=True, slots=True)
class PublishResult:
    url: str
    status: int  # HTTP status; 0 when the router did not answer
    active_version: int | None = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass(slots=True)
class _Track:
    acked: int = -1
    retry_at: float = 0.0
    backoff: float = RETRY_MIN_S
    error: str = ""
    published: int = 0
    failed: int = 0
    replicas: frozenset[str] | None = None  # what the router last reported; None: not yet


class Publisher:
    def __init__(self, targets: list[RouterTarget], timeout_s: float = 2.0, clock=time.monotonic,
                 answer_wait_s: float = ANSWER_WAIT_S):
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self.clock = clock
        self.answer_wait_s = answer_wait_s  # what `poll` and `sync` wait at most
        self._track = {t.url: _Track() for t in self.targets}
        self._session: aiohttp.ClientSession | None = None
        # Requests still out, at most one of each kind per router: (task, version sent).
        self._fetching: dict[str, asyncio.Task[dict[str, Any] | None]] = {}
        self._putting: dict[str, tuple[asyncio.Task[PublishResult], int]] = {}

    async def __aenter__(self) -> Publisher:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, *exc: object) -> None:
        out = [*self._fetching.values(), *(task for task, _ in self._putting.values())]
        for task in out:
            task.cancel()
        await asyncio.gather(*out, return_exceptions=True)
        self._fetching.clear()
        self._putting.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self, t: RouterTarget) -> dict[str, str]:
        return {"authorization": f"Bearer {t.token}"}

    async def fetch(self, t: RouterTarget, *, quiet: bool = False) -> dict[str, Any] | None:
        """The router's active weights, or None if it did not answer with them (``quiet``: a
        poll repeated every tick, whose failures the publishing path already reports)."""
        assert self._session is not None, "use `async with Publisher(...)`"
        try:
            async with self._session.get(t.endpoint, headers=self._headers(t)) as r:
                if r.status != 200:
                    if not quiet:
                        log.warning("GET %s: HTTP %d", t.endpoint, r.status)
                    return None
                return await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if not quiet:
                log.warning("GET %s: %s", t.endpoint, exc or type(exc).__name__)
            return None

    async def poll(self) -> list[dict[str, Any] | None]:
        """Every router's GET /admin/weights, in target order, waiting at most
        ``answer_wait_s``: None for a router that did not answer (yet: its request stays out,
        one at a time, and its answer is returned by the call that finds it done)."""
        for t in self.targets:
            if t.url not in self._fetching:
                self._fetching[t.url] = asyncio.create_task(self.fetch(t, quiet=True))
        await asyncio.wait(self._fetching.values(), timeout=self.answer_wait_s)
        docs: list[dict[str, Any] | None] = []
        for t in self.targets:
            task = self._fetching.get(t.url)
            done = task is not None and task.done()
            docs.append(self._fetching.pop(t.url).result() if done else None)
        return docs

    def observe(self, t: RouterTarget, doc: dict[str, Any]) -> None:
        """A router's GET /admin/weights: its replica set, and whether it still holds what it
        acknowledged (if not, it is due at once)."""
        tr = self._track[t.url]
        names = doc.get("prefill_rate")
        if isinstance(names, dict):
            tr.replicas = frozenset(str(k) for k in names)
        version = doc.get("version")
        if isinstance(version, int) and tr.acked >= 0 and version != tr.acked:
            log.warning("%s holds v%d, not the v%d it acknowledged (restarted?): republishing",
                        t.url, version, tr.acked)
            tr.acked, tr.retry_at, tr.backoff = -1, 0.0, RETRY_MIN_S

    def replicas(self) -> set[str] | None:
        """Every replica some router reported; None until one has."""
        known = [tr.replicas for tr in self._track.values() if tr.replicas is not None]
        return set().union(*known) if known else None

    def _body(self, t: RouterTarget, proposal: Proposal) -> dict[str, Any]:
        body = proposal.body()
        known = self._track[t.url].replicas
        if "prefill_rate" in body and known is not None:
            rates = {k: v for k, v in body["prefill_rate"].items() if k in known}
            if rates:
                body["prefill_rate"] = rates
            else:
                del body["prefill_rate"]
        return body

    async def put(self, t: RouterTarget, proposal: Proposal) -> PublishResult:
        assert self._session is not None, "use `async with Publisher(...)`"
        try:
            async with self._session.put(t.endpoint, json=self._body(t, proposal),
                                         headers=self._headers(t)) as r:
                try:
                    body = await r.json(content_type=None)
                except ValueError:
                    body = {}
                if not isinstance(body, dict):  # a proxy's answer, not the router's
                    body = {}
                if r.status == 200:
                    return PublishResult(t.url, 200, body.get("version"))
                err = body.get("error", {})
                active = err.get("active_version") if isinstance(err, dict) else None
                message = err.get("message", "") if isinstance(err, dict) else ""
                return PublishResult(t.url, r.status, active if isinstance(active, int) else None,
                                     message or f"HTTP {r.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            return PublishResult(t.url, 0, None, str(exc) or type(exc).__name__)

    async def sync(self, proposal: Proposal) -> int | None:
        """Bring every due router to ``proposal``, waiting at most ``answer_wait_s`` for their
        answers (a later one is settled by the call that finds it done); a version floor if one
        holds a newer version."""
        now = self.clock()
        version = proposal.weights.version
        for t in self.targets:
            tr = self._track[t.url]
            if t.url not in self._putting and tr.acked < version and now >= tr.retry_at:
                self._putting[t.url] = (asyncio.create_task(self.put(t, proposal)), version)
        if not self._putting:
            return None
        await asyncio.wait([task for task, _ in self._putting.values()],
                           timeout=self.answer_wait_s)
        floor: int | None = None
        for url, (task, sent) in list(self._putting.items()):
            if task.done():
                del self._putting[url]
                held = self._settle(task.result(), sent)
                if held is not None:
                    floor = held if floor is None else max(floor, held)
        return floor

    def _settle(self, r: PublishResult, version: int) -> int | None:
        """A router's answer to version ``version``: acknowledged, or due again after a backoff;
        the version it holds when that is newer (409)."""
        tr = self._track[r.url]
        if r.ok:
            # A GET still out was answered before this version: its answer would read as a
            # router that lost it (restarted?) and get it republished, then renumbered (409).
            stale = self._fetching.pop(r.url, None)
            if stale is not None:
                stale.cancel()
            tr.acked = max(tr.acked, version)
            tr.backoff, tr.retry_at, tr.error = RETRY_MIN_S, 0.0, ""
            tr.published += 1
            return None
        tr.failed += 1
        if r.status == 409 and r.active_version is not None:
            return r.active_version  # renumbered and retried at once by the caller
        if r.error != tr.error:
            log.warning("publishing v%d to %s failed: %s", version, r.url, r.error)
        tr.error = r.error
        tr.retry_at = self.clock() + tr.backoff
        tr.backoff = min(tr.backoff * 2, RETRY_MAX_S)
        return None

    def status(self) -> list[dict[str, Any]]:
        return [{"url": t.url, "acked_version": self._track[t.url].acked,
                 "published": self._track[t.url].published, "failed": self._track[t.url].failed,
                 "error": self._track[t.url].error} for t in self.targets]
