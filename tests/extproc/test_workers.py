"""The supervisor's port plan (`extproc.workers.worker_ports`) and limits, without processes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from extproc.workers import Supervisor, worker_ports


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


def test_the_supervisor_takes_explained_requests_as_large_as_its_workers_do(
        tmp_path: Path) -> None:
    # A fixed 128 MiB cap refused what a worker of a 100 MiB body limit takes (2 x + 64 KiB).
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({
        "regions": {"a": {}}, "limits": {"max_body_bytes": 100 << 20},
        "replicas": [{"name": "r0", "region": "a", "engine": "sglang",
                      "address": "10.0.0.1:8000"}]}))
    args = argparse.Namespace(fleet=str(fleet), port=0, metrics_port=0)
    assert Supervisor(args, 2, "token").explain_max_bytes == 2 * (100 << 20) + 65536


def test_every_worker_is_told_the_fleet_envoy_was_rendered_from(tmp_path: Path) -> None:
    # A restarted worker took its file's default as Envoy's: edited since, it let the clusters
    # file drop the cluster Envoy's routes still name.
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({
        "regions": {"a": {}}, "default_cluster": "r1",
        "replicas": [{"name": f"r{k}", "region": "a", "engine": "sglang",
                      "address": f"10.0.0.{k + 1}:8000"} for k in range(2)]}))
    args = argparse.Namespace(fleet=str(fleet), port=0, metrics_port=0, host="127.0.0.1",
                              log_level="INFO", drain_s=1.0, cds_file=str(tmp_path / "cds.yaml"),
                              otlp=None, envoy_admin=None)
    start = fleet.read_text()
    sup = Supervisor(args, 2, "token")
    fleet.write_text(start.replace("default_cluster: r1", "default_cluster: r0"))
    for w in sup.workers:
        w.runs = 2  # started again, after the edit: told the document of the start on stdin
        assert "--rendered-fleet-stdin" in sup._command(w)
    assert sup.rendered == start


def test_the_counts_of_worker_processes_restarts_replaced_are_kept_in_one_entry(
        tmp_path: Path) -> None:
    # The tuner's census waits for every decision a version made; a restarted worker counts from
    # 0 again. Kept per process, a worker crash-looping under one version grew the answer (and
    # the tuner's table) by one entry a restart: 5,000 entries after 5,000 restarts.
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({
        "regions": {"a": {}}, "replicas": [{"name": "r0", "region": "a", "engine": "sglang",
                                            "address": "10.0.0.1:8000"}]}))
    sup = Supervisor(argparse.Namespace(fleet=str(fleet), port=0, metrics_port=0), 2, "token")
    w0, w1 = sup.workers
    sup.heard_routed(w0, {"router": "a0", "routed": {"7": {"gorgo": 3}}})
    sup.heard_routed(w1, {"router": "b0", "routed": {"7": {"gorgo": 5}}})
    sup.heard_routed(w0, {"router": "a0", "routed": {"7": {"gorgo": 4}}})
    assert sup.routed_by == {"a0": {"7": {"gorgo": 4}}, "b0": {"7": {"gorgo": 5}}}
    for n in range(1, 1001):  # worker 0 restarted 1,000 times, each run routing 2
        sup.heard_routed(w0, {"router": f"a{n}", "routed": {"7": {"gorgo": 2}}})
    assert sup.routed_by == {"retired": {"7": {"gorgo": 4 + 999 * 2}},
                             "a1000": {"7": {"gorgo": 2}}, "b0": {"7": {"gorgo": 5}}}
    # an answer without an id is counted under its worker's index
    sup.heard_routed(w1, {"routed": {"8": {"gorgo": 1}}})
    assert sup.routed_by["worker-1"] == {"8": {"gorgo": 1}}
    assert sup.routed_by["retired"]["7"] == {"gorgo": 4 + 999 * 2 + 5}
