"""`fork_pool`: the benches' workers end, even under a parent whose SIGTERM handler does not exit
(a worker inherits it; terminated so, it used to wait on the pool's queue lock forever)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = """
import signal
signal.signal(signal.SIGTERM, lambda *_: None)  # what a forked worker inherits
from gorgo.sim.pool import fork_pool
for k in range(10):
    try:
        with fork_pool(2) as pool:
            assert pool.map(abs, [-1, -2]) == [1, 2]
            if k % 2:
                raise RuntimeError("an error inside: the workers are terminated")
    except RuntimeError:
        pass
print("ended")
"""


def test_workers_end_whatever_handler_they_inherit() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ended", out.stderr
