"""`EnvoyProcess.start`: an interrupt while Envoy starts stops it (a stand-in for the binary)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gorgo.harness import envoy_proc
from gorgo.harness.procs import free_port
from tests.support.children import (
    INTERRUPT,
    assert_an_interrupted_start_stops,
    fake_program,
    stand_in,
)


def test_an_interrupt_while_envoy_starts_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: only the wait's own timeout stopped Envoy; Ctrl-C left it running in its own
    session."""
    fake = fake_program(tmp_path / "envoy", stand_in(INTERRUPT))
    monkeypatch.setattr(envoy_proc, "envoy_binary", lambda: str(fake))
    admin = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}}
    envoy = envoy_proc.EnvoyProcess({"admin": admin})
    assert_an_interrupted_start_stops(fake, lambda: envoy.start(timeout=60))
