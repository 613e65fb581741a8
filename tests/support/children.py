"""Stand-ins for the binaries the harness starts (tiny Python scripts), to test how long its
children live without starting the real ones."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

READY = "print('READY', flush=True)\n"
# SIGUSR1 to the process that started it, which `interrupted_by_child` turns into Ctrl-C: an
# interrupt that comes while the harness waits for the child to be ready.
INTERRUPT = "os.kill(os.getppid(), signal.SIGUSR1)\n"


def stand_in(does: str = "", then_sleep_s: float = 600) -> str:
    """A stand-in's code: it notes its pid next to itself (for the test to find it), does
    ``does``, then sleeps."""
    return ("import os, signal, time\nfrom pathlib import Path\n"
            "Path(__file__).with_suffix('.pid').write_text(str(os.getpid()))\n"
            f"{does}time.sleep({then_sleep_s})\n")


def fake_program(path: Path, code: str) -> Path:
    """An executable at ``path`` that runs ``code`` with this Python, whatever its arguments."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{code}")
    path.chmod(0o755)
    return path


def pid_of(program: Path) -> int:
    return int(program.with_suffix(".pid").read_text())


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped by its new parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def ended(program: Path) -> bool:
    """Whether a stand-in is not running: it ended, or it was stopped (and waited for) before it
    noted its pid."""
    pid_file = program.with_suffix(".pid")
    return not pid_file.exists() or not alive(pid_of(program))


def end(*programs: Path) -> None:
    """End the stand-ins a failed test left running (each in its own process group)."""
    for program in programs:
        if not ended(program):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid_of(program), signal.SIGKILL)


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupted_by_child() -> Iterator[None]:
    """SIGUSR1 (an `INTERRUPTS` stand-in's) raises KeyboardInterrupt here, as Ctrl-C would."""
    previous = signal.signal(signal.SIGUSR1, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def assert_an_interrupted_start_stops(program: Path, start: Callable[[], object]) -> None:
    """``start`` runs ``program`` (a stand-in that sends the interrupt once started): the
    KeyboardInterrupt reaches the caller and the program is stopped (it was left running in its
    own session)."""
    import pytest  # a test helper: imported where tests run

    try:
        with interrupted_by_child(), pytest.raises(KeyboardInterrupt):
            start()
        assert ended(program)
    finally:
        end(program)
