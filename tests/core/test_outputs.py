"""The expected output length: a client's max_tokens read as the bound it is, against the output
the engines report."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gorgo.core.outputs import (
    HALF_LIFE_REQS,
    MIN_REQS,
    FleetOutputs,
    OutputModel,
    output_groups,
)


def _model(typical: float, bounds: list[int], finished: int = 200) -> OutputModel:
    m = OutputModel()
    for b in bounds:
        m.sent(b)
    m.observe(typical * finished, finished)
    return m


def test_nothing_known_keeps_the_bound_and_no_estimate_without_one() -> None:
    m = OutputModel()
    assert m.expected(700) == 700.0
    assert m.expected(None) is None
    assert m.typical() is None
    m.observe(19 * 300.0, 19)  # under MIN_REQS finished
    assert m.typical() is None and m.expected(700) == 700.0


@pytest.mark.parametrize("bound", [1, 50, 300, 2000])
def test_bounds_that_are_the_lengths_are_taken_as_they_are(bound: int) -> None:
    # bounds of 100 and 500 alternately, and the engines generate exactly that (a trace's replay)
    m = _model(300.0, [100, 500] * 100)
    assert m.expected(bound) == float(bound)
    assert m.expected(0) == 0.0  # echo: a prompt's logprobs only


def test_one_generous_cap_is_priced_at_the_typical_output() -> None:
    # every client sends 4,096, the engines stop after 300 on average: 4,096 drowned every other
    # term of the cost
    m = _model(300.0, [4096] * 200)
    assert m.expected(4096) == pytest.approx(300.0)
    assert m.expected(100) == 100.0  # a smaller bound still bounds
    assert m.expected(None) == pytest.approx(300.0)


def test_caps_of_several_sizes_scale_the_large_ones() -> None:
    m = _model(300.0, [512, 4096] * 100)  # B = 2,304: r = 300 / 2,304
    r = 300.0 / 2304.0
    assert m.expected(512) == pytest.approx(300.0)  # max(r * 512, 300)
    assert m.expected(4096) == pytest.approx(r * 4096, rel=0.01)  # decayed: recent count more


def test_no_bounds_seen_keeps_a_bound_as_given() -> None:
    m = OutputModel()
    m.observe(300.0 * 100, 100)
    assert m.expected(None) == pytest.approx(300.0)
    assert m.expected(4096) == 4096.0  # under MIN_REQS bounds: nothing to compare it with
    for _ in range(int(MIN_REQS) + 2):  # decayed: a few more than MIN_REQS
        m.sent(4096)
    assert m.expected(4096) == pytest.approx(300.0)


def test_the_typical_output_follows_a_change_of_traffic() -> None:
    m = OutputModel()
    m.observe(100.0 * 1000, 1000)
    for _ in range(8):  # 8 half-lives of requests generating 500 each
        m.observe(500.0 * HALF_LIFE_REQS, HALF_LIFE_REQS)
    assert m.typical() == pytest.approx(500.0, rel=0.01)


@pytest.mark.parametrize("generated, finished", [(-5.0, 3.0), (5.0, -1.0), (math.nan, 2.0),
                                                 (0.0, 0.0)])
def test_increments_that_are_no_counts_teach_nothing(generated: float, finished: float) -> None:
    m = _model(300.0, [4096] * 50)
    before = (m.generated, m.finished)
    m.observe(generated, finished)
    assert (m.generated, m.finished) == before


def test_bounds_do_not_compare_when_many_requests_set_none() -> None:
    # Half the clients send an exact 1,000, half send nothing and stop after 100: L = 550 and
    # B = 1,000 read as caps, and the exact 1,000 was priced at 550.
    m = OutputModel()
    for _ in range(100):
        m.sent(1000)
        m.sent(None)
    m.observe(550.0 * 200, 200)
    assert m.expected(1000) == 1000.0
    assert m.expected(None) == pytest.approx(550.0)
    # a few requests without a bound among capped ones leave the comparison
    c = _model(300.0, [4096] * 200)
    for _ in range(10):
        c.sent(None)
    assert c.expected(4096) == pytest.approx(300.0)


# --- one estimate per model (FleetOutputs) -----------------------------------------------------


@pytest.mark.parametrize(("names", "groups"), [
    ([(), (), ()], [0, 0, 0]),  # no models listed: every replica serves everything
    ([("a",), ("a",), ("b",)], [0, 0, 1]),
    ([("b",), ("a",), ("b",)], [0, 1, 0]),
    ([("a", "alias"), ("a", "alias"), ("c",)], [0, 0, 1]),  # an alias is its model's name
    ([("a",), ("b",), ("b", "a"), ("c",)], [0, 0, 0, 1]),  # a replica serving two ties them
    ([], []),
])
def test_replicas_share_an_estimate_when_they_share_a_model(names: list, groups: list) -> None:
    assert output_groups(names).tolist() == groups


def _two_models() -> FleetOutputs:
    # "long" on replicas 0 and 2 answers 2,000 tokens; "short" on replica 1 answers 100, and
    # is asked three times as often
    o = FleetOutputs([("long",), ("short",), ("long",)])
    o.observe(0, 2000.0 * 50, 50)
    o.observe(2, 2000.0 * 50, 50)
    o.observe(1, 100.0 * 300, 300)
    for _ in range(100):
        o.sent(0, 4096)
        o.sent(1, 4096)
    return o


def test_each_model_is_priced_at_its_own_output() -> None:
    # one estimate for the fleet priced both at the mix, 575 tokens
    o = _two_models()
    np.testing.assert_allclose(o.typical(), [2000.0, 100.0, 2000.0])
    np.testing.assert_allclose(o.expected(None), [2000.0, 100.0, 2000.0])
    np.testing.assert_allclose(o.expected(4096), [2000.0, 100.0, 2000.0])  # one cap: L each
    np.testing.assert_allclose(o.typical_bound(), [4096.0] * 3)
    assert o.of(2) is o.of(0) and o.of(1) is not o.of(0)


def test_a_model_nothing_is_known_of_is_nan_beside_the_others() -> None:
    o = FleetOutputs([("a",), ("b",)])
    o.observe(0, 300.0 * 40, 40)
    typical = o.typical()
    assert typical[0] == pytest.approx(300.0) and math.isnan(typical[1])
    assert np.isnan(FleetOutputs([("a",), ("b",)]).expected(None)).all()
    # one estimate: one value, as before
    one = FleetOutputs([(), (), ()])
    assert one.expected(None) is None and one.expected(64) == 64.0
    one.observe(1, 300.0 * 40, 40)
    assert one.typical() == pytest.approx(300.0)
    assert FleetOutputs([]).expected(64) == 64.0  # no replica yet (discovery)


@pytest.mark.parametrize(("names", "typical"), [
    # "long" moved from replica 2 to a new replica: it keeps what it learned
    ([("long",), ("short",), ("long",)], [2000.0, 100.0, 2000.0]),
    ([("short",), ("short",), ("long",)], [100.0, 100.0, 2000.0]),  # a replica switched model
    ([("long",), ("short",), ("new",)], [2000.0, 100.0, math.nan]),  # a new model: fresh
    ([("short",)], [100.0]),  # "long" gone
])
def test_a_reload_keeps_each_models_estimate_by_its_name(names: list, typical: list) -> None:
    np.testing.assert_allclose(_two_models().reindexed(names).typical(), typical)


def test_a_reload_copies_and_merges_estimates() -> None:
    o = _two_models()
    new = o.reindexed([("long",), ("short",)])
    before = o.of(0).finished
    new.observe(0, 0.0, 1.0)  # a copy: the old state's estimates are left as they were
    assert o.of(0).finished == before
    # one replica now serves both: their sums
    merged = o.reindexed([("long", "short")])
    a, b = o.of(0), o.of(1)
    pooled = (a.generated + b.generated) / (a.finished + b.finished)
    assert merged.typical() == pytest.approx(pooled)
    assert 100.0 < merged.typical() < 2000.0
    # a fleet that lists no models, before or after, keeps what was learned whole (discovery
    # renames every replica of a rollout)
    assert o.reindexed([(), ()]).typical() == pytest.approx(pooled)
    one = FleetOutputs([()])
    one.observe(0, 300.0 * 40, 40)
    np.testing.assert_allclose(one.reindexed([("a",), ("b",)]).typical(), [300.0, 300.0])
    assert one.reindexed([(), ()]).typical() == pytest.approx(300.0)
    assert OutputModel.merged([]).typical() is None
