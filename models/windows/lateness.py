"""How late records arrive, learned: the allowed lateness of stage 1's watermarks.

A partition's records do not arrive in event-time order when several hosts write to it:
each shipper batches (Fluent Bit flushes every second by default, Filebeat's memory queue
every second up to 8.12 and every ten since 8.13, Vector's Kafka sink within milliseconds
but behind its source's batching), and a host's clock may run behind. A record's
*disorder* is how far it is behind the newest event time its partition had already
delivered. A fixed allowed lateness either drops the records of a slow or skewed host
(too small) or delays every window (too large); this learns it instead.

``LearnedLateness`` learns from *arrival intervals* (the records that arrived between two
window closes), not from records one by one: each interval gives one figure, the disorder
of its ``record_quantile`` (99.9 %) record, and the allowed lateness is the ``quantile``
(95 %) of those figures over recent intervals, on log-spaced bins fading with a half-life
counted in closed windows (event time, so a replay learns as the live worker would), between
``floor_s`` and ``cap_s``. What happens in most intervals is waited for: a host always 30 s
behind, a shipper that flushes once a minute (every sixth interval). A burst of stragglers
is one interval however many records it holds (a backlog shipped at once, a host back from
an outage), so it does not stretch every window's wait for half an hour: its records are
counted late, never silently lost, as are those of a host further behind than ``cap_s``.
It starts from ``prior_s`` (10 s: Filebeat's flush, the slowest common default), held as a
few intervals' worth that real ones outweigh and that fades like them.

>>> lateness = LearnedLateness(floor_s=1.0, cap_s=120.0, prior_s=10.0)
>>> round(lateness.value, 1)  # the prior, rounded up to its bin's edge
11.4
>>> rng = np.random.default_rng(7)
>>> for _ in range(40):  # a third of the records from a host 30 s behind
...     lateness.observe(np.where(rng.random(3000) < 0.33, 30.0, 0.0) + rng.random(3000))
...     lateness.window_closed()
>>> 30.0 <= lateness.value <= 40.0
True
>>> quiet = LearnedLateness(floor_s=1.0, cap_s=120.0, prior_s=10.0)
>>> for _ in range(400):  # in order: the prior fades and the floor remains
...     quiet.observe(np.zeros(100))
...     quiet.window_closed()
>>> quiet.value
1.0
>>> quiet.observe(np.full(2000, 600.0))  # a backlog ten minutes old, shipped at once
>>> quiet.window_closed()
>>> quiet.value  # counted late, not waited for
1.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

#: Upper edges of the disorder bins, seconds: 0 (in order), then log-spaced 0.1 s to 1 h.
EDGES = np.concatenate([[0.0], np.geomspace(0.1, 3600.0, 63)])


@dataclass
class LearnedLateness:
    floor_s: float = 1.0
    cap_s: float = 120.0
    prior_s: float = 10.0
    quantile: float = 0.95  # of arrival intervals: what happens in one of 20 is not waited for
    record_quantile: float = 0.999  # of one interval's records: its disorder
    half_life_windows: float = 30.0  # five minutes of 10 s windows
    prior_weight: float = 5.0  # intervals
    counts: np.ndarray = field(init=False, repr=False)  # intervals per disorder bin, faded
    arriving: np.ndarray = field(init=False, repr=False)  # records per bin since the last close
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.zeros(len(EDGES))
        self.arriving = np.zeros(len(EDGES))
        if self.prior_s > 0:
            self.counts[self._bin(np.array([self.prior_s]))[0]] = self.prior_weight
        self._fade = 0.5 ** (1.0 / self.half_life_windows)
        self.value = self._allowed()

    @staticmethod
    def _bin(disorder: np.ndarray) -> np.ndarray:
        return np.minimum(np.searchsorted(EDGES, disorder, side="left"), len(EDGES) - 1)

    def observe(self, disorder: np.ndarray) -> None:
        """Count records that arrived ``disorder`` seconds behind their partition's newest."""
        if len(disorder):
            self.arriving += np.bincount(self._bin(np.maximum(disorder, 0.0)), minlength=len(EDGES))

    def window_closed(self) -> None:
        """Fade what was learned by one window's half-life step, and learn the interval that
        arrived since the last close (if any records did) as one figure."""
        self.counts *= self._fade
        if self.arriving.sum() > 0:
            self.counts[_quantile_bin(self.arriving, self.record_quantile)] += 1.0
            self.arriving[:] = 0.0
        self.value = self._allowed()

    def _allowed(self) -> float:
        if self.counts.sum() <= 0:
            return max(self.floor_s, min(self.prior_s, self.cap_s))
        upper = float(EDGES[_quantile_bin(self.counts, self.quantile)])
        return float(min(self.cap_s, max(self.floor_s, upper)))


def _quantile_bin(counts: np.ndarray, quantile: float) -> int:
    """The bin holding the ``quantile`` of a histogram with a positive total."""
    index = int(np.searchsorted(np.cumsum(counts), quantile * counts.sum(), side="left"))
    return min(index, len(counts) - 1)


def disorder_of(times: np.ndarray, newest_before: float) -> np.ndarray:
    """Each record's distance behind the newest event time delivered before it, in arrival
    order, starting from ``newest_before`` (-inf: the partition's first records)."""
    if not len(times):
        return times
    start = times[0] if math.isinf(newest_before) else max(newest_before, times[0])
    running = np.maximum.accumulate(np.concatenate([[start], times[:-1]]))
    return np.maximum(running - times, 0.0)
