"""The whole product on one machine: simulated fleet, router, tuner and real Envoy, on free ports.

`gorgo demo`, the live benches and the chaos tests all stand the same stack up through this one
class, so they exercise the processes a user runs (`gorgo sim fleet`, `gorgo extproc`,
`gorgo tuner`, `envoy`) exactly as documented, and every process is stopped on exit.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gorgo.core.fleet import FleetSpec, load_fleet
from gorgo.envoy_config import render_bootstrap
from gorgo.harness.envoy_proc import EnvoyProcess
from gorgo.harness.procs import GorgoProcess, ProcessSet, free_ports, wait_for


def with_free_ports(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a fleet document whose replicas listen on free loopback ports (drawn again by
    the stack that runs it if one is taken before the fleet binds it)."""
    out = json.loads(json.dumps(doc))
    for r, port in zip(out["replicas"], free_ports(len(out["replicas"])), strict=True):
        r["address"] = f"127.0.0.1:{port}"
    return out


@dataclass
class StackOptions:
    policy: str = "gorgo"
    tuner: bool = False
    tuner_optimizer: dict[str, Any] | None = None  # tuner/optimizer.py OptimizerConfig fields
    stream_interval: int = 8
    speed: float = 1.0
    seed: int = 0
    envoy_concurrency: int = 1
    # Cluster mode with membership changes: Envoy loads the replicas' clusters from a CDS file
    # that the router rewrites on every fleet reload.
    cds: bool = False
    # The router's fleet starts with only these replicas (the simulated fleet runs them all), so
    # a test can add the others without a restart; None: all of them.
    router_replicas: tuple[str, ...] | None = None
    # The control API of a simulated fleet that is already running (a proxy per region: several
    # stacks share one fleet, `gorgo.harness.multiproxy`); None: the stack starts its own.
    fleet_control_url: str | None = None


def start_sim_fleet(fleet_path: Path, opts: StackOptions,
                    extra: Sequence[str] = ()) -> GorgoProcess:
    """`gorgo sim fleet` for ``fleet_path`` with the stack options' engine settings (``extra``:
    further arguments, e.g. ``--view`` files), its control port free."""
    return GorgoProcess(["sim", "fleet", str(fleet_path), *extra, "--control-port", "0",
                         "--stream-interval", str(opts.stream_interval),
                         "--speed", str(opts.speed), "--seed", str(opts.seed)])


