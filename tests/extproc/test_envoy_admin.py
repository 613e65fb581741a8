"""With the response headers skipped, the router learns each replica's failures from Envoy's
admin API (`/clusters?format=json`): unit checks on Envoy's own JSON shape, then real Envoy."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.envoy_admin import EnvoyOutcomes
from gorgo.core.contract import DECISION_HEADER, REPLICA_HEADER
from gorgo.core.fleet import parse_fleet
from gorgo.core.router import Router
from gorgo.harness.procs import wait_for
from tests.support.e2e import GorgoMetrics, Stack, chat, post, start_stack, stop_stack

FLEET = {
    "regions": {"a": {}},
    "replicas": [{"name": f"r{i}", "region": "a", "address": f"127.0.0.1:{20000 + i}",
                  "engine": "sglang"} for i in range(2)],
    "extproc": {"response_headers": "skip"},
}


def _host(port: int, errors: int, ok: int, ejected: bool = False) -> dict:
    """One host as Envoy 1.40 writes it: counters as strings, a zero counter without value."""
    stats = [{"name": "cx_total", "value": "1"}, {"name": "rq_error", "value": str(errors)},
             {"name": "rq_success", "value": str(ok)}]
    health = {"eds_health_status": "HEALTHY", **({"failed_outlier_check": True} if ejected else {})}
    return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "stats": [s for s in stats if s["value"] != "0"] + [{"name": "rq_timeout"}],
            "health_status": health}


def _clusters(*clusters: tuple[str, list[dict]]) -> dict:
    return {"cluster_statuses": [{"name": n, "host_statuses": h} for n, h in clusters]}


def _outcomes() -> tuple[Router, EnvoyOutcomes]:
    router = Router(parse_fleet(FLEET))
    return router, EnvoyOutcomes(router, "127.0.0.1:9901", clock=lambda: 100.0)


def test_new_errors_penalise_and_eject_like_failed_responses() -> None:
    router, out = _outcomes()
    s = router.state
    out.apply(_clusters(("r0", [_host(20000, 40, 100)]), ("r1", [_host(20001, 0, 7)])), 100.0)
    assert s.failures.tolist() == [0, 0] and not s.penalty_ms.any()  # the first poll: baseline
    out.apply(_clusters(("r0", [_host(20000, 43, 100)]), ("r1", [_host(20001, 0, 9)])), 100.0)
    assert not s.healthy[0] and s.healthy[1]  # three new 5xx: ejected, as the router would
    assert s.penalty_ms[0] >= 3 * router.spec.penalties.error_ms > 0 == s.penalty_ms[1]


def test_shared_clusters_count_by_address_and_a_restarted_envoy_is_a_new_baseline() -> None:
    router, out = _outcomes()
    s = router.state
    # The retries' fleet cluster holds every replica: each host is its replica by address.
    out.apply(_clusters(("gorgo_fleet", [_host(20000, 5, 5), _host(20001, 0, 5)])), 100.0)
    out.apply(_clusters(("gorgo_fleet", [_host(20000, 6, 5), _host(20001, 0, 6)])), 100.0)
    assert s.failures.tolist() == [1, 0]
    out.apply(_clusters(("gorgo_fleet", [_host(20000, 0, 1), _host(20001, 0, 1)])), 100.0)
    assert s.failures.tolist() == [1, 0]  # counters went back: nothing new, a new baseline
    out.apply(_clusters(("gorgo_fleet", [_host(20000, 0, 3), _host(20001, 0, 1)])), 100.0)
    assert s.failures.tolist() == [0, 0]  # answered without error since: a success, as a 2xx


def test_after_a_reload_errors_go_to_the_replica_that_had_them() -> None:
    """The maps were built once: a reordered fleet charged r0's errors to r2, a shrunk one
    raised IndexError at every poll, an added replica's errors went nowhere."""
    doc = {**FLEET, "replicas": [*FLEET["replicas"], {
        "name": "r2", "region": "a", "address": "127.0.0.1:20002", "engine": "sglang"}]}
    router = Router(parse_fleet(doc))
    out = EnvoyOutcomes(router, "127.0.0.1:9901", clock=lambda: 100.0)
    hosts = [("r0", [_host(20000, 0, 5)]), ("r1", [_host(20001, 0, 5)]),
             ("r2", [_host(20002, 0, 5)])]
    out.apply(_clusters(*hosts), 100.0)
    router.reload(parse_fleet({**doc, "replicas": doc["replicas"][::-1]}))  # r2, r1, r0
    hosts[0] = ("r0", [_host(20000, 3, 5)])
    out.apply(_clusters(*hosts), 100.0)
    s = router.state
    assert s.names == ["r2", "r1", "r0"] and s.failures.tolist() == [0, 0, 3]
    router.reload(parse_fleet({**doc, "replicas": doc["replicas"][2:]}))  # r2 alone
    hosts[2] = ("r2", [_host(20002, 1, 5)])
    out.apply(_clusters(*hosts), 100.0)
    assert router.state.names == ["r2"] and router.state.failures.tolist() == [1]


