"""`python -m bench.dataplane`'s command line."""

from __future__ import annotations

import pytest

from bench.dataplane import cli
from bench.dataplane.workload import Plan


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[Plan]:
    """The plans the bench would run; none runs (stopped as by Ctrl-C before any process)."""
    seen: list[Plan] = []

    def run(plan: Plan, quick: bool, force_python_load: bool) -> None:
        seen.append(plan)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", run)
    return seen


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_connections_below_one_are_refused(
    value: str, plans: list[Plan], capsys: pytest.CaptureFixture,
) -> None:
    """Before: 0 silently ran the default 32, and -3 ran a load generator that sent nothing (0
    req/s and NaN latencies, written to the docs with --write-docs)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--quick", "--connections", value])
    assert exit_.value.code == 2
    assert "--connections" in capsys.readouterr().err
    assert not plans


def test_connections_given_are_used(plans: list[Plan]) -> None:
    assert cli.main(["--quick", "--connections", "1"]) == 130
    assert plans[0].connections == 1
