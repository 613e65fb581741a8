"""The expected output length: a client's max_tokens read as the bound it is, against the output
the engines report."""

from __future__ import annotations

import math

import pytest

from gorgo.core.outputs import HALF_LIFE_REQS, MIN_REQS, OutputModel


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
