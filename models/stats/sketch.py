"""A mergeable, fixed-size latency histogram with log-spaced buckets.

Window aggregates are built per worker and merged per segment, so quantiles
must come from something that adds up exactly: bucket counts do, raw samples would not
stay bounded. 16 buckets per decade keep any quantile within about 7.5 % of the truth,
which is far finer than the deviations worth paging on.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

LOWEST_S = 1e-4
DECADES = 8  # 0.1 ms .. 10,000 s
PER_DECADE = 16
N_BUCKETS = DECADES * PER_DECADE + 2  # + underflow and overflow
_LOG_LOWEST = np.log10(LOWEST_S)


def bucket_indices(values: npt.NDArray[np.float64]) -> npt.NDArray[np.intp]:
    """Bucket of each value: 0 is underflow (< 0.1 ms), the last is overflow. NaN (a request
    that did not report the value) lands in 0 too: callers count only the values they have."""
    with np.errstate(divide="ignore", invalid="ignore"):
        pos = np.floor((np.log10(np.maximum(values, 1e-300)) - _LOG_LOWEST) * PER_DECADE).astype(np.intp) + 1
    return np.clip(pos, 0, N_BUCKETS - 1)


def bucket_value(index: int) -> float:
    """Representative value of a bucket: its geometric midpoint."""
    if index <= 0:
        return LOWEST_S
    if index >= N_BUCKETS - 1:
        return LOWEST_S * 10.0**DECADES
    return float(10.0 ** (_LOG_LOWEST + (index - 0.5) / PER_DECADE))


#: Natural log of every bucket's representative value (``bucket_value``).
_LOG_MIDPOINTS = np.log([bucket_value(i) for i in range(N_BUCKETS)])


class LogHistogram:
    """Counts per log bucket; ``add`` takes a numpy array, ``merge`` another histogram.

    >>> h = LogHistogram()
    >>> h.add(np.array([0.1, 0.2, 0.3, 5.0]))
    >>> round(h.quantile(0.5), 2), h.count
    (0.19, 4)
    """

    __slots__ = ("counts",)

    def __init__(self, counts: npt.NDArray[np.int32] | None = None) -> None:
        # int32: a window never holds 2^31 requests, and it halves a live segment's histogram.
        self.counts = counts if counts is not None else np.zeros(N_BUCKETS, dtype=np.int32)

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    def add(self, values: npt.NDArray[np.float64]) -> None:
        if values.size:
            self.counts += np.bincount(bucket_indices(values), minlength=N_BUCKETS)

    def merge(self, other: LogHistogram) -> None:
        self.counts += other.counts

    def quantile(self, q: float) -> float:
        return self.quantiles(q)[0]

    def quantiles(self, *qs: float) -> list[float]:
        """Several quantiles from one pass over the buckets."""
        cumulative = np.cumsum(self.counts)
        total = int(cumulative[-1])
        if total == 0:
            return [float("nan")] * len(qs)
        ranks = [q * (total - 1) for q in qs]
        return [bucket_value(int(i)) for i in np.searchsorted(cumulative, ranks, side="right").tolist()]

    def log_moments(self) -> tuple[int, float, float]:
        """(count, mean, variance) of the natural log of the values, each taken at its
        bucket's midpoint: a bucket is 15 % wide, so a value is off by at most 7 % and a mean
        over a window's requests by far less.

        >>> h = LogHistogram()
        >>> h.add(np.array([0.5, 0.5, 2.0, 2.0]))
        >>> n, mean, var = h.log_moments()
        >>> n, round(float(np.exp(mean)), 1), round(var, 2)
        (4, 1.0, 0.42)
        """
        total = int(self.counts.sum())
        if total == 0:
            return 0, float("nan"), float("nan")
        weights = self.counts / total
        mean = float(weights @ _LOG_MIDPOINTS)
        return total, mean, float(weights @ (_LOG_MIDPOINTS - mean) ** 2)

    def to_sparse(self) -> dict[int, int]:
        """Non-zero buckets only: what crosses the wire."""
        nonzero = np.flatnonzero(self.counts)
        return {int(i): int(self.counts[i]) for i in nonzero}

    @classmethod
    def from_sparse(cls, sparse: dict[int, int] | dict[str, int]) -> LogHistogram:
        hist = cls()
        for index, count in sparse.items():
            i = int(index)
            if not 0 <= i < N_BUCKETS or int(count) < 0:
                raise ValueError(f"bad histogram bucket {index}: {count}")
            hist.counts[i] += int(count)
        return hist
