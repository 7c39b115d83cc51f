"""``backtest-series`` on the Numenta Anomaly Benchmark (NAB), beside a rolling z-score.

    python -m bench.nab --data /tmp/nab/data --labels /tmp/nab/labels/combined_windows.json

Every file under ``--data`` (NAB's layout: ``<category>/<name>.csv``, columns ``timestamp``
and ``value``) that ``--labels`` (NAB's ``labels/combined_windows.json``) lists is read and
scored the way ``servewatch backtest-series --in FILE`` scores it (the same reader and
``score_series``, in process rather than one subprocess per file), and its ``is_anomaly``
column is taken as the detections: no threshold is tuned, which is how an operator meets
servewatch. Beside it, two references through the same scorer:

* ``load model``: the load-conditioned latency model that judged series without load
  columns before the generic series model existed (the detector ``--model load`` selects);
* ``z-score``: a rolling z-score with a fixed rule, point by point and without any incident
  lifecycle: a point is a detection when it lies more than ``--z`` standard deviations from
  the mean of the ``--window`` points before it (both sides; no look-ahead);
* ``z + lifecycle``: the same points through servewatch's incident lifecycle (2 anomalous
  of 3 fire; a detection where an incident fires), the decision rule servewatch pages by.

The score is NAB's standard profile, implemented here from NAB's published description
(its code is AGPL and none of it is here): each labelled window scores its first detection
by a scaled sigmoid of where it falls (1 at the window's start, 0 at its end), or -1
(``A_FN``) when nothing in it was detected; every detection outside windows costs 0.11
(``A_FP``) times a sigmoid that is smaller just after a window ends; the first 15 % of a file
(at most 750 rows) is probation and counts for nothing. Raw scores are summed over files and
normalised between the null detector (nothing detected: -1 per window) and a perfect one
(each window at its first scored row): ``100 * (raw - null) / (perfect - null)``. Printed
per category and over all files read, with the windows detected and detections outside
windows. The data is NAB's and stays outside this repository: fetch it yourself.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from servewatch.models.detect.backtest_series import score_series
from servewatch.models.detect.lifecycle import Transition
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.pipeline.cli.backtest import _read_series, _series_timestamp, judged_by_load
from servewatch.schemas.anomaly import Signal

#: NAB's standard application profile: weights of a true positive, a false positive and a
#: false negative (the false positive's weight multiplies a sigmoid that is negative).
A_TP, A_FP, A_FN = 1.0, 0.11, 1.0
PROBATION = 0.15
PROBATION_CAP_ROWS = 5000  # probation is at most 15 % of this many rows


def scaled_sigmoid(position: float) -> float:
    """NAB's weight of a detection at ``position`` relative to a window: -1 is the window's
    start (0.987), 0 its end (0), positive values lie past it (down to -1, from 3 on)."""
    if position >= 3.0:
        return -1.0
    return 2.0 / (1.0 + math.exp(5.0 * position)) - 1.0


@dataclass
class FileScore:
    raw: float = 0.0
    null: float = 0.0
    perfect: float = 0.0
    windows: int = 0
    detected: int = 0  # windows with a detection
    false_positives: int = 0  # detections outside windows (after probation)

    def add(self, other: FileScore) -> None:
        self.raw += other.raw
        self.null += other.null
        self.perfect += other.perfect
        self.windows += other.windows
        self.detected += other.detected
        self.false_positives += other.false_positives

    @property
    def normalised(self) -> float:
        span = self.perfect - self.null
        return 100.0 * (self.raw - self.null) / span if span > 0 else 0.0


def nab_score(
    timestamps: Sequence[float], detections: Sequence[bool], windows: Sequence[tuple[float, float]]
) -> FileScore:
    """One file's standard-profile score: ``detections[i]`` is whether row ``i`` (at
    ``timestamps[i]``, sorted) was flagged; ``windows`` are the labelled (start, end), inclusive.

    >>> ts = list(range(100))
    >>> hit = nab_score(ts, [i == 60 for i in ts], [(60, 69)])       # at the window's first row
    >>> round(hit.raw, 3), hit.null, hit.perfect, round(hit.normalised, 1)
    (1.0, -1.0, 1.0, 100.0)
    >>> late = nab_score(ts, [i == 65 for i in ts], [(60, 69)])      # halfway in: less
    >>> 0.5 < late.raw < 0.9
    True
    >>> early = nab_score(ts, [i in (20, 69) for i in ts], [(60, 69)])   # a false positive (-0.11), a last-row hit
    >>> round(early.raw, 3), early.false_positives
    (0.138, 1)
    """
    n = len(timestamps)
    probation = min(math.floor(PROBATION * n), PROBATION * PROBATION_CAP_ROWS)
    score = FileScore()
    # Rows of each window: the first and last row inside its bounds (NAB's window indices).
    spans = []
    for start, end in windows:
        inside = [i for i, t in enumerate(timestamps) if start <= t <= end]
        if inside:
            spans.append((inside[0], inside[-1]))
    max_tp = scaled_sigmoid(-1.0)
    span_at = 0
    previous: tuple[int, int] | None = None
    best: dict[int, float] = {}
    scored_windows: set[int] = set()
    for i in range(n):
        while span_at < len(spans) and spans[span_at][1] < i:
            previous, span_at = spans[span_at], span_at + 1
        within = span_at < len(spans) and spans[span_at][0] <= i
        if i < probation:
            continue
        if within:
            left, right = spans[span_at]
            scored_windows.add(span_at)
            if detections[i] and span_at not in best:  # the first detection is the best one
                best[span_at] = scaled_sigmoid(-(right - i + 1) / (right - left + 1)) * A_TP / max_tp
        elif detections[i]:
            if previous is None:
                position = 3.0
            else:
                left, right = previous
                position = abs(right - i) / max(right - left, 1)
            score.raw += scaled_sigmoid(position) * A_FP
            score.false_positives += 1
    for w in scored_windows:
        left, right = spans[w]
        first = max(left, math.ceil(probation))  # where a perfect detector flags it
        score.perfect += scaled_sigmoid(-(right - first + 1) / (right - left + 1)) * A_TP / max_tp
        score.raw += best.get(w, -A_FN)
    score.windows = len(scored_windows)
    score.detected = len(best)
    score.null = -A_FN * score.windows
    return score


def zscore_detections(values: Sequence[float], window: int = 60, z: float = 3.0) -> list[bool]:
    """A point more than ``z`` standard deviations from the mean of the ``window`` points
    before it (no look-ahead; the first ``window`` points are never flagged). A flat window
    flags any point that differs from it (an infinite z, as numpy would compute it)."""
    out = [False] * len(values)
    for i in range(window, len(values)):
        recent = values[i - window : i]
        mean, sd = statistics.fmean(recent), statistics.pstdev(recent)
        out[i] = abs(values[i] - mean) > z * sd if sd > 0 else values[i] != mean
    return out


def through_lifecycle(anomalous: Sequence[bool]) -> list[bool]:
    """Point verdicts through servewatch's incident lifecycle (2 anomalous of 3 fire, 3 normal
    resolve; ``DetectorConfig``'s defaults): a detection where an incident fires, as
    ``backtest-series`` marks its pages."""
    tracker = DetectorConfig().tracker()
    return [tracker.step(a, window_start=float(i)) is Transition.FIRING for i, a in enumerate(anomalous)]


def servewatch_detections(points: list[dict[str, float]], model: Literal["load", "series"] | None = None) -> list[bool]:
    """``is_anomaly`` of ``backtest-series`` with its defaults (TTFT, threshold 4, 6 grace
    points); ``model`` as ``score_series`` takes it, or (None) as the command chooses it."""
    if model is None:
        model = "load" if judged_by_load(points) else "series"
    return [p.is_anomaly for p in score_series(points, Signal.TTFT, model=model)]


DETECTORS: dict[str, Callable[[list[dict[str, float]], argparse.Namespace], list[bool]]] = {
    "servewatch": lambda points, _: servewatch_detections(points),
    "load model": lambda points, _: servewatch_detections(points, model="load"),
    "z-score": lambda points, args: zscore_detections([p["value"] for p in points], args.window, args.z),
    "z + lifecycle": lambda points, args: through_lifecycle(
        zscore_detections([p["value"] for p in points], args.window, args.z)
    ),
}


def run(data: Path, labels: dict[str, list[list[str]]], args: argparse.Namespace) -> dict[str, dict[str, FileScore]]:
    """Scores per category (and ``all``) and detector, over the labelled files found."""
    totals: dict[str, dict[str, FileScore]] = {}
    for key in sorted(labels):
        path = data / key
        if not path.is_file():
            continue
        points = list(_read_series(str(path)))
        points.sort(key=lambda p: p["timestamp"])  # as backtest-series does
        timestamps = [p["timestamp"] for p in points]
        windows = [(_series_timestamp(a), _series_timestamp(b)) for a, b in labels[key]]
        category = key.split("/")[0]
        for name, detect in DETECTORS.items():
            score = nab_score(timestamps, detect(points, args), windows)
            if args.files:
                print(f"  {key:<60} {name:<14} {score.normalised:>7.1f}  {score.detected}/{score.windows} windows, "
                      f"{score.false_positives} outside")  # fmt: skip
            for group in (category, "all"):
                totals.setdefault(group, {}).setdefault(name, FileScore()).add(score)
        totals.setdefault(category, {}).setdefault("_files", FileScore()).windows += 1
        totals.setdefault("all", {}).setdefault("_files", FileScore()).windows += 1
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--data", type=Path, required=True, help="NAB's data/ folder (<category>/<file>.csv)")
    parser.add_argument("--labels", type=Path, required=True, help="NAB's labels/combined_windows.json")
    parser.add_argument("--window", type=int, default=60, help="rolling z-score: points before each one")
    parser.add_argument("--z", type=float, default=3.0, help="rolling z-score: |z| that is a detection")
    parser.add_argument("--files", action="store_true", help="also print each file's scores")
    args = parser.parse_args(argv)
    labels = json.loads(args.labels.read_text())
    missing = [key for key in sorted(labels) if not (args.data / key).is_file()]
    totals = run(args.data, labels, args)
    if not totals:
        print(f"no labelled file found under {args.data}", file=sys.stderr)
        return 2
    names = list(DETECTORS)
    print(f"NAB standard profile (A_TP=1, A_FP=-0.11, A_FN=-1; probation 15 %); z-score: window {args.window}, "
          f"|z| > {args.z}, point detections, no lifecycle")  # fmt: skip
    header = f"{'category':<24}{'files':>6}{'windows':>8}" + "".join(f"{n:>14}" for n in names)
    print(header + "   windows detected / detections outside windows")
    for group in [*sorted(g for g in totals if g != "all"), "all"]:
        scores = totals[group]
        first = scores[names[0]]
        row = f"{group:<24}{scores['_files'].windows:>6}{first.windows:>8}"
        row += "".join(f"{scores[n].normalised:>14.1f}" for n in names)
        row += "   " + ", ".join(f"{scores[n].detected}/{scores[n].false_positives}" for n in names)
        print(row)
    if missing:
        print(f"{len(missing)} labelled files not under {args.data} (not scored)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
