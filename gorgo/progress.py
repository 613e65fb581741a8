"""One status line for long runs: redrawn in place on a terminal, plain periodic lines elsewhere.

Carriage-return updates turn a log file into one endless line (tens of KB after a long bench), so
off a terminal the line is written whole and at most once every ``every_s`` seconds, plus the
final state. The demo, the replay and the benches all report progress through this class.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import IO


class StatusLine:
    def __init__(self, stream: IO[str] | None = None, every_s: float = 10.0) -> None:
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty())
        self.every_s = every_s
        self._next = time.monotonic() + every_s

    def update(self, text: str) -> None:
        """Show ``text`` as the current state (off a terminal only once ``every_s`` has passed)."""
        if self.tty:
            width = shutil.get_terminal_size((150, 24)).columns - 1
            self.stream.write("\r\x1b[2K" + text[:width])  # a wrapped line could not be redrawn
        else:
            now = time.monotonic()
            if now < self._next:
                return
            self._next = now + self.every_s
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: str) -> None:
        """Show the final state and end the line, whatever the time since the last update."""
        if self.tty:
            self.update(text)
        self.stream.write(("" if self.tty else text) + "\n")
        self.stream.flush()
