"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gorgo.harness.docblock import stop_on_signals
from gorgo.harness.procs import LoopThread


def pytest_configure(config: pytest.Config) -> None:
    # SIGTERM (a CI timeout or cancel, `timeout`) ended pytest without any fixture's teardown:
    # the engine tests' vLLM servers, in sessions of their own, ran on. As Ctrl-C does, it now
    # unwinds the session, so every fixture stops what it started.
    stop_on_signals()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()
