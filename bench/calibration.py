"""Calibration of the latency model on null streams, and the hour-long ramp.

    python -m bench.calibration [--streams 20] [--windows 3000]

A surprise of 4 promises 1 anomalous window in 10,000 when nothing is wrong. Each null
stream is TTFT per window at flat demand around 0.5 s: noise of scale 0.1 in log space
(Gaussian or Student-t), optionally AR(1) from window to window and a slowly wandering
level, plus each window's sampling noise. The streams go through one signal's detector
(``SignalDetector``: judge, learn what it may, note what it may not), as a segment's windows
do. Printed: anomalous windows per judged window as a multiple of the promise, and
incidents (2 anomalous windows of 3) per simulated day. Then the ramp: two hours of normal
windows, then latency doubling over an hour at flat demand; printed, the window of the ramp
at which each stream's incident fired. ``tests/test_calibration.py`` asserts a subset.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from servewatch.models.detect.lifecycle import IncidentTracker
from servewatch.models.detect.signal_detector import DetectorConfig, SignalDetector
from servewatch.models.detect.signals import BY_SIGNAL, Reading
from servewatch.schemas.anomaly import Signal

FLAT = {"model_arrivals_per_s": 10.0, "model_arrival_prompt_tokens_per_s": 1e4, "sampling_var": 0.004}
PROMISE = 1e-4  # surprise 4
GRACE = 6
#: (name, Student-t degrees or None for Gaussian, AR(1) coefficient, sd of the level's wander)
NULLS = (
    ("gaussian, AR 0.5, wander", None, 0.5, 0.05),
    ("student-t(3)", 3.0, 0.0, 0.0),
    ("student-t(5), AR 0.5, wander", 5.0, 0.5, 0.05),
    ("student-t(4), AR 0.5, wander", 4.0, 0.5, 0.05),
    ("student-t(3), AR 0.5, wander", 3.0, 0.5, 0.05),
)


def null_stream(seed: int, n: int, nu: float | None, phi: float, wander_sd: float) -> np.ndarray:
    """TTFT (s) per window around 0.5 s: noise of scale 0.1 in log space (Student-t of ``nu``
    degrees, or Gaussian), AR(1) ``phi`` from window to window, a level wandering as an
    Ornstein-Uhlenbeck process (sd ``wander_sd``, half a thousand windows' memory), and each
    window's own sampling noise."""
    rng = np.random.default_rng(seed)
    eps = (rng.standard_t(nu, n) if nu else rng.standard_normal(n)) * 0.1
    ar, level = np.zeros(n), np.zeros(n)
    keep = math.exp(-1 / 500)
    for i in range(1, n):
        ar[i] = phi * ar[i - 1] + eps[i]
        level[i] = keep * level[i - 1] + rng.standard_normal() * wander_sd * math.sqrt(1 - keep * keep)
    return np.exp(math.log(0.5) + level + ar + rng.standard_normal(n) * math.sqrt(FLAT["sampling_var"]))


def judge_stream(values: np.ndarray) -> tuple[int, list[int]]:
    """(anomalous windows after the grace ones, windows at which an incident fired)."""
    spec = BY_SIGNAL[Signal.TTFT]
    config = DetectorConfig(grace_windows=GRACE)
    detector = SignalDetector(spec, spec.build(GRACE))
    tracker = IncidentTracker()
    anomalous, fired = 0, []
    for i, value in enumerate(values):
        reading = Reading(float(value), 50, FLAT)
        verdict = detector.judge(reading, config)
        anomalous += verdict.pages and i >= GRACE
        if tracker.step(verdict.pages, window_start=float(i), severity="warning") is not None and tracker.firing:
            fired.append(i)
        detector.tracker = tracker if tracker.firing else None
        if not verdict.learnable:
            detector.note_unlearned(reading, verdict)
        elif not verdict.pages:
            detector.learn(reading)
    return anomalous, fired


def ramp_stream(seed: int, nu: float | None, normal: int = 720, ramp: int = 360) -> np.ndarray:
    """``normal`` windows of a null stream, then latency rising by the same share every
    window until it has doubled ``ramp`` windows later."""
    values = null_stream(seed, normal + ramp, nu, 0.5, 0.0)
    values[normal:] *= np.exp(np.linspace(0.0, math.log(2.0), ramp))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--windows", type=int, default=3000)
    args = parser.parse_args()
    print(f"{'null stream':32} {'anomalous windows':>18} {'x the promise':>14} {'incidents/day':>14}")
    for name, nu, phi, wander in NULLS:
        anomalous = incidents = 0
        for seed in range(args.streams):
            a, fired = judge_stream(null_stream(seed, args.windows, nu, phi, wander))
            anomalous, incidents = anomalous + a, incidents + len(fired)
        judged = args.streams * (args.windows - GRACE)
        print(f"{name:32} {anomalous:>9} of {judged:<7,} {anomalous / judged / PROMISE:>13.1f}x "
              f"{incidents / judged * 8640:>14.2f}")  # fmt: skip
    print()
    for name, nu in (("gaussian", None), ("student-t(5), AR 0.5", 5.0)):
        fired = []
        for seed in range(10):
            windows = [i - 720 for i in judge_stream(ramp_stream(seed, nu))[1]]
            fired.append(next((w for w in windows if 0 <= w < 360), None))
        caught = sum(w is not None for w in fired)
        print(f"ramp, {name}: paged within the hour in {caught}/10 (window of the ramp: {fired})")


if __name__ == "__main__":
    main()
