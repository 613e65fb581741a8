"""The supervisor's port plan (`extproc.workers.worker_ports`), without processes."""

from __future__ import annotations

import pytest

from extproc.workers import worker_ports


@pytest.mark.parametrize(("base", "n", "metrics", "ports"), [
    (50051, 2, 50052, [50051, 50053]),  # the defaults: worker 1 took the metrics port
    (50051, 3, 9000, [50051, 50052, 50053]),
    (50051, 1, 50051, [50052]),
    (0, 3, 50052, [0, 0, 0]),  # any free ports
    (50051, 2, -1, [50051, 50052]),  # no metrics endpoint
])
def test_workers_take_ports_from_base_past_the_metrics_port(base: int, n: int, metrics: int,
                                                             ports: list[int]) -> None:
    assert worker_ports(base, n, metrics) == ports
