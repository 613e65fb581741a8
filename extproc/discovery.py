"""DNS discovery's I/O half: resolve each ``discover:`` name (its family's A or AAAA records, at
most MAX_ADDRESSES) and re-resolve
it on its interval, turning each changed answer into a new FleetSpec (gorgo.core.discovery).

Resolution uses the system resolver (`socket.getaddrinfo`, in a thread: it blocks), as the pods'
own lookups do, so a headless Service answers with its ready pods. A failed or empty answer keeps
the last set: a resolver blip must not empty the fleet. Each change goes to ``on_change`` with the
new spec and the added and removed replica names, on the loop that runs `DnsDiscovery`: the
router's membership reload (`ExtProcServer`) takes it on, and a change it refuses (FleetError) is
not committed, so the next interval tries again. The router's fleet reloads parse through
`parse` (its names resolved, never the unresolved name) and hand the document they took on back
through `follow`, so a changed ``discover:`` entry is re-resolved on its own interval.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from extproc.reload import file_stamp
from extproc.telemetry import log_event
from gorgo.core.discovery import (
    MAX_ADDRESSES,
    DnsSource,
    NoAddressYet,
    dns_sources,
    of_family,
    parse_discovered,
)
from gorgo.core.fleet import FleetError, FleetSpec, read_fleet

# How often a reload may resolve again a name new to the fleet that answered nothing (each try
# holds the router's loop as long as the resolver takes).
RETRY_UNADOPTED_S = 5.0
# How often a router that starts before any of its pods answers tries again, at most (an hourly
# interval_s made it wait up to an hour for pods long ready).
WAIT_RETRY_S = 5.0

log = logging.getLogger("gorgo.discovery")
Resolver = Callable[[str, int], Sequence[str]]
OnChange = Callable[[FleetSpec, list[str], list[str]], None]


def system_resolve(name: str, port: int) -> list[str]:
    """Every address ``name`` resolves to (A and AAAA), in the resolver's order, once each."""
    infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def resolve_sources(sources: Sequence[DnsSource], resolve: Resolver) -> dict[str, list[str]]:
    """Each source's addresses of its family, sorted, at most MAX_ADDRESSES (an unresolvable
    name: none)."""
    answers: dict[str, list[str]] = {}
    for s in sources:
        try:
            found = sorted(set(of_family(resolve(s.dns, s.port), s.family)))
        except OSError as exc:
            log_event(log, "dns_resolve_failed", logging.WARNING, name=s.dns, error=str(exc))
            found = []
        if len(found) > MAX_ADDRESSES:
            log_event(log, "dns_answer_capped", logging.WARNING, name=s.dns,
                      addresses=len(found), kept=MAX_ADDRESSES)
        answers[s.dns] = found[:MAX_ADDRESSES]
    return answers


def log_change(spec: FleetSpec, added: list[str], removed: list[str]) -> None:
    log_event(log, "fleet_membership_changed", replicas=len(spec.replicas), added=added,
              removed=removed)


