"""Rates judged with sequential evidence, through one signal's detector and the
incident lifecycle (``bench/rates.py`` prints the whole delay-versus-volume table).

A usual rate of 0.2 % that wanders from window to window (overdispersion), a fault for 60
windows, then the usual rate again. Windows are 10 s, so 60 are ten minutes.
"""

from __future__ import annotations

import pytest

from bench.rates import bound_windows, fault_run, null_day
from servewatch.schemas.anomaly import Signal

RATE_SIGNALS = [Signal.ERROR_RATE, Signal.LENGTH_TRUNCATION]


@pytest.mark.parametrize("signal", RATE_SIGNALS)
@pytest.mark.parametrize(("requests", "fault", "within"), [(20, 0.05, 14), (1000, 0.01, 4)])
def test_a_low_volume_fault_pages_stays_open_to_its_end_and_resolves_once(
    signal: Signal, requests: int, fault: float, within: int
) -> None:
    # 5 % at 20 requests a window is one bad request a window: no window alone can page
    # against 0.2 %. The information bound for our false-alarm rate is ~4.3 windows on
    # average (``bound_windows``); the adaptive CUSUM takes ~8 (median over 40 runs).
    for seed in range(5):
        run = fault_run(requests, fault, seed, signal)
        assert run.fired_at is not None and run.fired_at <= within, (seed, run)
        assert run.firing_to_end and run.resolves == 1 and run.firings == 1, (seed, run)
    assert bound_windows(requests, fault, 0.002) < within


@pytest.mark.parametrize("requests", [20, 1000])
def test_an_overdispersed_usual_rate_pages_nothing_in_a_day(requests: int) -> None:
    assert [null_day(requests, seed) for seed in range(3)] == [0, 0, 0]