def test_an_ejection_by_envoy_counts_once() -> None:
    router, out = _outcomes()
    s = router.state
    out.apply(_clusters(("r1", [_host(20001, 9, 0)])), 100.0)
    for _ in range(3):
        out.apply(_clusters(("r1", [_host(20001, 9, 0, ejected=True)])), 100.0)
    assert s.failures.tolist() == [0, 1]


@pytest.mark.parametrize("answer", [
    [], None, "x", {"cluster_statuses": {"r0": 1}}, {"cluster_statuses": [None, 3, "r0"]},
    {"cluster_statuses": [{"name": ["r0"], "host_statuses": []}]},
    _clusters(("r0", [{"address": None}])), _clusters(("r0", [None, 7])),
    _clusters(("gorgo_fleet", [{"address": {"socket_address": {"address": ["h"],
                                                               "port_value": {}}}}])),
    _clusters(("r0", [{**_host(20000, 1, 1), "stats": [{"name": "rq_error", "value": None}]}])),
    _clusters(("r0", [{**_host(20000, 1, 1), "stats": [{"name": "rq_error", "value": "-4"}]}])),
    _clusters(("r0", [{**_host(20000, 1, 1), "health_status": "bad"}])),
])
def test_an_answer_of_another_shape_is_skipped_and_the_next_one_applies(answer: object) -> None:
    router, out = _outcomes()
    s = router.state
    out.apply(_clusters(("r0", [_host(20000, 0, 1)])), 100.0)
    out.apply(answer, 100.0)  # type: ignore[arg-type]  # raised and ended the poller before
    out.apply(_clusters(("r0", [_host(20000, 3, 1)])), 100.0)
    assert not s.healthy[0] and s.failures[0] == 3


def test_a_counter_that_jumps_by_billions_is_applied_bounded() -> None:
    router, out = _outcomes()
    out.apply(_clusters(("r0", [_host(20000, 0, 1)])), 100.0)
    out.apply(_clusters(("r0", [_host(20000, 10**19, 1)])), 100.0)  # returns, not a 1e19 loop
    assert not router.state.healthy[0]


def test_the_poller_outlives_any_failure_and_warns_once_per_kind(
        caplog: pytest.LogCaptureFixture) -> None:
    fleet = {**FLEET, "signals": {"scrape_interval_s": 0.001}}
    router = Router(parse_fleet(fleet))
    out = EnvoyOutcomes(router, "127.0.0.1:9901")
    answers = iter([AttributeError("odd"), AttributeError("odd"), OSError("refused"), None])

    async def poll() -> None:
        answer = next(answers)
        if answer is not None:
            raise answer
        out.polls += 1

    out.poll = poll  # type: ignore[method-assign]

    async def go() -> None:
        task = asyncio.create_task(out._run())
        while out.polls == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level("WARNING", logger="gorgo.envoy_admin"):
        asyncio.run(go())
    assert out.failed_polls == 3 and out.polls == 1
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and "AttributeError: odd" in warned[0], warned


@pytest.fixture(scope="module")
def skip_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    st = start_stack(tmp_path_factory.mktemp("skip"), n=2,
                     extproc={"response_headers": "skip"})
    yield st
    stop_stack(st)


@pytest.mark.envoy
def test_skip_mode_tags_responses_and_the_router_learns_5xx_from_envoy(
        skip_stack: Stack) -> None:
    st = skip_stack
    status, headers, _, _ = st.post(chat("tagged by Envoy"))
    assert status == 200
    assert headers[REPLICA_HEADER] == headers["x-served-by"] and headers[DECISION_HEADER]
    st.upstreams[0].failing = True
    rr = {"x-gorgo-policy": "round-robin"}

    async def burst() -> list[int]:
        answers = await asyncio.gather(*(post(st.url + "/v1/chat/completions",
                                              chat(f"q{k}", stream=False), rr)
                                         for k in range(8)))
        return [a[0] for a in answers]

    statuses = st.lt.run(burst())
    assert 500 in statuses and 200 in statuses  # round robin sent some to the failing one
    penalty = lambda: GorgoMetrics(st).values("gorgo_penalty_seconds")  # noqa: E731
    # No response headers reach the router: only Envoy's counters can tell it, within a poll.
    assert wait_for(lambda: any(v > 0 for k, v in penalty().items() if 'replica="r0"' in k), 10)
    assert all(v == 0 for k, v in penalty().items() if 'replica="r1"' in k)
    st.upstreams[0].failing = False


def test_skip_without_envoy_admin_is_a_user_error(tmp_path: Path) -> None:
    import yaml

    from gorgo.cli import main
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    assert main(["extproc", "--fleet", str(fleet), "--port", "0", "--metrics-port", "-1"]) == 2


def test_envoy_admin_without_skip_is_a_user_error(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    # Without the skip the router reads each answer's status: the poller counted them again.
    import yaml

    from gorgo.cli import main
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({k: v for k, v in FLEET.items() if k != "extproc"}))
    assert main(["extproc", "--fleet", str(fleet), "--port", "0", "--metrics-port", "-1",
                 "--envoy-admin", "127.0.0.1:9901"]) == 2
    assert "drop --envoy-admin" in capsys.readouterr().err
