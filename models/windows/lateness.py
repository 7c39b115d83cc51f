"""How late records arrive, learned: the allowed lateness of stage 1's watermarks.

A partition's records do not arrive in event-time order when several hosts write to it:
each shipper batches (Fluent Bit flushes every second by default, Filebeat's memory queue
every second up to 8.12 and every ten since 8.13, Vector's Kafka sink within milliseconds
but behind its source's batching), and a host's clock may run behind. A record's
*disorder* is how far it is behind the newest event time its partition had already
delivered. A fixed allowed lateness either drops the records of a slow or skewed host
(too small) or delays every window (too large); this learns it instead.

What is worth waiting for is disorder that comes back: a raised wait helps only records
that arrive after it was raised, and it delays every window of every segment. So
``LearnedLateness`` learns in two steps. Each window closed in event-time order (so a
replay learns as the live worker would) gives one figure, the ``quantile`` (99.9 %) of the
disorder of the records that arrived while it was open. The allowed lateness is the least
that only a ``recurrence`` share (10 %) of recent windows' figures exceed, and never a
single window's: a histogram of the figures on log-spaced bins, fading with a half-life of
``half_life_windows`` (30) windows, clamped to [``floor_s``, ``cap_s``]. A disorder must
show up in about five of the last forty windows to be waited for. A host steadily behind
is, after a few windows; one batch of stragglers, however many records it holds, is one
window among forty and moves nothing. (In a fading histogram of records, 2,000 stragglers
stay above 0.1 % of 100 requests a second for half an hour, and every window would wait
for them that long.) Stragglers that keep arriving over several windows
(a host catching up) are waited for until their windows fade to a tenth: minutes. Records
further behind than ``cap_s`` are not learned at all: nobody waits that long, so they are
counted late whatever is learned, never silently lost.

It starts from ``prior_s`` (10 s: Filebeat's flush, the slowest common default), held as
the weight of ``prior_windows`` (3) windows, which fades like them and which real windows
outweigh in about three minutes.

>>> lateness = LearnedLateness(floor_s=1.0, cap_s=120.0, prior_s=10.0)
>>> round(lateness.value, 1)  # the prior, rounded up to its bin's edge
11.4
>>> rng = np.random.default_rng(7)
>>> for _ in range(40):  # a third of the records from a host 30 s behind
...     lateness.observe(np.where(rng.random(3000) < 0.33, 30.0, 0.0) + rng.random(3000))
...     lateness.window_closed()
>>> 30.0 <= lateness.value <= 40.0
True

A burst: live traffic within a second of order, then, once, one host flushes 300 records
a minute old and another ships 2,000 records ten minutes old. Neither moves the wait:

>>> live = LearnedLateness(floor_s=1.0, cap_s=120.0, prior_s=10.0)
>>> waits = []
>>> for window in range(90):  # 15 minutes of 10 s windows, 1,000 records each
...     disorder = rng.random(1000)
...     if window == 60:
...         disorder = np.concatenate([disorder, 60.0 + rng.random(300), 600.0 + rng.random(2000)])
...     live.observe(disorder)
...     live.window_closed()
...     waits.append(round(live.value, 2))
>>> waits[59], max(waits[60:])
(1.07, 1.07)
>>> quiet = LearnedLateness(floor_s=1.0, cap_s=120.0, prior_s=10.0)
>>> for _ in range(400):  # in order: the prior fades and the floor remains
...     quiet.observe(np.zeros(100))
...     quiet.window_closed()
>>> quiet.value
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
    quantile: float = 0.999  # of the disorder that arrived while a window was open: its figure
    recurrence: float = 0.1  # share of recent windows whose figure may exceed the allowed lateness
    half_life_windows: float = 30.0  # five minutes of 10 s windows
    prior_windows: float = 3.0
    # Faded weight of the closed windows, by the bin of their figure (the prior's included).
    windows: np.ndarray = field(init=False, repr=False)
    # Records that arrived since the last window closed, by disorder bin.
    current: np.ndarray = field(init=False, repr=False)
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.windows = np.zeros(len(EDGES))
        self.current = np.zeros(len(EDGES))
        if self.prior_s > 0:
            self.windows[self._bin(np.array([self.prior_s]))[0]] = self.prior_windows
        self._fade = 0.5 ** (1.0 / self.half_life_windows)
        self.value = self._allowed()

    @staticmethod
    def _bin(disorder: np.ndarray) -> np.ndarray:
        return np.minimum(np.searchsorted(EDGES, disorder, side="left"), len(EDGES) - 1)

    def observe(self, disorder: np.ndarray) -> None:
        """Count records that arrived ``disorder`` seconds behind their partition's newest.

        The allowed lateness moves only when a window closes: between two closes it is the
        same whatever the batching of the records (see ``Windower.would_advance``)."""
        # Further behind than the cap: late whatever is learned, so they teach nothing.
        kept = disorder[disorder <= self.cap_s]
        if len(kept):
            self.current += np.bincount(self._bin(np.maximum(kept, 0.0)), minlength=len(EDGES))

    def window_closed(self) -> None:
        """A window closed in event-time order: the records that arrived while it was open
        give one figure; what was learned before fades by one window's half-life step.

        Nothing is learned, and nothing fades, when no record came: several windows that the
        watermark passes at once are one step, and silence teaches nothing."""
        if self.current.sum() <= 0:
            return
        self.windows *= self._fade
        self.windows[_quantile_bin(self.current, self.quantile)] += 1.0
        self.current[:] = 0.0
        self.value = self._allowed()

    def _allowed(self) -> float:
        cumulative = np.cumsum(self.windows)
        total = float(cumulative[-1])
        if total <= 0:
            return max(self.floor_s, min(self.prior_s, self.cap_s))
        # The windows left uncovered may weigh a ``recurrence`` share of all, and never less
        # than one window: a disorder seen in a single window is not waited for, not even by
        # a young learner whose few windows would make one a large share.
        uncovered = total - cumulative
        index = int(np.flatnonzero(uncovered <= max(self.recurrence * total, 1.0) + 1e-9)[0])
        return float(min(self.cap_s, max(self.floor_s, float(EDGES[index]))))


def _quantile_bin(counts: np.ndarray, quantile: float) -> int:
    """The bin holding the ``quantile`` of a histogram with some positive count."""
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
