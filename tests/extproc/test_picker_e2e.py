"""Endpoint-picker mode (Gateway API Inference Extension protocol) with real Envoy.

The router names the endpoint in `x-gateway-destination-endpoint` and in dynamic metadata
`envoy.lb`; Envoy's ORIGINAL_DST cluster connects straight to it. With the router gone, Envoy fails
open to the default cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gorgo.envoy_config import PICKER_CLUSTER
from tests.support.e2e import chat, start_stack, stop_stack

pytestmark = pytest.mark.envoy


@pytest.mark.slow
def test_picker_routes_to_the_picked_endpoint_and_fails_open(tmp_path: Path) -> None:
    st = start_stack(tmp_path, n=3, endpoint_picker=True)
    try:
        served = []
        for k in range(6):
            status, headers, _, _ = st.post(chat(f"picker {k} " * 40),
                                            {"x-gorgo-policy": "round-robin"})
            assert status == 200
            assert headers["x-served-by"] == headers["x-gorgo-replica"]
            served.append(headers["x-served-by"])
        assert set(served) == {"r0", "r1", "r2"}
        stats = st.envoy.stats(f"cluster.{PICKER_CLUSTER}.upstream_rq_completed")
        assert stats.get(f"cluster.{PICKER_CLUSTER}.upstream_rq_completed", 0) >= 6
        # A client cannot pick the endpoint itself: the header is stripped before ext_proc.
        st.extproc.kill()
        for _ in range(3):
            status, headers, _, _ = st.post(
                chat("after the router died"),
                {"x-gateway-destination-endpoint": f"127.0.0.1:{st.upstreams[2].port}"})
            assert status == 200 and headers["x-served-by"] == "r0"
    finally:
        stop_stack(st)
