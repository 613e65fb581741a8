"""Benches write their numbers into a marked block of a doc section, keeping the prose around it.

Several benches share one doc (docs/benchmarks.md), so the file is re-read right before writing
and only the block between the bench's own markers changes.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def write_block(doc: Path, section: str, begin: str, end: str, block: str, title: str) -> None:
    """Put ``block`` between ``begin``/``end`` under ``section`` (created if missing)."""
    generated = f"{begin}\n{block}{end}\n"
    text = doc.read_text() if doc.exists() else f"{title}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + generated + (f"\n{tail}" if tail else "")
    elif section in text:
        head, rest = text.split(section, 1)
        nxt = re.search(r"^## ", rest, re.M)
        tail = rest[nxt.start():] if nxt else ""
        text = f"{head}{section}\n\n{generated}" + (f"\n{tail}" if tail else "")
    else:
        text = text.rstrip("\n") + f"\n\n{section}\n\n{generated}"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def command_lines(script: str, argv: Sequence[str], wall_s: float | None) -> tuple[list[str], str]:
    """A bench's docs block head: its command line as a code block, and `` in N min on C CPUs``
    (empty when the wall time is unknown) for the sentence that says how the cells were made."""
    command = " ".join(shlex.quote(a) for a in [".venv/bin/python", script, *argv])
    took = "" if wall_s is None else f" in {wall_s / 60:.1f} min on {os.cpu_count()} CPUs"
    return ["```", command, "```", ""], took


def public_args(argv: Sequence[str]) -> list[str]:
    """The command line without ``--out PATH`` (a local file), as the docs show it."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def stop_on_signals() -> None:
    """SIGINT and SIGTERM end a bench or a test session as KeyboardInterrupt, so its cleanup
    runs."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
