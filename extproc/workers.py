"""`gorgo extproc --workers N`: N router processes, one per core, under one supervisor.

One Python router process is held to one core by the GIL. N workers, each a complete
`gorgo extproc` with its own gRPC port (PORT, PORT+1, ...), its own state and its own probes,
scrapes and (with skip mode) Envoy-admin reads, serve one Envoy's ext_proc cluster, which lists
every worker's port and round-robins streams over them (`gorgo envoy-config --extproc
H:P1,H:P2`). Separate ports rather than one SO_REUSEPORT port: the kernel spreads *connections*
by hash, and Envoy opens only one HTTP/2 connection per Envoy worker thread to an ext_proc host,
so two connections land on the same process half of the time (docs/benchmarks.md). Workers agree
the way separate routers do: through the engines' signals, which every worker reads itself.

The supervisor owns the HTTP port:

- ``PUT /admin/weights`` goes to every worker (each checks the token and the body itself); the
  answer is theirs when they agree, 502 naming each worker's status when not. The weights the
  workers then run are kept and replayed to a restarted worker before it counts as up, so every
  running worker has the same weights version.
- ``GET /admin/weights`` is the first worker's answer with ``routed`` summed over all workers,
  each worker process counted as it last answered (a hung worker's decisions, and those of a
  worker's run before a restart, still count: the tuner's census waits for them) and listed
  by process under ``routed_by`` (the runs restarts replaced summed under ``retired``, their
  ids listed in ``retired_ids``);
  ``POST /admin/explain`` and any other admin read are answered by the first worker that is up,
  any other admin change goes to every worker like a weights update. A restarted worker, which
  starts from the fleet file, first takes on a peer's running fleet document
  (``/admin/fleet/document``: the admin membership changes its peers took, and the file they last
  read), then the weights.
- ``/metrics`` is every worker's metrics with a ``worker`` label, plus the supervisor's own
  (`gorgo_workers_up`, `gorgo_worker_restarts_total`); ``/readyz`` is ready when every worker is.

A worker that exits is started again on its port (backoff while it keeps failing); SIGTERM stops
every worker by its pid (each drains its open streams, --drain-s; a second stop is forwarded
and cuts the drains), then the supervisor; SIGHUP reloads the fleet of every worker that is up;
worker 0 alone writes --cds-file (started again, once it has its peers' fleet); every
worker refuses what the file cannot follow. Workers run in their own sessions (a signal to the
supervisor's group reaches them once, from it) and die with the supervisor (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections import Counter as Tally
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from extproc.admin import DOCUMENT_MAX_BYTES, WEIGHTS_MAX_BYTES, Invalid, authorize, read_body
from extproc.telemetry import log_event
from gorgo import shutdown
from gorgo.core.contract import WEIGHT_BOUNDS, WORKER_READ_TIMEOUT_S, WORKER_WRITE_TIMEOUT_S
from gorgo.core.discovery import parse_discovered
from gorgo.core.fleet import FleetSpec, Limits, parse_yaml
from gorgo.core.router import ROUTED_VERSIONS
from gorgo.errors import UserError, bind_error, check_port

log = logging.getLogger("gorgo.workers")
READY_TIMEOUT_S = 60.0  # a worker imports, loads the fleet and binds within this
STOP_GRACE_S = 10.0  # beyond the workers' own --drain-s
BODY_READ_S = 10.0  # an admin call's whole body, before the supervisor acts on it (else a 408)
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 10.0
STABLE_S = 10.0  # a worker that ran this long resets the restart backoff
RETIRED = "retired"  # `routed_by`'s entry for the worker processes restarts replaced
RETIRED_IDS_KEPT = 256  # far more restarts than one tuner tick sees
_FORWARDED = ("authorization", "content-type")  # the request headers a worker gets


@dataclass
class Worker:
    index: int
    port: int  # gRPC; 0 until the first start picked one
    metrics_port: int = 0
    proc: asyncio.subprocess.Process | None = None
    up: bool = False  # started, READY, its peers' fleet and weights replayed
    runs: int = 0  # starts so far: a restart takes on the fleet its peers run
    started_at: float = 0.0
    failures: int = 0  # consecutive short-lived runs, for the backoff
    router_id: str | None = None  # its running process's, as it last answered
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"


class _Merged:
    """Every worker's metric families with a ``worker`` label, and the supervisor's own."""

    def __init__(self, texts: dict[int, str], own: CollectorRegistry) -> None:
        self.texts = texts
        self.own = own

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        for k, text in sorted(self.texts.items()):
            for fam in text_string_to_metric_families(text):
                m = families.get(fam.name)
                if m is None:
                    m = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                    fam.unit)
                for s in fam.samples:
                    m.add_sample(s.name, {**s.labels, "worker": str(k)}, s.value, s.timestamp,
                                 s.exemplar)
        return [*families.values(), *self.own.collect()]


def parse_rendered(text: str, source: str) -> FleetSpec:
    """The fleet document the supervisor started with (Envoy was rendered from it), as it and
    every worker reading it from stdin (`--rendered-fleet-stdin`) parse it: validated, its
    `discover:` entries unresolved, as `load_fleet` leaves them."""
    return parse_discovered(parse_yaml(text), None, source)


def worker_ports(base: int, n: int, metrics_port: int) -> list[int]:
    """The workers' gRPC ports: ``base`` and up, past the supervisor's metrics port (the
    defaults, 50051 and 50052, made worker 1 take the metrics port and the start fail); all 0
    (any free port) when ``base`` is 0."""
    if base <= 0:
        return [0] * n
    ports: list[int] = []
    p = base
    while len(ports) < n:
        if p != metrics_port:
            ports.append(p)
        p += 1
    return ports


class Supervisor:
    def __init__(self, args: argparse.Namespace, n: int, token: str | None) -> None:
        self.args = args
        self.token = token  # the operator's: None, and the admin API answers 403
        # The largest explained request a worker takes (twice the body limit, and 64 KiB): the
        # start's fleet sets it, as a reload cannot raise `limits.max_body_bytes`. Its document
        # is what Envoy was rendered from (its fail-open cluster, its static clusters, its
        # ext_proc mode): every worker is told it, a restarted one too, whose file may say
        # otherwise by then (`--rendered-fleet-stdin`).
        try:
            self.rendered: str | None = Path(args.fleet).read_text()
            start = parse_rendered(self.rendered, Path(args.fleet).name)
            body_limit = start.limits.max_body_bytes
        except (OSError, UnicodeDecodeError, ValueError):  # the workers say why, as they start
            self.rendered, body_limit = None, Limits().max_body_bytes
        self.explain_max_bytes = 2 * body_limit + 65536
        self._token = token.encode() if token else None
        # What the supervisor and the workers share: the operator's, else one of their own, so a
        # restarted worker can still take on its peers' fleet (a fleet file they all refused
        # was what it ran).
        self._worker_token = token or secrets.token_urlsafe(32)
        self.workers = [Worker(k, p) for k, p in enumerate(worker_ports(args.port, n,
                                                                         args.metrics_port))]
        self.replay: dict[str, Any] | None = None  # the weights every worker runs, once PUT
        self.stopping = False
        self.metrics_port = 0
        self.registry = CollectorRegistry()
        self.up_gauge = Gauge("gorgo_workers_up", "router worker processes serving",
                              registry=self.registry)
        self.restarts = Counter("gorgo_worker_restarts", "router workers started again after "
                                "they exited", ["worker"], registry=self.registry)
        self._http: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()  # one weights update at a time, replays included
        self._background: set[asyncio.Task] = set()
        # router id -> version -> policy -> decisions: every worker process's counts as it last
        # answered, a process that hangs included, those restarts replaced summed under RETIRED
        # (`get_weights`).
        self.routed_by: dict[str, dict[str, dict[str, int]]] = {}
        # The ids whose counts went into RETIRED, newest last: a reader that kept them (the
        # tuner's census) drops its own copies, or it would count those runs twice.
        self.retired_ids: deque[str] = deque(maxlen=RETIRED_IDS_KEPT)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        a = self.args
        what = f"the metrics endpoint on {a.metrics_host}:{a.metrics_port}"
        hint = "free it or pick another --metrics-port (0 = any free port, -1 = off)"
        if a.metrics_port > 0:
            check_port(a.metrics_host, a.metrics_port, what, hint)
        for w in self.workers:
            if w.port:
                check_port(a.host, w.port, f"worker {w.index}'s gRPC server on {a.host}:{w.port}",
                           "free it or pick another --port (workers use PORT and up, past "
                           "--metrics-port)")
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        for w in self.workers:  # one after another: a bad fleet fails once, not N times
            if self._stopping():  # a stop during the start: the workers left are not started
                break
            await self._spawn(w)
        if a.metrics_port >= 0:
            self._http = web.AppRunner(self._app(), access_log=None)
            await self._http.setup()
            try:
                await web.TCPSite(self._http, a.metrics_host, a.metrics_port).start()
            except OSError as exc:
                raise bind_error(exc, what, hint) from None
            self.metrics_port = self._http.addresses[-1][1]

    def _command(self, w: Worker) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "gorgo.cli", "extproc", "--fleet", a.fleet, "--host", a.host,
               "--port", str(w.port), "--metrics-host", "127.0.0.1", "--metrics-port", "0",
               "--log-level", a.log_level, "--workers", "1", "--drain-s", f"{a.drain_s:g}"]
        if a.cds_file:  # every worker keeps its rules; one writer, as all read one fleet file
            cmd += ["--cds-file", a.cds_file] + (
                ["--cds-read-only"] if w.index else ["--cds-defer"] if self._adopts(w) else [])
        if self.rendered is not None:
            cmd += ["--rendered-fleet-stdin"]
        if a.otlp:
            cmd += ["--otlp", a.otlp]
        if a.envoy_admin:
            cmd += ["--envoy-admin", a.envoy_admin]
        return cmd

    async def _spawn(self, w: Worker) -> None:
        """Start worker ``w`` and wait for its READY line; a failure is a UserError."""
        w.runs += 1
        env = {k: v for k, v in os.environ.items() if k != "GORGO_ADMIN_TOKEN"}
        env["GORGO_ADMIN_TOKEN"] = self._worker_token  # never on a command line
        # Its own session: a stop signal to the supervisor's group (Ctrl-C, killpg, systemd)
        # reaches the workers once, from the supervisor, not twice (a second one cuts a drain).
        w.proc = await asyncio.create_subprocess_exec(
            *self._command(w), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            env=env, preexec_fn=shutdown.die_with_parent(), start_new_session=True)
        assert w.proc.stdin is not None
        with contextlib.suppress(ConnectionError):  # it exited at once: its output says why
            if self.rendered is not None:
                w.proc.stdin.write(self.rendered.encode())
                await w.proc.stdin.drain()
            w.proc.stdin.close()
        w.started_at = time.monotonic()
        lines: list[str] = []
        ready: dict[str, str] | None = None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(READY_TIMEOUT_S):
                while ready is None:
                    raw = await w.proc.stdout.readline()
                    if not raw:
                        break
                    line = raw.decode(errors="replace").strip()
                    lines.append(line)
                    if line.startswith("READY"):
                        ready = dict(kv.split("=", 1) for kv in line.split()[1:])
        if ready is None:
            await self._reap(w)
            if self._stopping():  # a stop signal during the start: no error, the stop goes on
                return
            said = " | ".join(lines[-3:]) or "no output"
            raise UserError(f"worker {w.index} did not start: {said}")
        w.port, w.metrics_port = int(ready["grpc"]), int(ready["metrics"])
        w.tasks = [asyncio.create_task(self._drain(w.proc)), asyncio.create_task(self._watch(w))]
        async with self._lock:  # no admin change reaches the peers between the two
            status, body = await self._adopt(w) if self._adopts(w) else (200, b"")
            if status == 200 and self.replay is not None:  # its rates name the fleet's replicas
                status, body = await self._replay_to(w)
            w.up = status == 200
        self._count_up()
        if not w.up:  # it routes, on other weights than its peers: not ready, and said loudly
            log_event(log, "worker_replay_failed", logging.ERROR, worker=w.index, status=status,
                      error=body.decode(errors="replace")[:300])
        log_event(log, "worker_started", worker=w.index, pid=w.proc.pid, grpc=w.port)

    def _adopts(self, w: Worker) -> bool:
        """A restarted worker starts from the file: it takes on its peers' fleet (the admin
        changes they took since; a file they have not read yet they read again together)."""
        return w.runs > 1

    async def _adopt(self, w: Worker) -> tuple[int, bytes]:
        """``w`` takes on the fleet document of the first peer that answers; with none up, the
        file it started from, read again (worker 0 writes the clusters file then)."""
        for peer in self._live():
            status, raw = await self._send(peer, "GET", "/admin/fleet/document", None,
                                           self._auth())
            if status == 200:
                return await self._send(w, "PUT", "/admin/fleet/document", raw, self._auth())
        return await self._send(w, "POST", "/admin/fleet/reload", b"", self._auth())

    async def _replay_to(self, w: Worker) -> tuple[int, bytes]:
        """PUT the weights every worker runs to ``w``, with the prefill rates of the replicas it
        knows: a reload or a DNS answer since the PUT may have dropped one, and a rate for an
        unknown replica fails the whole PUT."""
        assert self.replay is not None
        body = dict(self.replay)
        status, raw = await self._send(w, "GET", "/admin/weights", None, self._auth())
        if status == 200:
            known = json.loads(raw).get("prefill_rate_hint") or {}
            body["prefill_rate"] = {k: v for k, v in body["prefill_rate"].items() if k in known}
        return await self._send(w, "PUT", "/admin/weights", json.dumps(body).encode(),
                                self._auth())

    async def _drain(self, proc: asyncio.subprocess.Process) -> None:
        while raw := await proc.stdout.readline():
            sys.stdout.write(raw.decode(errors="replace"))

    async def _watch(self, w: Worker) -> None:
        """Start ``w`` again whenever it exits, until the supervisor stops."""
        while True:
            assert w.proc is not None
            code = await w.proc.wait()
            w.up = False
            self._count_up()
            if self._stopping():
                return
            lived = time.monotonic() - w.started_at
            w.failures = 0 if lived >= STABLE_S else w.failures + 1
            delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** max(0, w.failures - 1))
            log_event(log, "worker_exited", logging.WARNING, worker=w.index, pid=w.proc.pid,
                      code=code, restart_in_s=delay)
            self.restarts.labels(str(w.index)).inc()
            await asyncio.sleep(delay)
            if self._stopping():
                return
            try:
                await self._spawn(w)
            except UserError as exc:
                log.error("worker %d failed to start again: %s", w.index, exc)
                continue
            return  # the new run has its own watcher

    def _stopping(self) -> bool:
        """Stopping, or about to: a SIGTERM sent to the whole process group reaches the workers
        too, and one may exit before the supervisor's own handler has run."""
        return self.stopping or shutdown.received is not None

    def reload(self) -> None:
        """SIGHUP: every worker that is up reloads the fleet file itself (one starting reads the
        file as it is, and would die of a SIGHUP before its handler is set); none once
        stopping (a worker past its drain has no reload left to do)."""
        if self._stopping():
            return
        for w in self.workers:
            if w.up and w.proc is not None and w.proc.returncode is None:
                w.proc.send_signal(signal.SIGHUP)

    def cut(self) -> None:
        """A second stop signal: every worker's drain is cut short (its second SIGTERM)."""
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None:
                w.proc.send_signal(signal.SIGTERM)

    async def _reap(self, w: Worker) -> None:
        if w.proc is not None and w.proc.returncode is None:
            w.proc.send_signal(signal.SIGTERM)
            try:  # the worker drains its open streams first (--drain-s)
                await asyncio.wait_for(w.proc.wait(), self.args.drain_s + STOP_GRACE_S)
            except TimeoutError:
                w.proc.kill()
                await w.proc.wait()

    async def stop(self) -> None:
        """SIGTERM every worker by its pid (SIGKILL after the grace), then close the port."""
        self.stopping = True
        await asyncio.gather(*(self._reap(w) for w in self.workers))
        for w in self.workers:
            for t in w.tasks:
                t.cancel()
            await asyncio.gather(*w.tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.cleanup()
        if self._session is not None:
            await self._session.close()

    def _count_up(self) -> None:
        self.up_gauge.set(sum(w.up for w in self.workers))

    # --- fan-out --------------------------------------------------------------------------------

    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self._worker_token}"}

    async def _send(self, w: Worker, method: str, path: str, body: bytes | None = None,
                    headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One worker's answer (status, body); 503 when it cannot be reached, or does not
        answer a read within WORKER_READ_TIMEOUT_S (a hung worker must not hold every scrape) or
        a change within WORKER_WRITE_TIMEOUT_S."""
        assert self._session is not None
        read = method == "GET" or path.startswith("/admin/explain")
        timeout = aiohttp.ClientTimeout(total=WORKER_READ_TIMEOUT_S if read
                                        else WORKER_WRITE_TIMEOUT_S)
        try:
            async with self._session.request(method, w.url + path, data=body,
                                             headers=headers or {}, timeout=timeout) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return 503, json.dumps({"error": {"message": f"worker {w.index}: {exc}"}}).encode()

    def _live(self) -> list[Worker]:
        return [w for w in self.workers if w.up]

    @staticmethod
    def _pass(status: int, body: bytes) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    async def _admitted(self, request: web.Request) -> web.Response | bytes:
        """An admin call's body, once its token is the operator's and the whole body came within
        its size and ``BODY_READ_S``; else the error to answer. Both before any lock: a client
        without a token holding a body open once held every admin change, and a restarted
        worker's start, for as long as it liked."""
        denied = authorize(request, self._token)
        if denied is not None:
            return denied
        limit = (WEIGHTS_MAX_BYTES if request.path == "/admin/weights"
                 else self.explain_max_bytes if request.path == "/admin/explain"
                 else DOCUMENT_MAX_BYTES)
        try:
            async with asyncio.timeout(BODY_READ_S):
                return await read_body(request, limit)
        except Invalid as exc:
            return exc.response()
        except TimeoutError:
            return web.json_response({"error": {"message": f"body not received within "
                                                           f"{BODY_READ_S:g} s", "field": None}},
                                     status=408)

    async def _fan_out(self, request: web.Request,
                       body: bytes) -> tuple[web.Response, list[tuple[int, bytes]]]:
        """``request`` sent to every worker that is up: their answer when they agree, else a 502
        naming each worker's status; and the answers themselves."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        live = self._live()
        if not live:
            return web.json_response({"error": {"message": "no worker is up"}}, status=503), []
        answers = await asyncio.gather(*(self._send(w, request.method, request.path_qs, body,
                                                    headers) for w in live))
        if len({status for status, _ in answers}) == 1:
            return self._pass(*answers[0]), answers
        return web.json_response({"error": {
            "message": "workers answered differently",
            "workers": [{"worker": w.index, "status": s}
                        for w, (s, _) in zip(live, answers, strict=True)]}}, status=502), answers

    async def put_weights(self, request: web.Request) -> web.Response:
        body = await self._admitted(request)
        if isinstance(body, web.Response):
            return body
        async with self._lock:
            response, answers = await self._fan_out(request, body)
            applied = [b for status, b in answers if status == 200]
            if applied:  # what a restarted worker, or one left behind, is brought to
                self.replay = _replay_body(json.loads(applied[0]))
            if response.status == 502:
                self._resync_later()
            return response

    def _resync_later(self) -> None:
        """After a split answer, bring the workers left behind to the replay weights (a worker
        already there refuses the same version: versions only go up)."""
        async def resync() -> None:
            async with self._lock:
                if self.replay is not None:
                    for w in self._live():
                        await self._replay_to(w)
        task = asyncio.get_running_loop().create_task(resync())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def admin_other(self, request: web.Request) -> web.Response:
        """Any other admin call: a read from the first worker that is up, a change to all."""
        body = await self._admitted(request)
        if isinstance(body, web.Response):
            return body
        if request.method == "GET" or request.path == "/admin/explain":
            live = self._live()
            if not live:
                return web.json_response({"error": {"message": "no worker is up"}}, status=503)
            headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
            answer = (503, b"")
            for w in live:  # the first worker that answers: a hung one times out
                answer = await self._send(w, request.method, request.path_qs, body, headers)
                if answer[0] != 503:
                    break
            return self._pass(*answer)
        async with self._lock:  # a restarting worker adopts its peers' fleet before or after it
            response, _ = await self._fan_out(request, body)
        return response

    async def get_weights(self, request: web.Request) -> web.Response:
        if (denied := authorize(request, self._token)) is not None:
            return denied
        live = self._live()
        if not live:
            return web.json_response({"error": {"message": "no worker is up"}}, status=503)
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        answers = await asyncio.gather(*(self._send(w, "GET", "/admin/weights", None, headers)
                                         for w in live))
        # the first worker that answered (a hung or restarting one is left out)
        status, raw = next((a for a in answers if a[0] == 200), answers[0])
        if status != 200:
            return self._pass(status, raw)
        merged = json.loads(raw)
        versions = []
        for w, (s, b) in zip(live, answers, strict=True):
            if s != 200:
                continue
            doc = json.loads(b)
            versions.append({"worker": w.index, "version": doc["version"]})
            self.heard_routed(w, doc)
        self._forget_old_versions()
        routed: dict[str, Tally] = {}
        for by_version in self.routed_by.values():
            for version, counts in by_version.items():
                routed.setdefault(version, Tally()).update(counts)
        merged.pop("router", None)  # one worker's: the supervisor answers for all of them
        merged["routed"] = {v: dict(c) for v, c in routed.items()}
        merged["routed_by"] = self.routed_by
        merged["retired_ids"] = list(self.retired_ids)
        merged["workers"] = versions
        return web.json_response(merged)

    def heard_routed(self, w: Worker, doc: dict[str, Any]) -> None:
        """Worker ``w``'s GET /admin/weights: its process's decision counts."""
        rid = doc.get("router")
        rid = rid if isinstance(rid, str) and rid != RETIRED else f"worker-{w.index}"
        if w.router_id not in (None, rid):
            self._retire(w.router_id)
        w.router_id = rid
        self.routed_by[rid] = doc.get("routed", {})

    def _retire(self, rid: str) -> None:
        """A worker process replaced by a restart: its final counts join the retired ones (one
        entry however often workers restart; only growing, as the tuner's census needs)."""
        retired = self.routed_by.setdefault(RETIRED, {})
        self.retired_ids.append(rid)
        for version, counts in self.routed_by.pop(rid, {}).items():
            merged = Tally(retired.get(version, {}))
            merged.update(counts)
            retired[version] = dict(merged)

    def _forget_old_versions(self) -> None:
        """Keep the newest ``ROUTED_VERSIONS`` versions, as a router does, and the processes
        that counted any of them."""
        keep = set(sorted({int(v) for by in self.routed_by.values() for v in by},
                          reverse=True)[:ROUTED_VERSIONS])
        for rid, by_version in list(self.routed_by.items()):
            kept = {v: c for v, c in by_version.items() if int(v) in keep}
            if kept:
                self.routed_by[rid] = kept
            else:
                del self.routed_by[rid]

    async def metrics(self, _: web.Request) -> web.Response:
        live = self._live()
        answers = await asyncio.gather(*(self._send(w, "GET", "/metrics") for w in live))
        texts = {w.index: b.decode() for w, (s, b) in zip(live, answers, strict=True) if s == 200}
        return web.Response(body=generate_latest(_Merged(texts, self.registry)),
                            headers={"content-type": CONTENT_TYPE_LATEST})

    async def readyz(self, _: web.Request) -> web.Response:
        answers = await asyncio.gather(*(self._send(w, "GET", "/readyz") if w.up
                                         else _down() for w in self.workers))
        checks = {f"worker{w.index}": s == 200 for w, (s, _) in zip(self.workers, answers,
                                                                      strict=True)}
        ok = all(checks.values())
        return web.json_response({"ready": ok, "checks": checks}, status=200 if ok else 503)

    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=max(self.explain_max_bytes, DOCUMENT_MAX_BYTES))
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/admin/weights", self.get_weights)
        app.router.add_put("/admin/weights", self.put_weights)
        app.router.add_route("*", "/admin/{tail:.*}", self.admin_other)
        return app


async def _down() -> tuple[int, bytes]:
    return 503, b""


def _replay_body(current: dict[str, Any]) -> dict[str, Any]:
    """A PUT body that sets a fresh worker to exactly what ``current`` (a GET answer) holds."""
    return {**{k: current[k] for k in WEIGHT_BOUNDS if k in current},
            "version": current["version"], "prefill_rate": current.get("prefill_rate") or {}}


async def supervise(args: argparse.Namespace, n: int, token: str | None) -> int:
    """Run ``n`` workers until SIGTERM/SIGINT; prints ``READY grpc=P1,P2,... metrics=M``."""
    stop = asyncio.Event()
    sup = Supervisor(args, n, token)

    def on_stop() -> None:  # the first signal stops (the workers drain), a second cuts it short
        if stop.is_set():
            sup.cut()
        stop.set()

    shutdown.on_stop(on_stop)
    # The fleet reload signal, for every worker (its default action would end the supervisor,
    # and with it every worker).
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, sup.reload)
    try:
        await sup.start()
    except BaseException:
        await sup.stop()
        raise
    ports = ",".join(str(w.port) for w in sup.workers)
    log_event(log, "supervisor_started", workers=n, grpc=ports,
              metrics=f"{args.metrics_host}:{sup.metrics_port}")
    print(f"READY grpc={ports} metrics={sup.metrics_port}", flush=True)
    await stop.wait()
    await sup.stop()
    return 0
