"""The one error type for a problem the user can fix, and the bind checks that raise it.

A missing fleet file, a port in use or a router that does not answer is not a bug, so it gets one
line saying what is wrong and what to do, not a traceback: every such error derives from
`UserError`, and `gorgo.cli` prints ``gorgo <command>: <message>`` and exits 2 for all of them.
Anything else escaping a command is a bug and keeps its traceback. Stdlib only at import, so the
pure core (gorgo.core) can derive its errors from it too; the argparse types of addresses and URLs
call the fleet file's checks, imported when they run.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn


class UserError(Exception):
    """Bad input or environment; the message says what is wrong and, where it helps, what to do."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are a UserError like any other: one line, exit 2, no usage dump (`gorgo`'s
    commands, and the bench scripts, whose argument errors were tracebacks or a usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see `{self.prog} --help`)")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # --log-level's choices
MAX_PORT = 65535


def port_number(text: str, lowest: int = 0) -> int:
    """An argparse type: a TCP port, 0 (any free one) to 65535 (a bind of more raised an
    OverflowError, a traceback); ``port_or_off`` also takes -1."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not lowest <= port <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"a port is {lowest} to {MAX_PORT}, got {port}")
    return port


def port_or_off(text: str) -> int:
    return port_number(text, lowest=-1)


def at_least(lo: float, cast: type = int) -> Callable[[str], Any]:
    """An argparse type: a number (``cast``) of at least ``lo``; a plain ValueError from deeper
    down would be a traceback."""
    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= lo:  # NaN too
            raise argparse.ArgumentTypeError(f"must be >= {lo:g}, got {text}")
        return value
    return parse


def positive_number(text: str) -> float:
    """An argparse type: a finite number above 0 (a speed, a factor)."""
    value = at_least(0.0, float)(text)
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def header_token(token: str) -> bool:
    """Whether a bearer token travels in an HTTP header as written: printable ASCII without
    spaces (a tuner's router token with a newline inside passed its start and crashed its first
    publish after READY; a space is no part of a bearer token either, RFC 6750)."""
    return token.isascii() and token.isprintable() and " " not in token


def header_pair(text: str) -> tuple[str, str]:
    """An argparse type for ``--header K:V``, stripped (`gorgo explain --header "x-gorgo-priority
    5"` became a header of that name with an empty value, and explained another request)."""
    key, sep, value = text.partition(":")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"wants K:V, got {text!r}")
    return key.strip(), value.strip()


def output_file(path: str | os.PathLike[str]) -> Path:
    """``path`` once a file can be written there, asked of the OS before any work: a missing
    folder was a traceback, for `gorgo replay --summary` after the whole replay had run. A file
    that was not there is not left behind."""
    p = Path(path)
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as exc:
        raise UserError(f"cannot write {p}: {exc.strerror or exc}") from None
    if not existed:
        p.unlink()
    return p


def output_dir(path: str | os.PathLike[str]) -> Path:
    """The results folder ``path``, created with its parents, or a UserError (a folder under a
    regular file was a FileExistsError traceback: `gorgo demo --out`, `gorgo bench sim --out`)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the folder {p}: {exc.strerror or exc}") from None
    return p


def address_arg(text: str) -> str:
    """An argparse type for a HOST:PORT flag, as gRPC and URLs read it (IPv6 in brackets), by
    the fleet file's one check: `gorgo extproc --otlp http://...` started with no span ever
    exported, and said nothing."""
    from gorgo.core.fleet import host_port, split_address  # the core derives from this module

    try:
        return host_port(*split_address(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def url_arg(text: str) -> str:
    """An argparse type for a URL flag, by the fleet file's one check: `gorgo replay --url
    notaurl` sent every request to nowhere, recorded a connection error for each and exited 0."""
    from gorgo.core.fleet import http_url

    if not http_url(text):
        raise argparse.ArgumentTypeError(f"expected an http(s) URL like http://host:port, "
                                         f"got {text!r}")
    return text


def bind_error(exc: OSError, what: str, hint: str) -> UserError:
    """A failed listen as a UserError: what the port was for, the OS's reason, what to do."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)  # asyncio's repeats the address
    return UserError(f"cannot listen for {what}: {reason}; {hint}")


def check_port(host: str, port: int, what: str, hint: str) -> None:
    """Raise UserError if ``host:port`` cannot be bound now (port 0 always can).

    gRPC logs a C-level error line of its own before it fails a bind, and by default shares a
    port through SO_REUSEPORT; a plain probe first keeps the failure to our one line.
    """
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        raise bind_error(exc, what, hint) from None
