"""`gorgo tuner --config FILE`: OTLP spans in, (1+1)-ES over the cost weights, weights out.

One asyncio loop runs the OTLP receiver (which feeds samples to the optimizer as they arrive), a
tick that asks the optimizer for new weights and reconciles every router with them, and an
optional status endpoint. State is saved atomically *before* a new version is published, so a
restarted tuner never reissues a version a router has seen. Nothing in a router depends on this
process: if it dies, the routers keep the last weights they accepted.

Config (YAML; relative paths are relative to the config file)::

    listen: 127.0.0.1:4317            # OTLP/gRPC TraceService and LogsService (the TTFT log)
    token_file: otlp-token            # required: spans count only with `authorization: Bearer ...`
    fleet: fleet.yaml                 # optional: its objective, slo.ttft_ms and timeouts.request_s
    request_timeout_s: 600            # the fleet's timeouts.request_s: no longer TTFT/E2E is real
    max_export_spans: 5000            # spans parsed per export; the rest are rejected
    max_spans_per_s: 2000             # spans parsed per second, over all exports
    tls_cert_file: cert.pem           # optional, with tls_key_file
    tls_key_file: key.pem
    status_listen: 127.0.0.1:9102     # optional: GET /status (JSON) and /metrics
    state_file: tuner-state.json
    routers:
      - {url: "http://127.0.0.1:50052", token_file: admin-token}
    publish_timeout_s: 12             # per router request: PUBLISH_TIMEOUT_S
    initial_weights: {rtt: 1.0, queue: 1.0}   # optional, every weight key; default: the
                                              # first router's live weights
    seed: 0
    tick_s: 0.5
    log_every_s: 30
    optimizer: {window_samples: 40, fpr: 0.05, ...}      # tuner/optimizer.py OptimizerConfig
                                                         # (objective: ttft | e2e | slo)
    calibration: {min_samples: 50, ...}                  # tuner/calibration.py CalibrationConfig
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import ssl
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gorgo import shutdown
from gorgo.core.contract import WEIGHT_BOUNDS, WORKER_WRITE_TIMEOUT_S
from gorgo.core.decimals import whole_number
from gorgo.core.fleet import Timeouts, finite_number, http_url, load_fleet, split_address
from gorgo.errors import LOG_LEVELS, UserError, check_port, header_token
from tuner.calibration import CalibrationConfig
from tuner.join import DUPLICATE, END, FIRST, Join
from tuner.optimizer import (
    OptimizerConfig,
    Tuner,
    VersionsExhausted,
    config_from_mapping,
    hints_moved,
)
from tuner.publisher import Publisher, RouterTarget
from tuner.receiver import LOG_PREFIX, REFUSED_REASONS, REJECTED, ExportLimits, TraceReceiver
from tuner.samples import DROP_REASONS, Sample
from tuner.state_store import StateError, load_state, lock_state, save_state

log = logging.getLogger("gorgo.tuner")
MAX_RENUMBERS_PER_TICK = 3
UNKNOWN_REPLICA = "unknown_replica"  # samples naming a replica no router reported
# How the join counted each known decision's samples: its TTFT first from the TTFT log (early)
# or from its span (late), a span ending an early one, or a repeat that counted for nothing.
EARLY_TTFT, LATE_TTFT, ENDS_JOINED, DUPLICATES = ("early_ttft", "late_ttft", "ends_joined",
                                                  "duplicates")
# A fresh start waits for a router's weights: asks every second, says so every 30 s.
ROUTER_RETRY_S = 1.0
ROUTER_WAIT_LOG_S = 30.0
JOIN_SLACK_S = 30.0  # beyond the request timeout: Envoy's export buffering and retries
# Above `gorgo extproc --workers`' wait for a hung worker (3 s for a read, 10 s for a change):
# the supervisor answers once it gives up on the worker, and a tuner that gave up first (at the
# former 2 s) lost that router's census.
PUBLISH_TIMEOUT_S = WORKER_WRITE_TIMEOUT_S + 2.0


class ConfigError(UserError, ValueError):
    """A tuner config problem; the message starts with the offending field."""


@dataclass(frozen=True, slots=True)
class TunerConfig:
    routers: tuple[RouterTarget, ...]
    state_file: Path
    otlp_token: str  # what every export must carry: spans are evidence only from Envoy
    limits: ExportLimits
    listen: str = "127.0.0.1:4317"
    tls: tuple[bytes, bytes] | None = None  # (certificate chain, private key) PEM
    status_listen: str | None = None
    initial_weights: dict[str, float] | None = None  # weight key -> factor, every key
    seed: int = 0
    tick_s: float = 0.5
    log_every_s: float = 30.0
    publish_timeout_s: float = PUBLISH_TIMEOUT_S
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)


def _same_url(a: str, b: str) -> bool:
    """One router, however written: the host's case, its default port, a trailing slash."""
    def key(url: str) -> tuple[str, str, int | None, str]:
        u = urlsplit(url)
        scheme = u.scheme.lower()
        return scheme, (u.hostname or ""), u.port or {"http": 80, "https": 443}.get(scheme), \
            u.path.rstrip("/")
    return key(a) == key(b)


