"""The offline benches' process pools (`gorgo bench sim`, `gorgo bench tune`): forked workers
that end cleanly.

A forked worker inherits its parent's signal handlers, and a handler that does not exit leaves
a terminated worker waiting on the pool's queue lock forever, and the parent joining it (seen
once in a test run). So each worker starts with SIGTERM at its default (it ends the worker) and
SIGINT ignored (Ctrl-C is the parent's to handle), and a pool whose work is done is closed and
joined, its workers leaving on their own; only an error or an interrupt terminates them.

A worker is forked with the parent's handlers and only then runs its initializer, so a SIGTERM
in between met the inherited handler: the worker lived on and the parent's join (or its exit)
waited forever. On a loaded machine that window is wide (tests/sim/test_pool.py hung a parallel
`make test`). So both signals are blocked while the pool forks: a worker, and the pool's own
threads that fork replacements, start with them blocked, and the initializer unblocks them once
its handlers are set, so a SIGTERM sent early is taken by the default action. The parent's own
signals are held for those moments and delivered when the mask is restored.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
from collections.abc import Iterator
from multiprocessing.pool import Pool

_HELD = {signal.SIGTERM, signal.SIGINT}


def _worker_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)


@contextlib.contextmanager
def fork_pool(jobs: int) -> Iterator[Pool]:
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        pool = mp.get_context("fork").Pool(jobs, initializer=_worker_signals)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # inside: a held Ctrl-C ends the pool
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()