class LiveStack(ProcessSet):
    """Start with `start()` (or as a context manager); `stop()` ends every process it started.
    Where it runs the fleet and a start lost a replica's port, the replicas move to new ones:
    `spec` holds their addresses."""

    def __init__(self, fleet_doc: dict[str, Any], workdir: Path, opts: StackOptions) -> None:
        self.opts = opts
        # Absolute: the tuner reads relative paths in its config relative to the config file.
        self.workdir = Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.fleet_path = self.workdir / "fleet.yaml"
        self.router_fleet_path = self.fleet_path
        if opts.router_replicas is not None:
            self.router_fleet_path = self.workdir / "router-fleet.yaml"
        self._write_fleet(dict(fleet_doc, policy=opts.policy, allow_policy_override=True))
        self.cds_path = self.workdir / "cds.yaml" if opts.cds else None
        self.token = secrets.token_hex(16)
        self.token_path = self.workdir / "admin-token"
        self.token_path.write_text(self.token)
        os.chmod(self.token_path, 0o600)
        # What Envoy sends with its spans: the tuner counts no span without it.
        self.otlp_token = secrets.token_hex(16)
        self.otlp_token_path = self.workdir / "otlp-token"
        self.otlp_token_path.write_text(self.otlp_token)
        os.chmod(self.otlp_token_path, 0o600)
        self.procs: dict[str, GorgoProcess] = {}
        self.envoy: EnvoyProcess | None = None
        self.url = ""
        self.metrics_url = ""
        self.control_url = ""
        self.tuner_status_url = ""

    def _write_fleet(self, doc: dict[str, Any]) -> None:
        self.doc = doc
        self.fleet_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.spec: FleetSpec = load_fleet(self.fleet_path)
        if self.opts.router_replicas is not None:
            self.router_fleet_path.write_text(yaml.safe_dump(dict(doc, replicas=[
                r for r in doc["replicas"] if r["name"] in self.opts.router_replicas]),
                sort_keys=False))

    # --- lifecycle ------------------------------------------------------------------------------

    def _redraw(self) -> None:
        if self.opts.fleet_control_url is None:  # the replicas are this stack's to place
            self._write_fleet(with_free_ports(self.doc))

    def _start(self, ready_timeout: float) -> None:
        o = self.opts
        if o.fleet_control_url is None:
            fleet = start_sim_fleet(self.fleet_path, o)
            self.procs["fleet"] = fleet
            self.control_url = f"http://127.0.0.1:{fleet.field('control')}"
        else:
            self.control_url = o.fleet_control_url
        grpc_port, metrics_port, otlp_port, status_port, listen, admin = free_ports(6)
        self.procs["extproc"] = GorgoProcess([
            "extproc", "--fleet", str(self.router_fleet_path), "--port", str(grpc_port),
            "--metrics-port", str(metrics_port), "--admin-token-file", str(self.token_path),
            *(["--cds-file", str(self.cds_path)] if self.cds_path else []),
            "--log-level", "WARNING"])
        self.metrics_url = f"http://127.0.0.1:{metrics_port}"
        otlp = None
        if o.tuner:
            cfg = {
                "listen": f"127.0.0.1:{otlp_port}",
                "token_file": str(self.otlp_token_path),
                "fleet": str(self.fleet_path),  # its objective, SLO target and request timeout
                "status_listen": f"127.0.0.1:{status_port}",
                "state_file": str(self.workdir / "tuner-state.json"),
                "routers": [{"url": self.metrics_url, "token_file": str(self.token_path)}],
                "seed": o.seed,
                "log_every_s": 3600,
            }
            if o.tuner_optimizer:
                cfg["optimizer"] = o.tuner_optimizer
            cfg_path = self.workdir / "tuner.yaml"
            cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            self.procs["tuner"] = GorgoProcess(["tuner", "--config", str(cfg_path),
                                                "--log-level", "WARNING"])
            self.tuner_status_url = f"http://127.0.0.1:{status_port}"
            otlp = f"127.0.0.1:{otlp_port}"
        router_spec = load_fleet(self.router_fleet_path)
        boot = render_bootstrap(router_spec, listen=f"127.0.0.1:{listen}",
                                extproc=f"127.0.0.1:{grpc_port}", otlp=otlp,
                                otlp_token=self.otlp_token, admin=f"127.0.0.1:{admin}",
                                cds=str(self.cds_path) if self.cds_path else None)
        self.envoy = EnvoyProcess(boot, concurrency=o.envoy_concurrency).start()
        self.url = f"http://127.0.0.1:{listen}"
        if not wait_for(self.rtt_known, ready_timeout, 0.2):
            raise TimeoutError("the router did not measure every replica's RTT in time")

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
            self.envoy = None
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        self.procs.clear()

    # --- observation and control ------------------------------------------------------------------

    def _http(self, method: str, url: str, body: Any = None, token: bool = False) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("content-type", "application/json")
        if token:
            req.add_header("authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=5) as r:
            raw = r.read()
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()

    def router_metrics(self) -> str:
        return self._http("GET", self.metrics_url + "/metrics")

    def metric_values(self, name: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in self.router_metrics().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                labels, _, value = line.rpartition(" ")
                out[labels[len(name):]] = float(value)
        return out

    def fleet(self, method: str = "GET", path: str = "", body: Any = None) -> Any:
        """The router's membership admin API (`/admin/fleet...`)."""
        return self._http(method, self.metrics_url + "/admin/fleet" + path, body, token=True)

    def rtt_known(self) -> bool:
        try:
            values = self.metric_values("gorgo_rtt_seconds")
        except (OSError, urllib.error.URLError):
            return False
        return bool(values) and all(v == v for v in values.values())

    def weights(self) -> dict[str, Any]:
        return self._http("GET", self.metrics_url + "/admin/weights", token=True)

    def explain(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
        """Every replica's cost terms for a request on the router's live state, unrouted."""
        return self._http("POST", self.metrics_url + "/admin/explain",
                          {"path": path, "body": json.dumps(body)}, token=True)

    def control(self, replica: str, action: str, **body: Any) -> dict[str, Any]:
        return self._http("POST", f"{self.control_url}/replicas/{replica}/{action}", body)

    def tuner_status(self) -> dict[str, Any]:
        """The tuner's GET /status (the stack must run with ``tuner``)."""
        if not self.tuner_status_url:
            raise RuntimeError("this stack runs no tuner")
        return self._http("GET", self.tuner_status_url + "/status")

    def fleet_status(self) -> dict[str, Any]:
        return self._http("GET", self.control_url + "/status")

    def inflight(self) -> float:
        return sum(self.metric_values("gorgo_inflight_requests").values())

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until the router has nothing in flight (every stream closed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.inflight() == 0:
                return True
            time.sleep(0.2)
        return False
