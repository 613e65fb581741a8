"""The fail-open count of `python -m bench.dataplane`'s saturation runs."""

from __future__ import annotations

import pytest

from bench.dataplane.load import _fail_open

PREFIX = "http.gorgo_ingress.ext_proc."


class _Envoy:
    """Envoy's ext_proc counters after 3 requests failed open, as a real Envoy (the bench's
    front Envoy and fleet) counted them."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.counters = {PREFIX + k: v for k, v in counters.items()}

    def stats(self, prefix: str = "") -> dict[str, int]:
        return self.counters


@pytest.mark.parametrize("counters", [
    # the router too slow: each timed-out answer counts in both (the bench read 6)
    {"failure_mode_allowed": 3, "message_timeouts": 3},
    # the router's port refused: the stream fails, no timeout
    {"failure_mode_allowed": 3, "streams_failed": 3, "streams_started": 3},
], ids=["timeouts", "refused"])
def test_each_request_failed_open_counts_once(counters: dict[str, int]) -> None:
    assert _fail_open(_Envoy(counters)) == 3  # type: ignore[arg-type]
