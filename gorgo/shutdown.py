"""How a long-running `gorgo` command stops on SIGTERM or Ctrl-C.

A command only notes which signal came and winds down in order (servers close their ports, a
replay writes its summary, a bench stops its workers); `gorgo.cli` then prints the single
``gorgo <command>: stopped (SIGTERM)`` line and picks the exit status, so no command prints its
own variant and no KeyboardInterrupt or CancelledError traceback reaches the terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
received: signal.Signals | None = None  # the first stop signal of this command, if any
_main_pid = 0


def note(signum: int) -> None:
    """Remember the first stop signal (later ones do not change the report)."""
    global received
    if received is None:
        received = signal.Signals(signum)


def install() -> None:
    """Make SIGINT and SIGTERM unwind a command as KeyboardInterrupt (call in the main thread)."""
    global _main_pid, received
    _main_pid, received = os.getpid(), None
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    if os.getpid() != _main_pid:
        # A forked worker (a bench's process pool) inherited this handler: its parent does the
        # stopping, so Ctrl-C is left to the parent and SIGTERM ends the worker without a trace.
        if signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        return
    note(signum)
    raise KeyboardInterrupt


def on_stop(callback: Callable[[], object]) -> Callable[[], None]:
    """Call ``callback`` in the running loop on SIGINT/SIGTERM; returns the undo function, which
    puts the previous handlers back (the loop alone would reset them to the defaults)."""
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def handler(signum: int) -> None:
        note(signum)
        callback()

    installed = []
    for sig in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, handler, sig)
            installed.append(sig)

    def undo() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)
            if previous[sig] is not None:
                signal.signal(sig, previous[sig])

    return undo
