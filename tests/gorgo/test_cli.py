"""The `gorgo` command line fails one way and stops one way (see gorgo/cli.py's docstring).

A user error is one stderr line ``gorgo <command>: ...`` and exit 2; SIGTERM or Ctrl-C is one
``stopped (SIG...)`` line and exit 0 for a server, 130 for a batch command; never a traceback.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

import gorgo
from gorgo.cli import main
from gorgo.errors import UserError
from gorgo.progress import StatusLine

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "envoy" / "fleet.example.yaml"


def _one_line(capsys: pytest.CaptureFixture[str], command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gorgo {command}: "), err
    return lines[0]


@pytest.fixture
def body(tmp_path: Path) -> Path:
    path = tmp_path / "body.json"
    path.write_text('{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the whole test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- user errors, in process ----------------------------------------------------------------


def test_explain_of_a_request_the_router_refuses_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """As with --router (the router's 400 in one line): the offline what-if exited 1 with a
    JSON body."""
    bad = tmp_path / "body.json"
    bad.write_text("not json")
    assert main(["explain", "--fleet", str(EXAMPLE), "--body", str(bad)]) == 2
    line = _one_line(capsys, "explain")
    assert "refuses this request (400)" in line and "not valid JSON" in line


@pytest.mark.parametrize(("argv", "command", "says"), [
    (["envoy-config", "/nonexistent.yaml"], "envoy-config", "cannot read fleet file"),
    (["extproc", "--fleet", "/nonexistent.yaml"], "extproc", "cannot read fleet file"),
    (["demo", "--trace", "nonexist"], "demo", "unknown trace source 'nonexist'"),
])
def test_acceptance_commands_fail_in_one_line(
    argv: list[str], command: str, says: str, capsys: pytest.CaptureFixture[str],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # the demo must not create its results folder first
    assert main(argv) == 2
    assert says in _one_line(capsys, command)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("broken", ["missing", "invalid"])
@pytest.mark.parametrize(("argv", "command"), [
    (["envoy-config", "{fleet}"], "envoy-config"),
    (["extproc", "--fleet", "{fleet}", "--port", "0", "--metrics-port", "-1"], "extproc"),
    (["sim", "fleet", "{fleet}"], "sim fleet"),
    (["explain", "--fleet", "{fleet}", "--body", "{body}"], "explain"),
])
def test_a_bad_fleet_file_is_one_line(
    argv: list[str], command: str, broken: str, tmp_path: Path, body: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    fleet = tmp_path / "fleet.yaml"
    if broken == "invalid":
        fleet.write_text("replicas: 3\n")
    args = [a.format(fleet=fleet, body=body) for a in argv]
    assert main(args) == 2
    assert "fleet.yaml" in _one_line(capsys, command)


def test_explain_router_without_a_token(body: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GORGO_ADMIN_TOKEN", raising=False)
    assert main(["explain", "--router", "http://127.0.0.1:1", "--body", str(body)]) == 2
    line = _one_line(capsys, "explain")
    assert "--token-file" in line and "GORGO_ADMIN_TOKEN" in line


def test_explain_router_that_is_down(body: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GORGO_ADMIN_TOKEN", "secret")
    url = f"http://127.0.0.1:{_closed_port()}"
    assert main(["explain", "--router", url, "--body", str(body)]) == 2
    line = _one_line(capsys, "explain")
    assert f"cannot reach the router at {url}" in line and "refused" in line


def test_explain_router_prints_the_table_unless_json(body: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """--router printed JSON whatever --json said; --fleet printed the table."""
    main(["explain", "--fleet", str(EXAMPLE), "--body", str(body), "--json"])
    answer = json.loads(capsys.readouterr().out)  # what a router's /admin/explain answers
    monkeypatch.setenv("GORGO_ADMIN_TOKEN", "secret")
    monkeypatch.setattr("gorgo.explain.live", lambda *_: answer)
    assert main(["explain", "--router", "http://r:1", "--body", str(body)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"policy: {answer['policy']}") and answer["reason"] in out
    assert main(["explain", "--router", "http://r:1", "--body", str(body), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == answer


@pytest.mark.parametrize(("argv", "command", "says"), [
    (["extproc"], "extproc", "--fleet"),  # argparse: a required option
    (["sim", "engine", "--port", "x"], "sim engine", "expected a port number"),
    # each of these was a traceback (a review, 2026-12-04)
    (["sim", "engine", "--port", "99999"], "sim engine", "a port is 0 to 65535"),
    (["extproc", "--fleet", str(EXAMPLE), "--port", "70000"], "extproc", "0 to 65535"),
    (["extproc", "--fleet", str(EXAMPLE), "--log-level", "LOUD"], "extproc", "invalid choice"),
    (["extproc", "--fleet", "{tmp}/binary.yaml"], "extproc", "not UTF-8 text"),
    (["tuner", "--config", "{tmp}/binary.yaml"], "tuner", "not UTF-8 text"),
    (["replay", "--trace", "mooncake", "--url", "http://127.0.0.1:1", "--time-scale", "-1"],
     "replay", "must be >= 0"),
    (["replay", "--trace", "mooncake", "--url", "http://127.0.0.1:1", "--max-requests", "0"],
     "replay", "must be >= 1"),  # sent one request and exited 0
    (["demo", "--profile", "nosuch"], "demo", "invalid choice"),
    (["demo", "--stream-interval", "0"], "demo", "must be >= 1"),  # a RuntimeError at start
    # the whole trace in one instant: the demo sent it all and never finished
    (["demo", "--time-scale", "0"], "demo", "must be a finite number > 0"),
    (["demo", "--duration", "-5"], "demo", "must be >= 0"),
    # sent every request to nowhere, recorded connection errors and exited 0
    (["replay", "--trace", "chat", "--url", "notaurl", "--max-requests", "1"], "replay",
     "argument --url: expected an http(s) URL like http://host:port, got 'notaurl'"),
    (["replay", "--trace", "chat", "--url", "http://[::1", "--max-requests", "1"], "replay",
     "argument --url: expected"),
    (["explain", "--router", "127.0.0.1:50052"], "explain", "argument --router: expected an"),
    # a header of that name with an empty value: it explained another request
    (["explain", "--fleet", str(EXAMPLE), "--header", "x-gorgo-priority 5"], "explain",
     "argument --header: wants K:V, got 'x-gorgo-priority 5'"),
    (["replay", "--trace", "chat", "--url", "http://127.0.0.1:1", "--header", "noColon"],
     "replay", "argument --header: wants K:V, got 'noColon'"),
    # output paths that cannot be written: each was a traceback
    (["replay", "--trace", "chat", "--url", "http://127.0.0.1:1", "--max-requests", "1",
      "--out", "{tmp}/afile/x.jsonl"], "replay", "cannot write {tmp}/afile/x.jsonl: Not a dir"),
    (["sim", "view", str(EXAMPLE), "--region", "eu-frankfurt", "--port-offset", "100", "-o",
      "{tmp}/afile/x.yaml"], "sim view", "cannot write {tmp}/afile/x.yaml: Not a directory"),
    (["demo", "--out", "{tmp}/afile/d"], "demo", "cannot create the folder {tmp}/afile/d: Not"),
    (["bench", "sim", "--requests", "10", "--out", "{tmp}/afile/d"], "bench sim",
     "cannot create the folder {tmp}/afile/d: Not a directory"),
    (["bench", "tune", "--requests", "10", "--out", "{tmp}/afile"], "bench tune",
     "cannot create the folder {tmp}/afile: File exists"),
    (["envoy-config", str(EXAMPLE), "--listen", "0.0.0.0:99999"], "envoy-config",
     "port of 0 to 65535"),  # rendered as it was
    # a URL rendered a DNS cluster of host "http://127.0.0.1": every request skipped the router
    (["envoy-config", str(EXAMPLE), "--extproc", "http://127.0.0.1:18882"], "envoy-config",
     "--extproc: expected host:port (an IPv6 host in brackets, no URL)"),
    (["envoy-config", str(EXAMPLE), "--otlp", "http://127.0.0.1:4317"], "envoy-config",
     "--otlp: expected host:port (an IPv6 host in brackets, no URL)"),
    (["explain"], "explain", "--fleet"),
    (["replay", "--trace", "nonexist", "--url", "http://127.0.0.1:1"], "replay", "nonexist"),
    (["bench", "sim", "--trace", "nonexist", "--capacity", "1", "--out", "{tmp}"], "bench sim",
     "cannot load 'nonexist'"),
    (["tuner", "--config", "/nonexistent.yaml"], "tuner", "cannot read config"),
    # the router's clusters file dropped the discovered entry's fail-open cluster: every
    # request failing open a 503
    (["extproc", "--fleet", "{tmp}/discovered.yaml", "--cds-file", "{tmp}/cds.yaml"], "extproc",
     "replicas[0].discover: a fleet that discovers replicas by DNS runs without a clusters"),
    (["envoy-config", "{tmp}/discovered.yaml", "--cds-file", "{tmp}/cds.yaml"], "envoy-config",
     "runs without a clusters file"),
    # 100,000 workers started 256 processes before any stop could end them
    (["extproc", "--fleet", str(EXAMPLE), "--workers", "100000"], "extproc", "per core), got"),
    # a NaN rate fired the whole trace at once
    (["replay", "--trace", "chat:rate=nan", "--url", "http://127.0.0.1:1"], "replay", "rate"),
    # a traceback of thousands of lines
    (["envoy-config", "{tmp}/deep.yaml"], "envoy-config", "nested too deep"),
    (["envoy-config", "{tmp}/twice.yaml"], "envoy-config", "duplicate key 'limits'"),
])
def test_other_user_errors_are_one_line(argv: list[str], command: str, says: str,
                                        tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00fleet")
    (tmp_path / "afile").write_text("a file, not a folder\n")
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 600 + "]" * 600 + "\n")
    (tmp_path / "twice.yaml").write_text("limits: {max_messages: 10}\nlimits: {}\n")
    (tmp_path / "discovered.yaml").write_text(yaml.safe_dump({
        "regions": {"local": None}, "endpoint_picker": True,
        "replicas": [{"name": "vllm", "region": "local", "engine": "vllm",
                      "discover": {"dns": "localhost", "port": 8000}}]}))
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    assert says.format(tmp=tmp_path) in _one_line(capsys, command)


@pytest.mark.parametrize("flag", [["--otlp", "http://127.0.0.1:4317"], ["--otlp", "nohostport"],
                                  ["--envoy-admin", "nohostport"]])
def test_extproc_host_port_flags_are_checked_at_parse(
    flag: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The router started with them and never exported a span, or polled http://nohostport:80
    for ever, and said nothing; the fleet's HOST:PORT check refuses them."""
    monkeypatch.setattr("extproc.main.main", lambda args: 0)  # no router, whatever the parse
    assert main(["extproc", "--fleet", str(EXAMPLE), *flag]) == 2
    assert f"argument {flag[0]}: expected host:port (an IPv6 host in brackets, no URL)" \
        in _one_line(capsys, "extproc")


def test_existing_error_types_are_user_errors() -> None:
    from extproc.admin import AdminTokenError
    from gorgo.core.fleet import FleetError
    from gorgo.sim.traces import TraceError, TraceNotFound
    from tuner.main import ConfigError
    from tuner.state_store import StateError

    for cls in (AdminTokenError, FleetError, TraceError, TraceNotFound, ConfigError, StateError):
        assert issubclass(cls, UserError) and issubclass(cls, ValueError), cls


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import gorgo.envoy_config

    def broken(_args: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gorgo.envoy_config, "main", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["envoy-config", str(EXAMPLE)])


# --- version, help, unknown commands ----------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        expected = importlib.metadata.version("gorgo-router")
    except importlib.metadata.PackageNotFoundError:
        expected = gorgo.__version__
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"gorgo {expected}\n"


@pytest.mark.parametrize("argv", [["sim"], ["sim", "--help"], ["bench", "--help"], ["bench"]])
def test_a_group_lists_its_subcommands(argv: list[str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 0
    out = capsys.readouterr().out
    group = argv[0]
    subcommands = {"sim": ("sim engine", "sim fleet"), "bench": ("bench sim", "bench tune")}
    assert all(s in out for s in subcommands[group])
    assert "replay" not in out


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "gorgo: unknown command 'frobnicate'"
    assert "usage: gorgo <command>" in err and "envoy-config" in err


# --- progress lines -----------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_only_on_a_terminal() -> None:
    log = io.StringIO()
    status = StatusLine(log, every_s=0.0)
    for i in range(3):
        status.update(f"step {i}")
    status.done("finished")
    assert "\r" not in log.getvalue()
    assert log.getvalue().splitlines() == ["step 0", "step 1", "step 2", "finished"]

    quiet = io.StringIO()
    status = StatusLine(quiet)  # every 10 s: a short run writes the final state only
    for i in range(100):
        status.update(f"step {i}")
    status.done("finished")
    assert quiet.getvalue() == "finished\n"

    tty = _Tty()
    status = StatusLine(tty)
    status.update("step 0")
    status.done("finished")
    assert tty.getvalue().count("\r") == 2 and tty.getvalue().endswith("finished\n")


# --- ports and signals, as subprocesses ----------------------------------------------------------


def _gorgo(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen([sys.executable, "-m", "gorgo.cli", *args], cwd=REPO,
                                stdout=o, stderr=e)
    return proc, out, err


def _run(tmp_path: Path, *args: str) -> tuple[int, str]:
    proc, _, err = _gorgo(tmp_path, *args)
    try:
        return proc.wait(60), err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _fleet_on(tmp_path: Path, port: int) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["replicas"][0]["address"] = f"127.0.0.1:{port}"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.slow  # a second or more: out of test-fast
@pytest.mark.parametrize(("argv", "command", "says"), [
    (["extproc", "--fleet", str(EXAMPLE), "--port", "0", "--metrics-port", "{port}"],
     "extproc", "--metrics-port"),
    (["extproc", "--fleet", str(EXAMPLE), "--port", "{port}", "--metrics-port", "0"],
     "extproc", "--port"),
    (["sim", "fleet", "{fleet}"], "sim fleet", "replica use-0"),
    (["sim", "engine", "--profile", "tiny-test", "--port", "{port}"], "sim engine", "--port"),
])
def test_a_port_in_use_is_one_line(argv: list[str], command: str, says: str, busy_port: int,
                                   tmp_path: Path) -> None:
    fleet = _fleet_on(tmp_path, busy_port)
    rc, err = _run(tmp_path, *(a.format(port=busy_port, fleet=fleet) for a in argv))
    assert rc == 2, err
    lines = err.splitlines()  # also no C-level line of gRPC's own
    assert len(lines) == 1 and lines[0].startswith(f"gorgo {command}: "), err
    assert "in use" in lines[0] and str(busy_port) in lines[0] and says in lines[0]


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"no {text!r} in time"
        time.sleep(0.05)


@pytest.mark.slow  # a second or more: out of test-fast
@pytest.mark.parametrize(("argv", "ready", "sig", "rc"), [
    (["extproc", "--fleet", str(EXAMPLE), "--port", "0", "--metrics-port", "0"], "READY",
     signal.SIGTERM, 0),
    (["extproc", "--fleet", str(EXAMPLE), "--port", "0", "--metrics-port", "0"], "READY",
     signal.SIGINT, 0),
    (["sim", "engine", "--profile", "tiny-test"], "listening", signal.SIGTERM, 0),
    (["replay", "--trace", "chat:limit=500", "--url", "http://127.0.0.1:{port}"], "replay:",
     signal.SIGTERM, 130),
])
def test_a_signal_stops_with_one_line(argv: list[str], ready: str, sig: signal.Signals,
                                      rc: int, tmp_path: Path) -> None:
    args = [a.format(port=_closed_port()) for a in argv]
    proc, out, err = _gorgo(tmp_path, *args)
    try:
        _wait_for(err if argv[0] == "replay" else out, ready, proc)
        proc.send_signal(sig)
        assert proc.wait(30) == rc, err.read_text()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    text = err.read_text()
    assert not any(s in text for s in ("Traceback", "CancelledError", "KeyboardInterrupt")), text
    command = " ".join(argv[:2] if argv[0] == "sim" else argv[:1])
    assert text.splitlines()[-1] == f"gorgo {command}: stopped ({sig.name})", text
