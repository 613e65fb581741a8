"""`gorgo envoy-drain` against a real Envoy: it returns only once the requests Envoy carries have
finished (answered whole, not cut), gives up at its timeout, and always writes its done file."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gorgo.harness.procs import BIN
from tests.support.e2e import Stack, chat, post, start_stack, stop_stack

pytestmark = pytest.mark.envoy


@pytest.fixture
def st(tmp_path: Path) -> Iterator[Stack]:
    stack = start_stack(tmp_path, n=2)
    yield stack
    stop_stack(stack)


def _drain(st: Stack, done: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "gorgo"), "envoy-drain", "--admin", st.envoy.admin_url,
                           "--done-file", str(done), *args],
                          capture_output=True, text=True, timeout=60)


def _hold(st: Stack, n: int, delay_s: float) -> list:
    for u in st.upstreams:
        u.delay_s = delay_s
    body = json.dumps(chat("held")).encode()
    held = [asyncio.run_coroutine_threadsafe(
        post(st.url + "/v1/chat/completions", body, {}), st.lt.loop) for _ in range(n)]
    deadline = time.monotonic() + 10
    while sum(len(u.served) for u in st.upstreams) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return held


def test_returns_once_the_open_requests_finished_whole(st: Stack, tmp_path: Path) -> None:
    held = _hold(st, 3, delay_s=2.0)
    done = tmp_path / "run" / "drained"
    out = _drain(st, done, "--min-s", "0.2", "--timeout-s", "30")
    assert out.returncode == 0, out.stderr
    assert "envoy drained after" in out.stderr
    # every held request had its whole answer by then
    assert all(h.done() for h in held)
    assert [h.result()[0] for h in held] == [200] * 3
    assert done.exists()
    # draining Envoy still serves (its listeners stay open for clients not yet moved)
    for u in st.upstreams:
        u.delay_s = 0.0
    status, _, _, _ = st.post(json.dumps(chat("after")).encode())
    assert status == 200


def test_gives_up_at_its_timeout_and_still_writes_the_done_file(st: Stack,
                                                              tmp_path: Path) -> None:
    held = _hold(st, 1, delay_s=5.0)
    done = tmp_path / "drained"
    out = _drain(st, done, "--min-s", "0", "--timeout-s", "0.5")
    assert out.returncode == 1 and "still carries 1 requests" in out.stderr
    assert done.exists()
    assert held[0].result(timeout=30)[0] == 200


def test_an_unreachable_admin_is_one_line_and_the_done_file_is_written(tmp_path: Path) -> None:
    done = tmp_path / "drained"
    out = subprocess.run([str(BIN / "gorgo"), "envoy-drain", "--admin", "127.0.0.1:1",
                          "--done-file", str(done)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "cannot reach Envoy's admin" in out.stderr
    assert done.exists()


def test_bad_arguments_are_one_line_and_still_write_the_done_file(tmp_path: Path) -> None:
    done = tmp_path / "drained"
    out = subprocess.run([str(BIN / "gorgo"), "envoy-drain", "--timeout-s", "3",  # < --min-s 5
                          "--done-file", str(done)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--min-s <= --timeout-s" in out.stderr
    assert done.exists()
