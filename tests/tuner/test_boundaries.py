"""The tuner is a separate process from the router: it talks to it over HTTP only, and shares
nothing with it but the contract (`gorgo.core.contract`) and the registry of terms."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_tuner_never_imports_the_router() -> None:
    code = (
        "import sys\n"
        "import tuner.main, tuner.optimizer, tuner.publisher, tuner.receiver, tuner.samples\n"
        "import tuner.calibration, tuner.weight_fit, tuner.state_store\n"
        "bad = sorted(m for m in sys.modules if m == 'extproc' or m.startswith('extproc.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""
