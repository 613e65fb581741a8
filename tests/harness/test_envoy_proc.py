"""`EnvoyProcess.start`: ready only when its own Envoy answers, a base id clash drawn again, an
interrupt while Envoy starts stops it (a stand-in for the binary)."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gorgo.envoy_config import render_bootstrap
from gorgo.harness import envoy_proc
from gorgo.harness.procs import PORT_CLASH, free_port
from gorgo.sim.presets import preset_fleet
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


@contextmanager
def answering(port: int, body: bytes) -> Iterator[None]:
    """Another process's HTTP server on ``port``, answering 200 and ``body`` to every GET."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _admin(port: int) -> dict:
    return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}


def _server_info(envoy: envoy_proc.EnvoyProcess) -> dict:
    with urllib.request.urlopen(envoy.admin_url + "/server_info", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.envoy
@pytest.mark.slow
def test_an_admin_port_another_server_answers_is_a_failed_start() -> None:
    """Before: any 200 on the drawn admin port's /ready meant ready, so a stack 'started' with its
    Envoy dead (it had exited on the taken port). Now the start fails with the kernel's words,
    which the stacks retry on new ports."""
    port = free_port()
    body = json.dumps({"state": "LIVE", "command_line_options": {"base_id": "1000"}}).encode()
    with answering(port, body):
        envoy = envoy_proc.EnvoyProcess({"admin": _admin(port)})
        with pytest.raises(RuntimeError, match=PORT_CLASH):
            envoy.start(timeout=30)
        assert envoy.proc is not None and envoy.proc.poll() is not None


@pytest.mark.envoy
@pytest.mark.slow
def test_a_base_id_another_envoy_holds_is_drawn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the second Envoy exited on the clash ('unable to bind domain socket', printed to a
    stderr nobody read) and the start failed with an empty log."""
    drawn = iter([4301, 4301, 4302])
    monkeypatch.setattr(envoy_proc, "draw_base_id", lambda: next(drawn))
    with envoy_proc.EnvoyProcess({"admin": _admin(free_port())}) as first, \
            envoy_proc.EnvoyProcess({"admin": _admin(free_port())}) as second:
        assert _server_info(first)["command_line_options"]["base_id"] == "4301"
        assert _server_info(second)["command_line_options"]["base_id"] == "4302"


@pytest.mark.envoy
@pytest.mark.slow
def test_a_second_rendered_envoy_cannot_take_the_first_ones_listener() -> None:
    """Before: Envoy's default SO_REUSEPORT let the second bind the same port and take a share of
    the first one's clients without a word."""
    spec = preset_fleet("paper")
    listen = f"127.0.0.1:{free_port()}"

    def envoy() -> envoy_proc.EnvoyProcess:
        return envoy_proc.EnvoyProcess(render_bootstrap(
            spec, listen=listen, extproc=f"127.0.0.1:{free_port()}",
            admin=f"127.0.0.1:{free_port()}"))

    with envoy():
        second = envoy()
        with pytest.raises(RuntimeError, match=PORT_CLASH):
            second.start(timeout=30)


@pytest.mark.envoy
@pytest.mark.slow
def test_an_endless_answer_on_the_admin_port_does_not_outlast_the_start_timeout() -> None:
    """Before (with the check of /server_info): its body was read whole, so a server trickling
    a byte every 0.2 s held the start for ever, past its timeout and Envoy's exit."""
    port = free_port()
    stop = threading.Event()
    listener = socket.create_server(("127.0.0.1", port))

    def trickle() -> None:
        listener.settimeout(0.2)
        conns = []
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
                conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n{")
                conns.append(conn)
            except TimeoutError:
                pass
            for c in conns:
                with contextlib.suppress(OSError):
                    c.sendall(b" ")
        for c in conns:
            c.close()

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        envoy = envoy_proc.EnvoyProcess({"admin": _admin(port)})
        with pytest.raises((RuntimeError, TimeoutError)):
            envoy.start(timeout=3)
    finally:
        stop.set()
        thread.join(5)
        listener.close()
