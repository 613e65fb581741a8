"""The offline benches' process pools (`gorgo bench sim`, `gorgo bench tune`): forked workers
that end cleanly.

A forked worker inherits its parent's signal handlers, and a handler that does not exit leaves
a terminated worker waiting on the pool's queue lock forever, and the parent joining it (seen
once in a test run). So each worker starts with SIGTERM at its default (it ends the worker) and
SIGINT ignored (Ctrl-C is the parent's to handle), and a pool whose work is done is closed and
joined, its workers leaving on their own; only an error or an interrupt terminates them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import signal
from collections.abc import Iterator
from multiprocessing.pool import Pool


def _worker_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def fork_pool(jobs: int) -> Iterator[Pool]:
    pool = mp.get_context("fork").Pool(jobs, initializer=_worker_signals)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()
