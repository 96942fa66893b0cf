"""bench.memory_timeline's split of an RSS series into start-up and the steady sawtooth of the trims."""

from __future__ import annotations

import pytest

from bench.memory_timeline import teeth

pytestmark = pytest.mark.timeout(30)


def _sawtooth(start: float, end: float, low: float, rise_per_s: float, period: float) -> list[tuple[float, float]]:
    """Samples every 0.1 s of RSS that climbs from ``low`` and drops back at every multiple of ``period``."""
    per_period = round(period * 10)
    return [(start + i / 10, low + rise_per_s * (i % per_period) / 10) for i in range(round((end - start) * 10))]


def test_a_start_up_transient_shows_above_the_steady_tops() -> None:
    samples = [(0.5, 200.0), (1.0, 1500.0), (2.0, 900.0)] + _sawtooth(3.0, 30.0, 1000.0, 100.0, 3.0)
    th = teeth(samples, first_update_s=0.8, window_s=3.0)
    assert th.peak == 1500.0 and th.peak_s == 1.0
    assert th.startup_top == 1500.0
    assert max(th.tops) == pytest.approx(1290.0, abs=1.0)  # 1000 + 100 MB/s x 2.9 s
    assert th.transient == pytest.approx(210.0, abs=1.0)
    assert min(th.lows) == pytest.approx(1000.0, abs=1.0)  # every window holds a trim's low


def test_a_steady_peak_is_not_a_transient_and_samples_after_the_stop_are_left_out() -> None:
    samples = [(0.5, 300.0)] + _sawtooth(1.0, 20.0, 1000.0, 100.0, 3.0) + [(20.5, 5000.0)]
    th = teeth(samples, first_update_s=1.0, window_s=3.0, until_s=20.0)
    assert th.peak == pytest.approx(1290.0, abs=1.0)
    assert th.peak_s == pytest.approx(3.9)  # the first tooth's top, the same as every later one's
    assert th.transient == pytest.approx(0.0, abs=1e-6)
    assert len(th.tops) == len(th.lows) == 6  # windows from 4 s to 20 s


def test_no_steady_window_or_no_sample_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="run it for longer"):
        teeth([(1.0, 100.0), (2.0, 120.0)], first_update_s=1.0, window_s=3.0)
    with pytest.raises(ValueError, match="no RSS sample"):
        teeth([(30.0, 100.0)], first_update_s=1.0, window_s=3.0, until_s=10.0)
    with pytest.raises(ValueError, match="window_s"):
        teeth([(1.0, 100.0)], first_update_s=1.0, window_s=0.0)
