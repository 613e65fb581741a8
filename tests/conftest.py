"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gorgo.harness.procs import LoopThread


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()
