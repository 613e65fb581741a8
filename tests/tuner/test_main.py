"""`gorgo tuner` as a process: what it does with a second copy of itself, SIGHUP and a state
directory it cannot write."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from gorgo.harness.procs import BIN, GorgoProcess, free_port, wait_for


def write_config(tmp: Path, **extra: object) -> Path:
    """A tuner that starts without any router answering (its initial weights given)."""
    (tmp / "otlp-token").write_text("otlp-tok\n")
    (tmp / "admin-token").write_text("admin-tok\n")
    doc = {"listen": "127.0.0.1:0", "token_file": "otlp-token", "state_file": "state/tuner.json",
           "routers": [{"url": f"http://127.0.0.1:{free_port()}", "token_file": "admin-token"}],
           "initial_weights": {"rtt": 1.0, "queue": 1.0}, **extra}
    path = tmp / "tuner.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_tuner(config: Path) -> subprocess.CompletedProcess[str]:
    """A tuner expected to exit by itself (else the timeout fails the test)."""
    return subprocess.run([str(BIN / "gorgo"), "tuner", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_a_second_tuner_on_one_state_file_exits_2_naming_its_lock(tmp_path: Path) -> None:
    """Two tuners on one state file both ran, each renumbering above the other's versions: a
    router went from v1 to v61 in 6 s."""
    config = write_config(tmp_path)
    first = GorgoProcess(["tuner", "--config", str(config)], timeout=60)
    try:
        second = run_tuner(config)
        assert second.returncode == 2 and second.stdout == ""
        lock = tmp_path / "state" / "tuner.json.lock"
        assert second.stderr.splitlines() == [
            f"gorgo tuner: {tmp_path / 'state' / 'tuner.json'}: another tuner holds {lock}; "
            "stop it, or give this one a state_file of its own"]
        assert first.p.poll() is None
    finally:
        first.stop()
    assert first.p.returncode == 0
    GorgoProcess(["tuner", "--config", str(config)], timeout=60).stop()  # the lock went with it


def test_sighup_is_ignored_with_a_log_line(tmp_path: Path) -> None:
    """Operators send SIGHUP to reload `gorgo extproc`; it ended the tuner silently (rc 129),
    without its final save."""
    tuner = GorgoProcess(["tuner", "--config", str(write_config(tmp_path))], timeout=60)
    try:
        tuner.p.send_signal(signal.SIGHUP)
        assert wait_for(lambda: any("SIGHUP ignored" in line for line in tuner.lines))
        assert tuner.p.poll() is None
    finally:
        tuner.stop()
    assert tuner.p.returncode == 0
    assert "Traceback" not in "".join(tuner.lines)


def test_a_state_directory_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """Two tracebacks and exit 1: the start's save failed, then the stop's save again."""
    # A directory nobody can create, root included (whom permissions would not stop); reading
    # its file finds none, as a fresh start's does.
    state = Path("/proc/gorgo-tuner-test/state.json")
    out = run_tuner(write_config(tmp_path, state_file=str(state)))
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert lines[0].startswith(f"gorgo tuner: {state}: ")
