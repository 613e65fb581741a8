"""What the router learns from Envoy's admin API when Envoy skips the response-headers round trip.

With the fleet's ``extproc: {response_headers: skip}`` no response status reaches the router, so
the per-response failure signal (penalty, ejection) would be lost. Envoy still counts every
answer per upstream host (``rq_error``: 5xx and failed attempts; ``rq_success``: the rest) and
flags a host its outlier detection ejected (``failed_outlier_check``). This poller reads
``/clusters?format=json`` every scrape interval and applies the increments to the router's state
exactly as the response-headers handler would have applied each status: a failure is a
`record_failed_response`, a success window a `record_good_response`. A new ejection by Envoy
counts as one failure more. The signal arrives up to one scrape interval late instead of with the
response.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from extproc.telemetry import RepeatedFailures, log_event
from gorgo.core.decimals import whole_number
from gorgo.core.fleet import FleetSpec, unbracketed
from gorgo.core.router import Router

log = logging.getLogger("gorgo.envoy_admin")
# More new failures than this in one poll are applied as this many: a counter that jumped by
# billions (not an Envoy's, or a corrupt answer) must not hold the router's loop in a loop.
MAX_FAILURES_PER_POLL = 10_000


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _counter(value: Any) -> int | None:
    """A counter as Envoy's JSON writes it (a uint64: a decimal string, or a number)."""
    if isinstance(value, str):
        return whole_number(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class EnvoyOutcomes:
    """Polls one Envoy's admin API and feeds each replica's new errors and successes to the
    router's state. Runs on the router's loop, where every other state writer runs."""

    def __init__(self, router: Router, admin: str, clock=time.monotonic) -> None:
        self.router = router
        self.clock = clock
        base = admin if "://" in admin else f"http://{admin}"
        self.url = base.rstrip("/") + "/clusters?format=json"
        self._spec: FleetSpec | None = None  # the fleet the maps below index
        self._by_cluster: dict[str, int] = {}
        self._by_host: dict[tuple[str, int], int] = {}
        # (cluster, host:port) -> (rq_error, rq_success, ejected) at the last poll
        self._last: dict[tuple[str, str], tuple[int, int, bool]] = {}
        self._task: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None
        self.polls = 0  # successful polls, for tests and readiness of the signal
        self.failed_polls = 0
        self._log_failure = RepeatedFailures(log, "envoy_admin_poll_failed")

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.router.spec.timeouts.probe_ms / 1000)
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        interval = self.router.spec.signals.scrape_interval_s
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Envoy down, a bad answer: poll again, never stop
                self._failed(exc)
            await asyncio.sleep(interval)

    def _failed(self, exc: Exception) -> None:
        """Counted always; logged once per distinct failure (`RepeatedFailures`)."""
        self.failed_polls += 1
        self._log_failure(exc, url=self.url, failed_polls=self.failed_polls)

    async def poll(self) -> None:
        assert self._session is not None
        async with self._session.get(self.url) as resp:
            resp.raise_for_status()
            data = await resp.json(content_type=None)
        self.apply(data, self.clock())
        self.polls += 1

    def _replica(self, cluster: str, address: Mapping[str, Any]) -> int | None:
        """A replica's own cluster, else a replica's address in a shared one (the retries'
        fleet cluster, the endpoint picker's original-destination cluster)."""
        i = self._by_cluster.get(cluster)
        host, port = address.get("address"), address.get("port_value")
        if i is None and isinstance(host, str) and isinstance(port, int):
            i = self._by_host.get((host, port))
        return i

    def _index(self) -> None:
        """Map clusters and addresses to the running fleet's replica indices, again after each
        reload (a reordered, shrunk or grown fleet charged errors to the wrong replica)."""
        spec = self.router.spec
        if spec is self._spec:
            return
        self._spec = spec
        self._by_cluster = {r.cluster: i for i, r in enumerate(spec.replicas)}
        self._by_host = {(unbracketed(r.host), r.port): i
                         for i, r in enumerate(spec.replicas)}

    def apply(self, data: Mapping[str, Any], now: float) -> None:
        """Apply one /clusters?format=json answer; the first sight of a host (or a counter that
        went back, Envoy restarted) only sets the baseline."""
        self._index()
        s = self.router.state
        for cluster in map(_dict, _list(_dict(data).get("cluster_statuses"))):
            name = cluster.get("name")
            if not isinstance(name, str):
                continue
            for host in map(_dict, _list(cluster.get("host_statuses"))):
                address = _dict(_dict(host.get("address")).get("socket_address"))
                i = self._replica(name, address)
                if i is None:
                    continue
                stats = {st.get("name"): _counter(st.get("value", 0))
                         for st in map(_dict, _list(host.get("stats")))}
                errors, ok = stats.get("rq_error", 0), stats.get("rq_success", 0)
                if errors is None or ok is None:  # unreadable: this host waits for the next
                    continue
                ejected = bool(_dict(host.get("health_status")).get("failed_outlier_check"))
                key = (name, f"{address.get('address')}:{address.get('port_value')}")
                prev = self._last.get(key)
                self._last[key] = (errors, ok, ejected)
                if prev is None or errors < prev[0] or ok < prev[1]:
                    continue
                new_errors, new_ok = errors - prev[0], ok - prev[1]
                if new_ok and not new_errors:
                    s.record_good_response(i)
                for _ in range(min(new_errors, MAX_FAILURES_PER_POLL)):
                    s.record_failed_response(i, now)
                if ejected and not prev[2]:
                    s.record_failed_response(i, now)
                    log_event(log, "envoy_ejected_replica", logging.WARNING,
                              replica=s.names[i], cluster=name)
