"""The one error type for a problem the user can fix, and the bind checks that raise it.

A missing fleet file, a port in use or a router that does not answer is not a bug, so it gets one
line saying what is wrong and what to do, not a traceback: every such error derives from
`UserError`, and `gorgo.cli` prints ``gorgo <command>: <message>`` and exits 2 for all of them.
Anything else escaping a command is a bug and keeps its traceback. Stdlib only, so the pure core
(gorgo.core) can derive its errors from it too.
"""

from __future__ import annotations

import os
import socket


class UserError(Exception):
    """Bad input or environment; the message says what is wrong and, where it helps, what to do."""


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