def _hostport(value: Any, key: str) -> tuple[str, int]:
    """A listen address: the one HOST:PORT check (`gorgo.core.fleet.split_address`), port 0 for
    any free one."""
    if not isinstance(value, str):
        raise ConfigError(f"{key}: expected HOST:PORT, got {value!r}")
    try:
        return split_address(value, lowest_port=0)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


def _read_secret(base: Path, value: Any, key: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a file path")
    path = base / value
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"{key}: {path} is empty")
    if not header_token(token):  # else the first publish, after READY, failed with a traceback
        raise ConfigError(f"{key}: {path} must hold one token of printable ASCII without spaces")
    return token


def _positive(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    x = finite_number(value)
    if x is None or not x > 0:
        raise ConfigError(f"{key}: expected a positive number, got {value!r}")
    return x


def parse_config(raw: Any, base: Path) -> TunerConfig:
    """Validate a decoded config document; every error names its field."""
    if not isinstance(raw, Mapping):
        raise ConfigError("config: expected a mapping")
    allowed = {"listen", "token_file", "tls_cert_file", "tls_key_file", "status_listen",
               "state_file", "routers", "initial_weights", "seed", "tick_s", "log_every_s",
               "publish_timeout_s", "optimizer", "calibration", "request_timeout_s",
               "max_export_spans", "max_spans_per_s", "fleet"}
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"{key}: unknown field (allowed: {', '.join(sorted(allowed))})")
    routers_raw = raw.get("routers")
    if not isinstance(routers_raw, list) or not routers_raw:
        raise ConfigError("routers: expected a non-empty list of {url, token_file}")
    routers = []
    for i, r in enumerate(routers_raw):
        key = f"routers[{i}]"
        if not isinstance(r, Mapping) or set(r) - {"url", "token_file"}:
            raise ConfigError(f"{key}: expected {{url, token_file}}")
        url = r.get("url")
        if not isinstance(url, str) or not http_url(url):
            raise ConfigError(f"{key}.url: expected an http(s) URL like http://host:port, "
                              f"got {url!r}")
        if any(_same_url(t.url, url) for t in routers):
            # two publishers to one router renumber each other's versions without end
            raise ConfigError(f"{key}.url: {url} is listed twice")
        routers.append(RouterTarget(url.rstrip("/"), _read_secret(base, r.get("token_file"),
                                                                  f"{key}.token_file")))
    listen = raw.get("listen", "127.0.0.1:4317")
    _hostport(listen, "listen")
    status_listen = raw.get("status_listen")
    if status_listen is not None:
        _hostport(status_listen, "status_listen")
    if raw.get("token_file") is None:
        raise ConfigError("token_file: required: the bearer token Envoy (or the collector) sends "
                          "with its spans; without it anyone who can reach the port steers the "
                          "weights")
    otlp_token = _read_secret(base, raw["token_file"], "token_file")
    fleet = _fleet_settings(base, raw.get("fleet"))
    max_spans = raw.get("max_export_spans", 5000)
    if isinstance(max_spans, bool) or not isinstance(max_spans, int) or max_spans < 1:
        raise ConfigError(f"max_export_spans: expected a positive integer, got {max_spans!r}")
    timeout_s = fleet.pop("request_timeout_s", Timeouts().request_s)
    if (raw.get("fleet") is not None and "request_timeout_s" in raw
            and raw["request_timeout_s"] != timeout_s):
        raise ConfigError(f"request_timeout_s: {raw['request_timeout_s']!r} contradicts the "
                          f"fleet file's timeouts.request_s {timeout_s!r}")
    limits = ExportLimits(max_ms=1000.0 * _positive(raw, "request_timeout_s", timeout_s),
                          max_spans=max_spans,
                          spans_per_s=_positive(raw, "max_spans_per_s", 2000.0))
    cert, key = raw.get("tls_cert_file"), raw.get("tls_key_file")
    tls = None
    if (cert is None) != (key is None):
        raise ConfigError("tls_cert_file: tls_cert_file and tls_key_file go together")
    if cert is not None:
        try:
            tls = ((base / cert).read_bytes(), (base / key).read_bytes())
        except (OSError, TypeError) as exc:
            raise ConfigError(f"tls_cert_file: cannot read the certificate or key: {exc}") from None
        # gRPC reports a bad PEM only as "Failed to bind", naming the port instead. Checked at
        # OpenSSL's lowest security level, as gRPC loads it (the default refused an RSA-1024
        # pair gRPC serves), with no passphrase (gRPC takes none; a prompt would hang a start).
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.set_ciphers("DEFAULT:@SECLEVEL=0")
        try:
            context.load_cert_chain(base / cert, base / key, password=b"")
        except ssl.SSLError as exc:
            raise ConfigError(f"tls_cert_file: the certificate and key do not load as a PEM "
                              f"pair: {exc}") from None
    state_file = raw.get("state_file", "gorgo-tuner-state.json")
    if not isinstance(state_file, str) or not state_file:
        raise ConfigError("state_file: expected a file path")
    seed = raw.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed: expected an integer >= 0, got {seed!r}")
    opt_raw = raw.get("optimizer") or {}
    if not isinstance(opt_raw, Mapping):
        raise ConfigError("optimizer: expected a mapping")
    for key, value in fleet.items():  # what the fleet file says, unless the config says it too
        if key in opt_raw and opt_raw[key] != value:
            raise ConfigError(f"optimizer.{key}: {opt_raw[key]!r} contradicts the fleet file's "
                              f"{value!r}")
    try:
        optimizer = config_from_mapping({**fleet, **opt_raw})
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None
    keys = optimizer.keys
    initial = raw.get("initial_weights")
    if initial is not None:
        if not isinstance(initial, Mapping) or set(initial) != set(keys):
            raise ConfigError(f"initial_weights: expected {{{', '.join(keys)}}}")
        # clipped to the optimiser's bounds, as any start is
        initial = {k: _positive(initial, k, 1.0) for k in keys}
    for k, (lo, hi) in optimizer.bounds.items():
        rlo, rhi = WEIGHT_BOUNDS[k]
        if lo < rlo or hi > rhi:
            raise ConfigError(f"optimizer.bounds.{k}: [{lo:g}, {hi:g}] must lie within the "
                              f"routers' [{rlo:g}, {rhi:g}]")
    calibration = _calibration(raw.get("calibration") or {})
    return TunerConfig(
        routers=tuple(routers), state_file=base / state_file, listen=listen,
        otlp_token=otlp_token, limits=limits, tls=tls, status_listen=status_listen,
        initial_weights=initial,
        seed=seed, tick_s=_positive(raw, "tick_s", 0.5),
        log_every_s=_positive(raw, "log_every_s", 30.0),
        publish_timeout_s=_positive(raw, "publish_timeout_s", PUBLISH_TIMEOUT_S),
        optimizer=optimizer, calibration=calibration,
    )


