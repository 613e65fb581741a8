"""The test session itself: SIGTERM unwinds it as Ctrl-C does, so every fixture's cleanup runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gorgo.harness.procs import wait_for

REPO = Path(__file__).resolve().parents[1]
INNER = """
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def engines():
    try:
        (HERE / "starting").write_text("")
        time.sleep(600)  # as tests/engines' stack fixture waits for vLLM
        yield
    finally:
        (HERE / "stopped").write_text("")


def test_with_engines(engines):
    pass
"""


def test_sigterm_runs_the_fixtures_cleanup(tmp_path: Path) -> None:
    """Before: SIGTERM (a CI timeout or cancel) ended pytest at once, and the engine tests'
    `stack` fixture never stopped its vLLM servers (both ran on, reparented to PID 1)."""
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # tests/conftest.py loaded as a plugin: the inner tests live outside this tree.
    inner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
         "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for((tmp_path / "starting").exists, 60)
        inner.send_signal(signal.SIGTERM)
        out, _ = inner.communicate(timeout=60)
    finally:
        inner.kill()
        inner.wait()
    assert (tmp_path / "stopped").exists(), out
    assert inner.returncode == pytest.ExitCode.INTERRUPTED, out
