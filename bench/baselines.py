"""Two naive TTFT detectors to measure servewatch against, on the same records.

- **Fixed p95 threshold:** one number for the fleet, as an alert rule on a dashboard would
  have it: the 99th percentile of every segment's window TTFT p95 over the warm-up.
- **Load-blind rolling z-score:** per segment, the window's log TTFT p95 against the mean
  and standard deviation of its previous 30 windows; anomalous above z = 3.

Both judge 10 s windows per segment (the worker's segments), need 5 timed requests in a
window, look only backwards, and use servewatch's default lifecycle (an incident fires
after 2 anomalous windows of 3 and resolves after 3 normal ones), so the comparison is of
what counts as anomalous, not of alert plumbing.
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewatch.models.windows.segments import Segmenter

WINDOW_S = 10.0
MIN_REQUESTS = 5
Series = dict[str, list[tuple[float, float]]]  # segment -> [(window start, TTFT p95)], in time order


def ttft_p95_series(records: Iterable[dict[str, Any]], segmenter: Segmenter, window_s: float = WINDOW_S) -> Series:
    """Each segment's TTFT p95 per window with at least ``MIN_REQUESTS`` timed requests."""
    ttfts: dict[tuple[str, float], list[float]] = defaultdict(list)
    for r in records:
        if r.get("ttft_s") is None:
            continue
        key = segmenter.key_for(
            model=r["model"], route=r.get("route"), prompt_tokens=r["prompt_tokens"],
            output_tokens=r["completion_tokens"],
        )  # fmt: skip
        ttfts[(key, math.floor(r["timestamp"] / window_s) * window_s)].append(r["ttft_s"])
    series: Series = defaultdict(list)
    for (key, start), values in sorted(ttfts.items(), key=lambda item: item[0][1]):
        if len(values) >= MIN_REQUESTS:
            series[key].append((start, float(np.percentile(values, 95))))
    return dict(series)


@dataclass
class _Lifecycle:
    """servewatch's defaults: fire after 2 anomalous windows of 3, resolve after 3 normal."""

    recent: deque[bool] = field(default_factory=lambda: deque(maxlen=3))
    firing: bool = False
    normal_run: int = 0

    def step(self, anomalous: bool) -> bool:
        """Whether this window starts an incident."""
        self.recent.append(anomalous)
        if self.firing:
            self.normal_run = 0 if anomalous else self.normal_run + 1
            if self.normal_run >= 3:
                self.firing = False
            return False
        if sum(self.recent) >= 2:
            self.firing, self.normal_run = True, 0
            return True
        return False


def fixed_threshold(series: Series, warmup_end: float) -> float:
    """The fleet-wide threshold: the 99th percentile of all window p95s before ``warmup_end``."""
    warm = [p95 for points in series.values() for start, p95 in points if start < warmup_end]
    return float(np.percentile(warm, 99)) if warm else math.inf


def fixed_threshold_incidents(series: Series, threshold: float) -> list[tuple[str, float]]:
    """(segment, window start) of each incident a fixed TTFT p95 threshold fires."""
    out = []
    for key, points in series.items():
        life = _Lifecycle()
        out += [(key, start) for start, p95 in points if life.step(p95 > threshold)]
    return out


def rolling_z_incidents(series: Series, history: int = 30, z: float = 3.0) -> list[tuple[str, float]]:
    """(segment, window start) of each incident a load-blind rolling z-score fires."""
    out = []
    for key, points in series.items():
        life, past = _Lifecycle(), deque(maxlen=history)
        for start, p95 in points:
            value = math.log(max(p95, 1e-4))
            anomalous = False
            if len(past) >= 10:
                mean, sd = float(np.mean(past)), float(np.std(past))
                anomalous = (value - mean) / max(sd, 0.01) > z
            if life.step(anomalous):
                out.append((key, start))
            past.append(value)  # a naive detector learns every window, incidents included
    return out