def _fleet_settings(base: Path, value: Any) -> dict[str, Any]:
    """What the tuner takes from the fleet file (``fleet:``): the objective it optimises, the
    SLO's TTFT target and the request timeout; nothing without one."""
    if value is None:
        return {}
    if not isinstance(value, str) or not value:
        raise ConfigError(f"fleet: expected a file path, got {value!r}")
    spec = load_fleet(base / value)  # a FleetError names the file and the field
    return {"objective": spec.objective, "slo_ttft_ms": spec.slo.ttft_ms,
            "request_timeout_s": spec.timeouts.request_s}


def _calibration(raw: Any) -> CalibrationConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError("calibration: expected a mapping")
    names = {f.name for f in fields(CalibrationConfig)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            raise ConfigError(f"calibration.{key}: unknown field (allowed: {sorted(names)})")
        # .inf and .nan reached int() (a traceback) or passed every check
        if key in ("window", "min_samples"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"calibration.{key}: expected an integer, got {value!r}")
            values[key] = value
        elif (x := finite_number(value)) is None:
            raise ConfigError(f"calibration.{key}: expected a finite number, got {value!r}")
        else:
            values[key] = x
    cfg = CalibrationConfig(**values)
    try:
        cfg.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return cfg


def load_config(path: str | Path) -> TunerConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    return parse_config(raw, path.parent)


# --- status endpoint ----------------------------------------------------------------------------


class _StatusCollector(Collector):
    def __init__(self, service: TunerService) -> None:
        self.service = service

    def collect(self) -> Iterator[Any]:
        counts = self.service.receiver.counts
        spans = CounterMetricFamily("gorgo_tuner_spans", "OTLP spans by outcome",
                                    labels=["result"])
        for result in ("samples", *DROP_REASONS, REJECTED, UNKNOWN_REPLICA):
            spans.add_metric([result], counts.get(result, 0))
        yield spans
        records = CounterMetricFamily("gorgo_tuner_log_records", "TTFT log records by outcome",
                                      labels=["result"])
        for result in ("samples", *DROP_REASONS, REJECTED, UNKNOWN_REPLICA):
            records.add_metric([result], counts.get(LOG_PREFIX + result, 0))
        yield records
        joined = CounterMetricFamily("gorgo_tuner_decisions", "Known decisions' samples by how "
                                     "the join counted them", labels=["result"])
        for result in (EARLY_TTFT, LATE_TTFT, ENDS_JOINED, DUPLICATES):
            joined.add_metric([result], counts.get(result, 0))
        yield joined
        unauth = CounterMetricFamily("gorgo_tuner_unauthenticated_exports",
                                     "Exports refused for a missing or wrong token")
        unauth.add_metric([], counts.get("unauthenticated", 0))
        yield unauth
        refused = CounterMetricFamily("gorgo_tuner_refused_exports", "Authenticated exports "
                                      "refused unread, by reason", labels=["reason"])
        for reason in REFUSED_REASONS:
            refused.add_metric([reason], counts.get(reason, 0))
        yield refused
        yield from self._routers()
        t = self.service.tuner
        w = GaugeMetricFamily("gorgo_tuner_incumbent_weight", "Incumbent weights", labels=["term"])
        for key, value in t.incumbent.items():
            w.add_metric([key], value)
        yield w
        for name, doc, value in (
            ("gorgo_tuner_sigma", "ES step size (log space)", t.sigma),
            ("gorgo_tuner_active_version", "Version of the weights being published",
             t.active.weights.version if t.active else 0),
            ("gorgo_tuner_converged", "1 once the search has converged",
             float(t.phase == "converged")),
        ):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        ev = CounterMetricFamily("gorgo_tuner_evaluations", "Finished evaluations",
                                 labels=["accepted"])
        ev.add_metric(["true"], t.accepted)
        ev.add_metric(["false"], t.evaluations - t.accepted)
        yield ev

    def _routers(self) -> Iterator[Any]:
        """Each router's publishing state, labelled by its URL (the config's routers: a bounded
        set). A router refusing every publish was logged once and then showed nowhere."""
        behind = {r["url"] for r in self.service.behind()}
        acked = GaugeMetricFamily("gorgo_tuner_router_acked_version", "Version each router "
                                  "last acknowledged (-1: none yet)", labels=["router"])
        late = GaugeMetricFamily("gorgo_tuner_router_behind", "1 while a router has not "
                                 "acknowledged the active version", labels=["router"])
        done = CounterMetricFamily("gorgo_tuner_publishes", "Publishes each router accepted",
                                   labels=["router"])
        failed = CounterMetricFamily("gorgo_tuner_publish_failures", "Publishes each router "
                                     "refused or did not answer", labels=["router"])
        for r in self.service.publisher.status():
            acked.add_metric([r["url"]], r["acked_version"])
            late.add_metric([r["url"]], float(r["url"] in behind))
            done.add_metric([r["url"]], r["published"])
            failed.add_metric([r["url"]], r["failed"])
        yield from (acked, late, done, failed)


def _fmt(weights: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in weights.items())


def _live_weights(doc: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, float]:
    """A router's weights (of ``keys``) from its GET /admin/weights; a key it lacks (a router
    older than the term) is left to the term's default."""
    out = {}
    for k in keys:
        v = doc.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
            out[k] = float(v)
    return out


def _hints(docs: list[Any]) -> dict[str, float]:
    """The fleet file's prefill rates, from the routers' GET /admin/weights (routers that did not
    answer, or that predate the field, contribute nothing)."""
    out: dict[str, float] = {}
    for doc in docs:
        hint = doc.get("prefill_rate_hint") if isinstance(doc, dict) else None
        if isinstance(hint, dict):
            for name, rate in hint.items():
                if isinstance(rate, int | float) and not isinstance(rate, bool) and rate > 0:
                    out.setdefault(str(name), float(rate))
    return out


class TunerService:
    """The running tuner: receiver, optimizer, publisher and state file, on one event loop.

    The optimiser's verdicts and the calibration fits take up to hundreds of milliseconds (a
    verdict 460 ms at worst in an offline run): they run in a worker thread, so that the loop
    keeps taking spans meanwhile. One party at a time touches the tuner (`_exclusive`): samples
    that arrive while it is busy are held and handed to it in their order once it is free. No
    one holds it across a router's answer, so a router that hangs until the publish timeout
    delays neither the samples nor /status and /metrics.
    """

    def __init__(self, cfg: TunerConfig) -> None:
        self.cfg = cfg
        self.publisher = Publisher(list(cfg.routers), cfg.publish_timeout_s)
        self.tuner: Tuner = Tuner(cfg.optimizer, calibration=cfg.calibration, seed=cfg.seed)
        self.receiver = TraceReceiver(self._on_samples, cfg.otlp_token, cfg.limits)
        self.join = Join(cfg.limits.max_ms / 1000.0 + JOIN_SLACK_S)
        self.otlp_port = 0
        self.status_port = 0
        self.max_version_seen = -1
        # router URL -> router process id -> version -> decisions (`_count_routed`)
        self._routed: dict[str, dict[str, dict[int, int]]] = {t.url: {} for t in cfg.routers}
        self._docs: dict[str, dict[str, Any]] = {}  # each router's last GET /admin/weights
        self._hinted: dict[str, dict[str, float]] = {}  # each router's hints at the last follow
        self.ticks = 0
        self._saved = -1
        self._loaded = False  # never overwrite a state file this process could not read
        self._lock: int | None = None  # lock_state's descriptor while this service runs
        self._http: web.AppRunner | None = None
        self._busy = asyncio.Lock()
        self._held: list[tuple[str, Sample]] = []  # (join kind, sample) while the tuner is busy

    def _on_samples(self, samples: list[Sample]) -> None:
        """Samples of the replicas the routers reported (none until one has): a name a span
        makes up gets no buffer and no rate."""
        known = self.publisher.replicas()
        counts = self.receiver.counts
        for s in samples:
            if known is None or s.replica not in known:  # each input's own counter
                counts[(LOG_PREFIX if s.early else "") + UNKNOWN_REPLICA] += 1
                continue
            kind = self.join.admit(s)
            self.max_version_seen = max(self.max_version_seen, s.weights_version)
            if kind == DUPLICATE:
                counts[DUPLICATES] += 1
                continue
            counts[ENDS_JOINED if kind == END else EARLY_TTFT if s.early else LATE_TTFT] += 1
            if self._busy.locked():
                self._held.append((kind, s))
            else:
                self._give(kind, s)

    def _give(self, kind: str, s: Sample) -> None:
        if kind == FIRST:  # else END: the join's one end of a decision already counted
            self.tuner.observe(s)
        else:
            self.tuner.observe_end(s)

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """The tuner to this caller alone (its thread included); then the held samples."""
        async with self._busy:
            try:
                yield
            finally:
                held, self._held = self._held, []
                for kind, s in held:
                    self._give(kind, s)

    async def _initial_tuner(self, stop: asyncio.Event | None) -> Tuner:
        cfg = self.cfg
        state = load_state(cfg.state_file, cfg.limits.max_ms)
        current = await self._routers_now(wait=state is None and cfg.initial_weights is None,
                                          stop=stop)
        self._heard(current)
        versions = [c["version"] for c in current
                    if isinstance(c, dict) and isinstance(c.get("version"), int)]
        hints = _hints(current)
        if state is not None:
            try:
                tuner = Tuner.restore(cfg.optimizer, state, calibration=cfg.calibration,
                                      hints=hints)
            except ValueError as exc:
                raise StateError(f"{cfg.state_file}: {exc}") from None
            log.info("resumed from %s: incumbent %s, %d evaluations, next version %d",
                     cfg.state_file, _fmt(tuner.incumbent), tuner.evaluations, tuner.next_version)
        else:
            initial = cfg.initial_weights
            if initial is None:
                live = next((c for c in current if isinstance(c, dict)), None)
                initial = _live_weights(live, cfg.optimizer.keys) if live else {}
            tuner = Tuner(cfg.optimizer, initial, seed=cfg.seed, calibration=cfg.calibration,
                          hints=hints)
            log.info("starting fresh from %s", _fmt(tuner.incumbent))
        if versions:
            tuner.ensure_version_above(max(versions))
        return tuner

    async def _routers_now(self, *, wait: bool,
                           stop: asyncio.Event | None) -> list[dict[str, Any] | None]:
        """Each router's GET /admin/weights (None where it did not answer). With ``wait`` (a
        fresh start that takes the routers' live weights: no state, no `initial_weights`), until
        one answers: starting from the defaults instead, and saving them, replaced the weights
        the operator runs with the defaults on every router."""
        waited = 0.0
        while True:
            current = await asyncio.gather(*(self.publisher.fetch(t, quiet=waited > 0)
                                             for t in self.cfg.routers))
            if not wait or any(isinstance(c, dict) for c in current):
                return current
            if waited % ROUTER_WAIT_LOG_S == 0:
                log.warning("no router answered GET /admin/weights: waiting for one, to start "
                            "from the weights it runs (or set initial_weights)")
            if stop is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), ROUTER_RETRY_S)
                if stop.is_set():
                    raise UserError("stopped before any router answered")
            else:
                await asyncio.sleep(ROUTER_RETRY_S)
            waited += ROUTER_RETRY_S

    def save(self) -> None:
        """The state, if it changed; a StateError naming the file if it cannot be written."""
        if self._loaded and self.tuner.revision != self._saved:
            save_state(self.cfg.state_file, self.tuner.snapshot())
            self._saved = self.tuner.revision

    async def start(self, stop: asyncio.Event | None = None) -> None:
        """Lock the state file, take the tuner's start (its state, or the routers' weights: a
        fresh start without `initial_weights` waits for a router; ``stop`` ends that wait) and
        open the ports."""
        self._lock = lock_state(self.cfg.state_file)
        for key in ("listen", "status_listen"):
            value = getattr(self.cfg, key)
            if value is not None:
                host, port = _hostport(value, key)
                check_port(host, port, f"{key} {value}", f"free it or change {key} in the config")
        await self.publisher.__aenter__()
        self.tuner = await self._initial_tuner(stop)
        self._follow()  # a replica removed from the fleet file since the state was saved
        self._loaded = True
        try:
            self.save()
        except StateError:
            self._loaded = False  # the stop would only fail (and say so) once more
            raise
        host, port = _hostport(self.cfg.listen, "listen")
        self.otlp_port = await self.receiver.start(host, port, self.cfg.tls)
        if self.cfg.status_listen is not None:
            shost, sport = _hostport(self.cfg.status_listen, "status_listen")
            self._http = web.AppRunner(self._status_app(), access_log=None)
            await self._http.setup()
            await web.TCPSite(self._http, shost, sport).start()
            self.status_port = self._http.addresses[-1][1]

    async def stop(self) -> None:
        """Close the ports, save the state and release its lock. A failing save is logged:
        raised here, it came with a second traceback (stop runs in the start's error path)."""
        await self.receiver.stop()
        if self._http is not None:
            await self._http.cleanup()
        await self.publisher.__aexit__()
        try:
            self.save()
        except StateError as exc:
            log.error("final save failed: %s", exc)
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _status_app(self) -> web.Application:
        registry = CollectorRegistry(auto_describe=True)
        registry.register(_StatusCollector(self))

        async def status(_: web.Request) -> web.Response:
            async with self._exclusive():
                tuner = await asyncio.to_thread(self.tuner.status)  # fits every replica's rate
            return web.json_response(self._status(tuner),
                                     dumps=lambda o: json.dumps(o, default=str))

        async def metrics(_: web.Request) -> web.Response:
            async with self._exclusive():
                body = generate_latest(registry)
            return web.Response(body=body, headers={"content-type": CONTENT_TYPE_LATEST})

        app = web.Application()
        app.router.add_get("/status", status)
        app.router.add_get("/metrics", metrics)
        return app

    def status(self) -> dict[str, Any]:
        return self._status(self.tuner.status())

    def _status(self, tuner: dict[str, Any]) -> dict[str, Any]:
        return {"tuner": tuner, "ticks": self.ticks,
                "receiver": {**self.receiver.counts, "max_version_seen": self.max_version_seen,
                             "join_ids": len(self.join),
                             "join_evicted_open": self.join.evicted_open},
                "routers": self.publisher.status()}

    async def follow_routers(self) -> None:
        """Every router's GET /admin/weights, every tick: the routers, not the spans, say which
        replicas exist (`_on_samples`, `Tuner.follow`) and which version is live (a restarted
        router is republished to, `Publisher.observe`), and count the decisions made under the
        versions the optimiser scores (a window is complete once all of them reported back). A
        router that does not answer keeps what it said last; one slow to answer is heard at a
        later tick (`Publisher.poll`)."""
        docs = await self.publisher.poll()
        async with self._exclusive():
            self._heard(docs)
            self._count_routed()

    def _count_routed(self) -> None:
        """The tuner's decision counts per scored version, from the routers' last answers."""
        self._follow()
        versions = self.tuner.counting()
        policy = self.cfg.optimizer.policy
        wanted = set(versions)
        for t in self.cfg.routers:
            by_router = self._routed[t.url]
            doc = self._docs.get(t.url)
            retired = doc.get("retired_ids") if isinstance(doc, dict) else None
            for rid in retired if isinstance(retired, list) else ():
                by_router.pop(str(rid), None)  # its counts are in the supervisor's `retired`
            for rid, routed in (_routed_by(doc) if isinstance(doc, dict) else {}).items():
                if not isinstance(routed, dict):
                    continue
                counts = by_router.setdefault(str(rid), {})
                for key, by_policy in routed.items():
                    n = by_policy.get(policy) if isinstance(by_policy, dict) else None
                    version = whole_number(key)
                    if isinstance(n, int) and version in wanted:
                        counts[version] = max(counts.get(version, 0), n)
            for rid, counts in list(by_router.items()):
                for v in [v for v in counts if v not in wanted]:
                    del counts[v]
                if not counts:
                    del by_router[rid]
        for v in versions:
            self.tuner.routed(v, sum(c.get(v, 0) for by_router in self._routed.values()
                                     for c in by_router.values()))

    def _heard(self, docs: list[dict[str, Any] | None]) -> None:
        """Each router's GET /admin/weights (None: it did not answer), in config order."""
        for t, doc in zip(self.cfg.routers, docs, strict=True):
            if isinstance(doc, dict):
                self.publisher.observe(t, doc)
                self._docs[t.url] = doc

    def _follow(self) -> None:
        """`Tuner.follow` with what the routers said; a hint that moved on any router counts
        (the merged hints are the first router's: a reload that reached another router first
        went unseen, and its windows routed under two rates)."""
        known = self.publisher.replicas()
        if known is None:
            return
        gone = sorted(set(self.tuner.rates) - known)
        if gone:
            log.warning("forgetting the calibrated rates of %s: no router knows them",
                        ", ".join(gone))
        hinted = {url: _hints([doc]) for url, doc in self._docs.items()}
        moved = any(hints_moved(self._hinted.get(url, {}), h) for url, h in hinted.items())
        self._hinted = hinted
        self.tuner.follow(known, _hints(list(self._docs.values())), moved=moved)

    async def tick(self, now: float) -> None:
        self.ticks += 1
        await self.follow_routers()
        async with self._exclusive():
            proposal = await asyncio.to_thread(self.tuner.next_weights, now)
            if proposal is not None:
                w = proposal.weights
                log.info("publishing v%d (%s): %s", w.version, proposal.arm, _fmt(w))
            self.save()  # before publishing: a version is never issued twice
            active = self.tuner.active
        for _ in range(MAX_RENUMBERS_PER_TICK):
            if active is None:
                return
            floor = await self.publisher.sync(active)
            if floor is None:
                return
            async with self._exclusive():
                renumbered = self.tuner.renumber(floor)
                self.save()
                active = self.tuner.active
            log.info("a router holds version %d: republishing as v%d", floor,
                     renumbered.weights.version if renumbered else -1)

    def behind(self) -> list[dict[str, Any]]:
        """`Publisher.status` of each router that has not acknowledged the active version."""
        active = self.tuner.active
        if active is None:
            return []
        return [r for r in self.publisher.status()
                if r["acked_version"] < active.weights.version]

    def log_status(self) -> None:
        """A line every ``log_every_s``, from the tuner's fields: not `Tuner.status()`, which
        also fits every replica's calibration window (`PrefillCalibrator.report`); and one
        for each router behind, for as long as it is (the publisher says a failure once)."""
        t = self.tuner
        c = self.receiver.counts
        version = None if t.active is None else t.active.weights.version
        log.info("status: %s v%s, incumbent %s, sigma=%.3g, %d/%d accepted; "
                 "spans %d, samples %d, dropped %s",
                 t.phase, version,
                 _fmt(t.incumbent), t.sigma, t.accepted, t.evaluations,
                 c.get("spans", 0), c.get("samples", 0),
                 {r: c.get(r, 0) for r in DROP_REASONS})
        for r in self.behind():
            acked = f"v{r['acked_version']}" if r["acked_version"] >= 0 else "no version"
            log.warning("status: %s is behind: it acknowledged %s, not v%d (%d publishes "
                        "failed; last: %s)", r["url"], acked, version, r["failed"],
                        r["error"] or "none")


