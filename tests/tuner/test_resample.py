import numpy as np

from tuner.resample import block_indices


def test_a_window_no_longer_than_a_block_is_still_resampled() -> None:
    """A window of 5 requests with 8-request blocks was one block: every resample a rotation of
    the window, so its p95 never varied and A/A candidates were accepted 47 % of the time."""
    values = np.arange(5.0)
    rows = block_indices(values.size, 8, 500, np.random.default_rng(0))
    p95 = np.quantile(values[rows], 0.95, axis=1)
    assert rows.shape == (500, 5) and p95.std() > 0.1


def test_a_long_window_keeps_the_configured_block() -> None:
    rows = block_indices(40, 8, 50, np.random.default_rng(0))
    runs = np.diff(rows, axis=1) % 40 == 1  # consecutive arrivals
    assert runs[:, :7].all()  # the first block is 8 long
