"""Each decision counted once: the TTFT log's early samples joined with the spans that end them.

A stream's TTFT reaches the tuner first in Envoy's periodic access log (one entry per flush
interval while it is open: Envoy cannot tell whether an earlier entry already carried it), then
again in the span when it ends. `Join` says, for each parsed sample, what it adds: the decision's
first TTFT (`FIRST`: a new sample, early or complete), the E2E of a decision whose TTFT was already
counted (`END`), or nothing (`DUPLICATE`). Its memory is bounded: a decision is forgotten once no
record of it can still come (the fleet's request timeout after it was first seen; Envoy ends
every request by then), and at most ``max_ids`` are held. Past that bound the ended decisions go
first, oldest first: forgetting one only lets a duplicate through, and Envoy sends none that
late. A decision still streaming is forgotten only when more than ``max_ids`` stream at once
(`evicted_open` counts them): its end would then count as a new sample.
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
        # id -> when first seen: TTFT counted, the end still to come; and both counted
        self._open: OrderedDict[str, float] = OrderedDict()
        self._ended: OrderedDict[str, float] = OrderedDict()
        self.evicted_open = 0

    def __len__(self) -> int:
        return len(self._open) + len(self._ended)

    def admit(self, s: Sample) -> str:
        """FIRST, END or DUPLICATE for ``s`` (see the module docstring)."""
        now = self._clock()
        for held in (self._open, self._ended):
            while held and now - next(iter(held.values())) >= self.ttl_s:
                held.popitem(last=False)
        did = s.decision_id
        if did in self._ended:
            return DUPLICATE
        at = self._open.get(did)
        if at is not None:
            if s.early:
                return DUPLICATE
            del self._open[did]
            self._ended[did] = at
            return END
        (self._open if s.early else self._ended)[did] = now
        while len(self) > self.max_ids:
            if self._ended:
                self._ended.popitem(last=False)
            else:
                self._open.popitem(last=False)
                self.evicted_open += 1
        return FIRST
