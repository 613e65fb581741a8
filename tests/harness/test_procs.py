"""`GorgoProcess`: how long its child lives, with a stand-in for the `gorgo` binary."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gorgo.harness import procs
from gorgo.harness.procs import GorgoProcess, wait_for
from tests.support.children import (
    INTERRUPT,
    READY,
    alive,
    end,
    ended,
    fake_program,
    interrupted_by_child,
    pid_of,
    stand_in,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def gorgo_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where GorgoProcess finds `gorgo`: the test writes a stand-in there, ended after the test
    whatever happened."""
    monkeypatch.setattr(procs, "BIN", tmp_path)
    yield tmp_path
    end(tmp_path / "gorgo")


@pytest.mark.slow
def test_a_child_that_prints_nothing_times_out_and_is_stopped(gorgo_bin: Path) -> None:
    """Before: the wait read lines with a blocking readline, so a silent child held it past any
    timeout (30 s with timeout=2); here the stand-in ends after 20 s, and the old wait raised
    RuntimeError("exited") then instead of TimeoutError."""
    fake = fake_program(gorgo_bin / "gorgo", stand_in(then_sleep_s=20))
    with pytest.raises(TimeoutError, match="not ready"):
        GorgoProcess(["extproc"], timeout=1)
    assert ended(fake)


def test_an_interrupt_while_the_child_starts_stops_it(gorgo_bin: Path) -> None:
    """Before: only the wait's own TimeoutError stopped the child; Ctrl-C (KeyboardInterrupt)
    left it running in its own session."""
    fake = fake_program(gorgo_bin / "gorgo", stand_in(INTERRUPT))
    with interrupted_by_child(), pytest.raises(KeyboardInterrupt):
        GorgoProcess(["extproc"], timeout=60)
    assert ended(fake)


def test_a_child_that_exits_before_ready_is_reported(gorgo_bin: Path) -> None:
    fake_program(gorgo_bin / "gorgo", "print('bad flag', flush=True)\nraise SystemExit(2)\n")
    with pytest.raises(RuntimeError, match="exited: bad flag"):
        GorgoProcess(["extproc"])


DRIVER = """
import sys, time
from pathlib import Path
from gorgo.harness import procs, vllm_proc
procs.BIN = Path(sys.argv[1])
ext = procs.GorgoProcess(["extproc"])
engine = vllm_proc.VLLMProcess("a", 0, 0, Path(sys.argv[1])).start()
print("STARTED", flush=True)
time.sleep(600)
"""


def test_children_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    """SIGTERM to `make test-engines` (a CI timeout) left both vLLM engines running, reparented to
    PID 1: they run in sessions of their own. Now a harness child gets SIGTERM when its parent
    dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    gorgo = fake_program(tmp_path / "gorgo", stand_in(READY))
    engine = fake_program(tmp_path / "engines" / "vllm" / "bin" / "python",
                          stand_in(READY))
    env = {**os.environ, "ENGINE_DIR": str(tmp_path / "engines"), "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline() == "STARTED\n"
        assert wait_for(engine.with_suffix(".pid").exists, 30)  # VLLMProcess.start waits not
        pids = [pid_of(gorgo), pid_of(engine)]
        assert all(map(alive, pids))
        driver.kill()
        driver.wait()
        assert wait_for(lambda: not any(map(alive, pids)), 30)
    finally:
        driver.kill()
        driver.wait()
        end(gorgo, engine)


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread(gorgo_bin: Path) -> None:
    """The parent-death signal comes when the *thread* that forked exits: a router restarted from
    `asyncio.to_thread` (tests/chaos) would be stopped with that thread; only a child started on
    the main thread gets it."""
    fake_program(gorgo_bin / "gorgo", stand_in(READY))
    started: list[GorgoProcess] = []
    thread = threading.Thread(target=lambda: started.append(GorgoProcess(["extproc"])))
    thread.start()
    thread.join()
    try:
        time.sleep(0.5)  # the signal, had it been asked for, comes as the thread ends
        assert started[0].p.poll() is None
    finally:
        started[0].stop()


def test_a_start_that_lost_a_port_is_redrawn_and_tried_again() -> None:
    tries: list[int] = []
    redraws: list[int] = []

    def start() -> str:
        tries.append(1)
        if len(tries) < 3:
            raise RuntimeError("envoy exited 1: cannot bind '127.0.0.1:29807': "
                               f"{procs.PORT_CLASH}")
        return "up"

    assert procs.retried_on_port_clash(start, lambda: redraws.append(1)) == "up"
    assert (len(tries), len(redraws)) == (3, 2)


@pytest.mark.parametrize("error", [RuntimeError("gorgo extproc exited: bad fleet file"),
                                   TimeoutError("not ready in 20 s"), KeyboardInterrupt()])
def test_a_start_that_failed_otherwise_is_not_retried(error: BaseException) -> None:
    tries: list[int] = []

    def start() -> None:
        tries.append(1)
        raise error

    with pytest.raises(type(error)):
        procs.retried_on_port_clash(start, lambda: pytest.fail("redrawn"))
    assert len(tries) == 1


def test_a_port_that_stays_taken_fails_after_the_last_attempt() -> None:
    tries: list[int] = []

    def start() -> None:
        tries.append(1)
        raise RuntimeError(procs.PORT_CLASH)

    with pytest.raises(RuntimeError, match=procs.PORT_CLASH):
        procs.retried_on_port_clash(start, lambda: None, attempts=2)
    assert len(tries) == 2
