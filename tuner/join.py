"""Each decision counted once: the TTFT log's early samples joined with the spans that end them.

A stream's TTFT reaches the tuner first in Envoy's periodic access log (one entry per flush
interval while it is open: Envoy cannot tell whether an earlier entry already carried it), then
again in the span when it ends. `Join` says, for each parsed sample, what it adds: the decision's
first TTFT (`FIRST`: a new sample, early or complete), the E2E of a decision whose TTFT was already
counted (`END`), or nothing (`DUPLICATE`). Its memory is bounded: a decision is forgotten once no
record of it can still come (the fleet's request timeout after it was first seen; Envoy ends
every request by then), and at most ``max_ids`` are held (the oldest go first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from tuner.samples import Sample

FIRST, END, DUPLICATE = "first", "end", "duplicate"


class Join:
    def __init__(self, ttl_s: float, max_ids: int = 200_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (ttl_s > 0 and max_ids >= 1):
            raise ValueError("join: need ttl_s > 0 and max_ids >= 1")
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._clock = clock
        self._seen: OrderedDict[str, tuple[float, bool]] = OrderedDict()  # id -> (at, ended)

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, s: Sample) -> str:
        """FIRST, END or DUPLICATE for ``s`` (see the module docstring)."""
        now = self._clock()
        self._expire(now)
        seen = self._seen.get(s.decision_id)
        if seen is None:
            self._seen[s.decision_id] = (now, not s.early)
            if len(self._seen) > self.max_ids:
                self._seen.popitem(last=False)
            return FIRST
        at, ended = seen
        if ended or s.early:
            return DUPLICATE
        self._seen[s.decision_id] = (at, True)
        return END

    def _expire(self, now: float) -> None:
        while self._seen:
            at = next(iter(self._seen.values()))[0]
            if now - at < self.ttl_s:
                return
            self._seen.popitem(last=False)