class DnsDiscovery:
    """Re-resolves the running fleet document's ``discover:`` names, each on its own interval."""

    def __init__(self, path: str | Path, on_change: OnChange = log_change,
                 resolve: Resolver = system_resolve, *,
                 wait: Callable[[float], object] | None = None) -> None:
        """Reads the fleet file and resolves its names once: ``spec`` is the fleet to start with.
        With ``wait`` (a sleep), a fleet whose names all answered nothing (and that lists no
        other replica) is read and resolved again every ``WAIT_RETRY_S`` at most (its shortest
        ``interval_s`` if shorter) until one answers: a router started with its pods (a
        Deployment applied with the model servers, not ready while they load) exited 2, and
        Kubernetes restarted it with a growing backoff (up to 5 minutes) after the pods were
        ready. The file is read again on each try, so an edit (a fixed ConfigMap) is taken up.
        Without ``wait``, that is a `NoAddressYet`."""
        self.path = Path(path)
        self.source = self.path.name
        self.on_change = on_change
        self.resolve = resolve
        while True:
            self.stamp = file_stamp(self.path)  # before the read: an edit after it is seen
            self.raw: Any = read_fleet(path)
            self.sources = dns_sources(self.raw, self.source)
            self.answers = resolve_sources(self.sources, resolve)
            try:
                self.spec: FleetSpec = parse_discovered(self.raw, self.answers, self.source)
                break
            except NoAddressYet as exc:
                if wait is None:
                    raise
                every = min(WAIT_RETRY_S, *(s.interval_s for s in self.sources))
                log_event(log, "dns_waiting", logging.WARNING, error=str(exc), retry_s=every)
                wait(every)
        self._tasks: list[asyncio.Task] = []
        self._running = False
        self._tried: dict[str, float] = {}  # a name new to the fleet -> when parse resolved it

    def parse(self, doc: Any, source: str) -> FleetSpec:
        """``doc`` with its ``discover:`` entries resolved, for a fleet reload: a name already
        resolved keeps its last answer (the interval refreshes it), even an empty one; a name
        new to the fleet is resolved now (blocking, as at start: a changed entry is rare). A
        name that does not answer is never resolved again here: each reload, admin change and
        SIGHUP would hold the router's loop for the resolver's whole timeout. Except a new
        name that answered nothing, which no interval re-resolves until a reload adopts it:
        resolved again at most every RETRY_UNADOPTED_S (a Service created after the reload
        that named it was otherwise refused until the router restarted)."""
        sources = dns_sources(doc, source)
        adopted = {s.dns for s in self.sources}
        now = time.monotonic()
        missing = [s for s in sources if s.dns not in self.answers or (
            s.dns not in adopted and not self.answers[s.dns]
            and now - self._tried.get(s.dns, -math.inf) >= RETRY_UNADOPTED_S)]
        if missing:
            self.answers.update(resolve_sources(missing, self.resolve))
            self._tried.update((s.dns, now) for s in missing)
        return parse_discovered(doc, self.answers, source)

    def follow(self, doc: Any, spec: FleetSpec) -> None:
        """The router took on ``doc`` (as ``spec``): re-resolve its names from now on."""
        sources = dns_sources(doc, self.source)
        self.raw, self.spec = doc, spec
        if sources == self.sources:
            return
        self.sources = sources
        self.answers = {s.dns: self.answers.get(s.dns, []) for s in sources}
        if self._running:
            for t in self._tasks:
                t.cancel()
            self._tasks = [asyncio.create_task(self._every(s)) for s in sources]

    def start(self) -> None:
        self._running = True
        self._tasks = [asyncio.create_task(self._every(s)) for s in self.sources]

    async def stop(self) -> None:
        self._running = False
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _every(self, s: DnsSource) -> None:
        while True:
            await asyncio.sleep(s.interval_s)
            try:
                await self.refresh(s)
            except Exception:  # a discovery bug must not stop the re-resolve loop
                log.exception("dns refresh of %s failed", s.dns)

    async def refresh(self, s: DnsSource) -> bool:
        """Resolve ``s`` once; True when the fleet changed and ``on_change`` took it on."""
        found = await asyncio.to_thread(resolve_sources, [s], self.resolve)
        addresses = found[s.dns]
        if s not in self.sources or not addresses or addresses == self.answers[s.dns]:
            return False
        answers: Mapping[str, Sequence[str]] = {**self.answers, s.dns: addresses}
        try:
            spec = parse_discovered(self.raw, answers, self.source)
            before = {r.name for r in self.spec.replicas}
            after = {r.name for r in spec.replicas}
            self.on_change(spec, sorted(after - before), sorted(before - after))
        except FleetError as exc:  # the old fleet routes on; the next interval tries again
            log_event(log, "dns_change_refused", logging.ERROR, name=s.dns, error=str(exc))
            return False
        self.answers, self.spec = dict(answers), spec
        return True