async def serve(cfg: TunerConfig) -> int:
    """Run until SIGTERM/SIGINT (0); a bad state file, one another tuner holds or a port in use
    is a UserError."""
    service = TunerService(cfg)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    shutdown.on_stop(stop.set)
    # Operators send SIGHUP to reload `gorgo extproc`; its default action ended the tuner
    # silently (rc 129) without its final save.
    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
        loop.add_signal_handler(signal.SIGHUP, log.info,
                                "SIGHUP ignored: the tuner reads its config only at start")
    try:
        await service.start(stop)
    except (OSError, RuntimeError) as exc:  # a port taken since the check (gRPC: RuntimeError)
        await service.stop()
        raise UserError(f"cannot start: {exc}") from None
    except BaseException:
        await service.stop()
        raise
    print(f"READY otlp={service.otlp_port} status={service.status_port}", flush=True)
    last_log = loop.time()
    exhausted = False  # said once: nothing changes it but an operator
    try:
        while not stop.is_set():
            now = loop.time()
            try:
                await service.tick(now)
            except VersionsExhausted as exc:
                if not exhausted:
                    log.error("tuning stopped: %s", exc)
                exhausted = True
            except (OSError, StateError) as exc:  # published nothing: tried again next tick
                log.error("tick failed: %s", exc)
            if now - last_log >= cfg.log_every_s:
                service.log_status()
                last_log = now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), cfg.tick_s)
    finally:
        await service.stop()
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="tuner YAML config")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS)


def main(args: argparse.Namespace) -> int:
    """Tune until SIGTERM/SIGINT (0); a bad config is a ConfigError (a UserError)."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(message)s")
    return asyncio.run(serve(load_config(args.config)))


def _routed_by(doc: dict[str, Any]) -> dict[str, Any]:
    """A router's GET /admin/weights decision counts by router process: a `--workers`
    supervisor's ``routed_by``, else its ``routed`` under its ``router`` id. A restarted router
    counts from 0 under a new id, and its earlier run's decisions still stand: the largest count
    heard per process, summed over processes (two pods behind one URL sum alike); the
    supervisor's ``retired_ids`` are runs a restart replaced, whose counts its ``retired``
    entry holds."""
    by = doc.get("routed_by")
    if isinstance(by, dict):
        return by
    routed, rid = doc.get("routed"), doc.get("router")
    return {rid if isinstance(rid, str) else "": routed} if isinstance(routed, dict) else {}
