"""The tuner's state file: written atomically, so a crash leaves either the old or the new state.

A half-written file would lose the version counter, and a restarted tuner would then reissue
versions the routers already hold (they refuse those with 409). So the JSON goes to a temporary
file in the same directory, is fsynced, and replaces the old file with one rename. One tuner at a
time writes it: each holds a lock on ``<state_file>.lock`` while it runs (`lock_state`).

A state file is trusted no more than a span: every field the tuner resumes from is checked when it
is loaded (`check_state`): weights within the contract's bounds, rates within its rate bounds, a
version within int64, counts non-negative integers, p95s finite and within the request timeout,
the RNG state one the generator takes. A file that fails is refused with one line naming the field;
the tuner stops rather than publish from it. A replica the routers no longer know is not an error
(it was removed from the fleet file): the tuner forgets its rate once the routers have answered.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from gorgo.core.contract import PREFILL_RATE_BOUNDS, VERSION_MAX, WEIGHT_BOUNDS
from gorgo.core.fleet import MAX_INT, finite_number
from gorgo.core.terms import OBJECTIVES, TTFT, weight_keys
from gorgo.errors import UserError
from tuner.optimizer import CONVERGED, EVALUATING, STATE_FORMAT, point_from_state

P95_KEYS = ("incumbent_p95", "last_good_p95", "baseline_p95")
LONGEST_TIMEOUT_MS = 1000.0 * MAX_INT  # timeouts.request_s is at most 2^53 s

class StateError(UserError, ValueError):
    """The state file cannot be used (read, trusted, written or locked); the message names
    the file."""


def lock_state(path: str | Path) -> int:
    """An exclusive lock on ``<path>.lock``, held while the returned descriptor is open (the
    process's life: the kernel drops it however the process ends). Two tuners on one state file
    each renumbered above the other's versions: a router went from v1 to v61 in 6 s."""
    path = Path(path)
    lock = path.with_name(path.name + ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise StateError(f"{path}: cannot create its lock file: {exc.strerror}: "
                         f"{exc.filename}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise StateError(f"{path}: another tuner holds {lock}; stop it, or give this one a "
                         "state_file of its own") from None
    return fd


def save_state(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` atomically; a StateError naming ``path`` if the file system refuses."""
    path = Path(path)
    text = json.dumps(state, indent=1, sort_keys=True, allow_nan=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise StateError(f"{path}: cannot write the state file: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise StateError(f"{path}: cannot write the state file: {exc.strerror}") from None
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def load_state(path: str | Path, max_ms: float) -> dict[str, Any] | None:
    """The saved state, or None if there is none yet; ``max_ms`` is the fleet's request timeout
    (no p95 can be longer)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StateError(f"{path}: cannot read state file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise StateError(f"{path}: not UTF-8 text; move it away to start afresh") from None
    try:
        state = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise StateError(f"{path}: not valid JSON ({exc}); move it away to start afresh") from None
    if not isinstance(state, dict):
        raise StateError(f"{path}: expected a JSON object")
    for key in P95_KEYS:
        # Scored under a longer request timeout than the fleet's today (lowered since, by any
        # factor: a state scored at 400 s was refused once the timeout went from 600 to 30 s):
        # no request takes that long any more, so the score is forgotten (measured again), not
        # the whole state. Past the longest timeout a fleet accepts, it is no score (refused
        # below: a 1.7e305 p95 once switched regression detection off).
        v = state.get(key)
        if (not isinstance(v, bool) and isinstance(v, int | float)
                and max_ms < v <= LONGEST_TIMEOUT_MS):
            state[key] = None
    try:
        check_state(state, max_ms)
        # Beyond the checked fields (the history, say): Python reads NaN and Infinity, but the
        # first save after the start would refuse them, and the tuner with it.
        json.dumps(state, allow_nan=False)
    except ValueError as exc:
        raise StateError(f"{path}: {exc}; fix or move it away to start afresh") from None
    return state


def _integer(state: Mapping[str, Any], key: str, lo: int, hi: int = VERSION_MAX) -> int:
    return _int(state.get(key), key, lo, hi)


def _int(v: Any, key: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{key}: expected an integer in [{lo}, {hi}], got {_short(v)}")
    return v


def _number(v: Any, key: str, lo: float, hi: float, low_open: bool = False) -> float:
    x = finite_number(v)  # an integer past a float's range raised OverflowError at the start
    if x is None or not ((lo < x if low_open else lo <= x) and x <= hi):
        bound = f"{'(' if low_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"{key}: expected a number in {bound}, got {_short(v)}")
    return x


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _weights(state: Mapping[str, Any], key: str, fmt: int, required: bool,
             keys: tuple[str, ...]) -> None:
    v = state.get(key)
    if v is None and not required:
        return
    try:
        point = point_from_state(v, fmt, keys)
    except ValueError as exc:
        raise ValueError(f"{key}: {str(exc)[:120]}") from None
    for k, x in point.items():
        _number(x, f"{key}.{k}", *WEIGHT_BOUNDS[k])


def check_state(state: Mapping[str, Any], max_ms: float) -> None:
    """Every field `Tuner.restore` reads, or ValueError naming the first it cannot trust."""
    fmt = state.get("format")
    if fmt not in range(1, STATE_FORMAT + 1) or isinstance(fmt, bool):
        raise ValueError(f"format: expected 1 to {STATE_FORMAT}, got {_short(fmt)}")
    objective = state.get("objective", TTFT)  # before format 3, every tuner's
    if objective not in OBJECTIVES:
        raise ValueError(f"objective: expected one of {', '.join(OBJECTIVES)}, got "
                         f"{_short(objective)}")
    keys = weight_keys(objective)
    _weights(state, "incumbent", fmt, required=True, keys=keys)
    for key in ("last_good", "model_tried"):
        _weights(state, key, fmt, required=False, keys=keys)
    _integer(state, "next_version", 1)
    evaluations = _integer(state, "evaluations", 0)
    _integer(state, "accepted", 0, evaluations)
    _integer(state, "failures", 0)
    _number(state.get("sigma"), "sigma", 0.0, 1e3, low_open=True)
    if state.get("phase") not in (EVALUATING, CONVERGED):
        raise ValueError(f"phase: expected {EVALUATING} or {CONVERGED}, got "
                         f"{_short(state.get('phase'))}")
    for key in P95_KEYS:
        if state.get(key) is not None:
            _number(state[key], key, 0.0, max_ms)
    rates = state.get("prefill_rate") or {}
    if not isinstance(rates, dict):
        raise ValueError("prefill_rate: expected {replica: tokens/s}")
    for name, rate in rates.items():
        if not name or len(name) > 256:
            raise ValueError(f"prefill_rate: {_short(name)} is not a replica name")
        _number(rate, f"prefill_rate.{name}", *PREFILL_RATE_BOUNDS)
    history = state.get("history") or []
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        raise ValueError("history: expected a list of objects")
    spreads = state.get("spreads") or []
    if not isinstance(spreads, list) or not all(isinstance(x, list) for x in spreads):
        raise ValueError("spreads: expected a list, per evaluation, of [between, within, df, lag] "
                         "lists (or, written by an older tuner, one [between, within, df] or "
                         "[between, within] list)")
    for i, ev in enumerate(spreads):
        old = bool(ev) and not isinstance(ev[0], list)  # [] : an evaluation with no pair
        for j, x in enumerate([ev] if old else ev):
            where = f"spreads[{i}]" if old else f"spreads[{i}][{j}]"
            if not isinstance(x, list) or len(x) not in ((2, 3) if old else (4,)):
                raise ValueError(f"{where}: expected [between, within, df, lag] (or, written by "
                                 "an older tuner, [between, within, df] or [between, within])")
            _number(x[0], f"{where}[0]", 0.0, 1e6)
            _number(x[1], f"{where}[1]", 0.0, 1e6)
            if len(x) > 2:
                _number(x[2], f"{where}[2]", 0.0, 1e6)
            if len(x) > 3:
                _int(x[3], f"{where}[3]", 1, 10**6)
    rng = state.get("rng")
    if rng is not None:
        try:
            np.random.default_rng().bit_generator.state = rng
        except (ValueError, TypeError, KeyError, OverflowError):
            raise ValueError("rng: not a state of the tuner's generator (PCG64)") from None
