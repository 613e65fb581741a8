"""How a long-running `gorgo` command stops on SIGTERM or Ctrl-C.

A command only notes which signal came and winds down in order (servers close their ports, a
replay writes its summary, a bench stops its workers); `gorgo.cli` then prints the single
``gorgo <command>: stopped (SIGTERM)`` line and picks the exit status, so no command prints its
own variant and no KeyboardInterrupt or CancelledError traceback reaches the terminal.

A child a command starts in a session of its own (which a stop signal to the command's group does
not reach) dies with it through `die_with_parent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
received: signal.Signals | None = None  # the first stop signal of this command, if any
_main_pid = 0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up in the parent: a forked child of a threaded process must not take
    the dynamic loader's lock, which another thread may have held at the fork."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child get SIGTERM when this process dies, even by SIGKILL
    (PR_SET_PDEATHSIG); None off Linux and off the main thread. The kernel sends the signal when
    the *thread* that forked exits, so a child started from a short-lived thread (a test's
    ``asyncio.to_thread`` restarting a router) would be stopped with that thread."""
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    return functools.partial(prctl, _PR_SET_PDEATHSIG, signal.SIGTERM)
