"""The tuner's state file: written atomically, so a crash leaves either the old or the new state.

A half-written file would lose the version counter, and a restarted tuner would then reissue
versions the routers already hold (they refuse those with 409). So the JSON goes to a temporary
file in the same directory, is fsynced, and replaces the old file with one rename.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gorgo.errors import UserError


class StateError(UserError, ValueError):
    """The state file exists but cannot be used; the message names the file."""


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(state, indent=1, sort_keys=True, allow_nan=False)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_state(path: str | Path) -> dict[str, Any] | None:
    """The saved state, or None if there is none yet."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"{path}: cannot read state file: {exc.strerror}") from None
    try:
        state = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StateError(f"{path}: not valid JSON ({exc}); move it away to start afresh") from None
    if not isinstance(state, dict):
        raise StateError(f"{path}: expected a JSON object")
    return state
