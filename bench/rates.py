"""Rates judged with sequential evidence: windows to page against requests per window.

    python -m bench.rates [--runs 40]

A segment's error rate (any rate signal: truncation, leaks, errors are judged alike) at a
usual 0.2 %, with overdispersion (the rate itself wanders from window to window: a Beta of
strength 2,000 around it), then a fault at 5 % (and at 1 % where windows hold 1,000
requests) for 60 windows, then the usual rate again. Each window goes through one signal's
detector and the incident lifecycle, as a segment's windows do (``SignalDetector``: judge,
learn what it may; ``IncidentTracker``: 2 anomalous windows of 3 fire).

Printed per volume: the median windows from the fault's first window to the end of the
window that fired (1: that very window), how many runs fired within 3 windows, how many
stayed firing to the fault's end and then resolved once; beside them the information bound
(Lorden): no test whose false alarms come at most once in ``e^h`` windows can find the
change sooner, on average, than ``h`` over the Kullback-Leibler divergence of one window
at the raised rate from one at the usual. ``h`` is the CUSUM's threshold in nats (the
surprise threshold of 4 plus the log10(2) two looks cost, times ln 10); an incident fires
on the CUSUM's first crossing (its evidence spans windows already), or on 2 windows of 3
anomalous alone, and in either case only once the evidence holds a handful of bad requests
(``MIN_BAD_TO_PAGE``; a crossing at these volumes holds that many already, so the delays
are the CUSUM's). Last, a simulated day of the usual rate alone
per volume: incidents (none is the promise).
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass

import numpy as np

from servewatch.models.detect.lifecycle import Transition
from servewatch.models.detect.signal_detector import DetectorConfig, SignalDetector
from servewatch.models.detect.signals import BY_SIGNAL, Reading
from servewatch.schemas.anomaly import Signal

USUAL = 0.002
#: How much the usual rate wanders from window to window: a Beta of this strength around it.
WANDER_STRENGTH = 2_000.0
WARMUP = 360  # an hour of 10 s windows
FAULT = 60
AFTER = 120
DAY = 8_640


@dataclass
class RateRun:
    fired_at: int | None  # window of the fault (0: its first) whose end fired the incident
    firing_to_end: bool  # the incident was open in every window from firing to the fault's end
    resolves: int  # resolved transitions after the fault
    firings: int  # firing transitions in all


def windows_of(rng: np.random.Generator, n: int, rates: np.ndarray) -> np.ndarray:
    """Bad requests per window of ``n`` at each window's rate, wandering as a Beta around it."""
    a, b = rates * WANDER_STRENGTH, (1.0 - rates) * WANDER_STRENGTH
    return rng.binomial(n, rng.beta(a, b))


def run_stream(
    n: int, bad: np.ndarray, signal: Signal = Signal.ERROR_RATE
) -> tuple[list[Transition | None], list[bool]]:
    """Each window through a fresh detector of rate ``signal`` and a tracker: transitions, and
    whether an incident was open after each window."""
    spec = BY_SIGNAL[signal]
    config = DetectorConfig()
    detector = SignalDetector(spec, spec.build(config.grace_windows))
    tracker = config.tracker()
    transitions: list[Transition | None] = []
    open_after: list[bool] = []
    for k in bad:
        reading = Reading(float(k) / n, n, {"trials": n, "seconds": 10.0}, bad=int(k))
        detector.tracker = tracker
        verdict = detector.judge(reading, config)
        detector.learn_if_normal(reading, verdict)
        step = tracker.step(verdict.pages, window_start=float(len(transitions)), severity="warning",
                            sustained=verdict.sustained)  # fmt: skip
        transitions.append(step)
        open_after.append(tracker.firing)
    return transitions, open_after


def fault_run(n: int, fault_rate: float, seed: int, signal: Signal = Signal.ERROR_RATE) -> RateRun:
    rng = np.random.default_rng(seed)
    rates = np.full(WARMUP + FAULT + AFTER, USUAL)
    rates[WARMUP : WARMUP + FAULT] = fault_rate
    transitions, open_after = run_stream(n, windows_of(rng, n, rates), signal)
    fired = [i for i, t in enumerate(transitions) if t is Transition.FIRING]
    during = [i - WARMUP for i in fired if WARMUP <= i < WARMUP + FAULT]
    first = during[0] if during else None
    to_end = first is not None and all(open_after[WARMUP + first : WARMUP + FAULT])
    resolves = sum(1 for t in transitions[WARMUP + FAULT :] if t is Transition.RESOLVED)
    return RateRun(None if first is None else first + 1, to_end, resolves, len(fired))


def null_day(n: int, seed: int, signal: Signal = Signal.ERROR_RATE) -> int:
    rng = np.random.default_rng(seed)
    transitions, _ = run_stream(n, windows_of(rng, n, np.full(WARMUP + DAY, USUAL)), signal)
    return sum(1 for t in transitions[WARMUP:] if t is Transition.FIRING)


def kl_per_window(n: int, p1: float, p0: float) -> float:
    return n * (p1 * math.log(p1 / p0) + (1 - p1) * math.log((1 - p1) / (1 - p0)))


def bound_windows(n: int, p1: float, p0: float, threshold: float = DetectorConfig().threshold) -> float:
    """Lorden's bound on the mean delay, in windows, for the CUSUM's threshold (at least the
    window that fires)."""
    h = (threshold + math.log10(2.0)) * math.log(10.0)
    return max(h / kl_per_window(n, p1, p0), 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40, help="fault runs per volume (and null days: a quarter)")
    args = parser.parse_args()
    cases = [(5, 0.05), (20, 0.05), (100, 0.05), (1000, 0.05), (1000, 0.01)]
    print(f"usual rate {USUAL:.1%} (wandering: Beta strength {WANDER_STRENGTH:,.0f}); fault for {FAULT} windows")
    print(f"{'requests/window':>15} {'fault':>6} {'median windows':>15} {'bound':>6} {'within 3':>9} "
          f"{'firing to end':>14} {'resolved once':>14} {'null incidents/day':>19}")  # fmt: skip
    for n, fault in cases:
        runs = [fault_run(n, fault, seed) for seed in range(args.runs)]
        delays = [r.fired_at for r in runs if r.fired_at is not None]
        median = f"{statistics.median(delays):.1f}" if delays else "never"
        within = sum(1 for d in delays if d <= 3)
        to_end = sum(r.firing_to_end for r in runs)
        once = sum(r.resolves == 1 and r.firings == 1 for r in runs)
        nulls = [null_day(n, 10_000 + seed) for seed in range(max(args.runs // 4, 1))]
        print(f"{n:>15,} {fault:>6.1%} {median:>15} {bound_windows(n, fault, USUAL):>6.1f} "
              f"{within:>5}/{args.runs:<3} {to_end:>10}/{args.runs:<3} {once:>10}/{args.runs:<3} "
              f"{statistics.mean(nulls):>19.2f}")  # fmt: skip
    print("windows: from the fault's first window to the end of the window that fired (1: that very window);")
    print("bound: Lorden's, the CUSUM's threshold over the KL divergence of a window (at least 1);")
    print("null: incidents in a simulated day of the usual rate alone (mean over runs).")


if __name__ == "__main__":
    main()
