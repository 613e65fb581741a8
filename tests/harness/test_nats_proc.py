"""`NatsProcess.start`: an interrupt while the server starts stops it (a stand-in for it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gorgo.harness import nats_proc
from tests.support.children import (
    INTERRUPT,
    assert_an_interrupted_start_stops,
    fake_program,
    stand_in,
)


def test_an_interrupt_while_nats_starts_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: only the wait's own timeout stopped the server; Ctrl-C left it running in its own
    session."""
    fake = fake_program(tmp_path / "nats-server", stand_in(INTERRUPT))
    monkeypatch.setattr(nats_proc, "nats_binary", lambda: str(fake))
    assert_an_interrupted_start_stops(fake, lambda: nats_proc.NatsProcess().start(timeout=60))
