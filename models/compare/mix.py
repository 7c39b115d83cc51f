"""Post-stratification: the period after, reweighted to the period before's mix of segments.

A deploy that coincides with more long RAG prompts shows a higher pooled TTFT p95 even if no
segment got slower. So both periods are split into segments (model, route, prompt band,
output band by default) and each after-request is weighted so that every segment carries the
share of requests it had *before*: the after statistic is then what the after period would
have shown with the before mix. Only segments with enough requests on both sides count
(a segment seen on one side cannot be compared), and the coverage says how much that left.

Confidence comes from a stratified block bootstrap. Requests close in time are not
independent: a burst queues all of them, a slow minute slows its every request, so resampling
single requests claims far more certainty than an hour holds (a TTFT p95 driven by three
bursts would get an interval as narrow as if each request had met its own luck). Each period
is cut into blocks of ``block_s`` seconds of arrivals, and each resample gives every block a
random weight (exponential: the Bayesian bootstrap, which never drops a block whole); within a
segment the weights are scaled so that the segment keeps its share, so the mix stays fixed and
only the blocks' luck varies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: Entries of one (resamples x requests) array; larger comparisons are bootstrapped in chunks.
_CHUNK_ENTRIES = 4_000_000


@dataclass(frozen=True)
class Columns:
    """One period's requests as float columns (NaN where a record lacks the field) and their
    segment index under each segmentation (``strata``, by name)."""

    strata: dict[str, np.ndarray]  # int64 segment index per request, per segmentation
    values: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.values.values()))) if self.values else 0


def _number(row: Mapping[str, Any], name: str) -> float:
    value = row.get(name)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else np.nan


@dataclass
class Segmentations:
    """Named ways to segment requests, from one key function that gives a request its key
    under each (in ``names`` order: the segmentations share their parts, computed once per
    request), and per name the index of keys seen, shared by both periods."""

    names: tuple[str, ...]
    keys_of: Callable[[Mapping[str, Any]], tuple[str, ...]]
    indexes: dict[str, dict[str, int]] = field(default_factory=dict)

    def sizes(self) -> dict[str, int]:
        """Segments seen so far, per segmentation."""
        return {name: len(self.indexes.get(name, {})) for name in self.names}


def columns(
    rows: Sequence[Mapping[str, Any]],
    segmentations: Segmentations,
    extract: Mapping[str, Callable[[Mapping[str, Any]], float]],
) -> Columns:
    """``rows`` as columns; each request's segment index under each segmentation (new keys
    are added to the segmentation's index)."""
    keys = [segmentations.keys_of(row) for row in rows]
    strata = {}
    for position, name in enumerate(segmentations.names):
        index = segmentations.indexes.setdefault(name, {})
        strata[name] = np.fromiter((index.setdefault(k[position], len(index)) for k in keys), np.int64, len(rows))
    values = {name: np.fromiter((get(row) for row in rows), np.float64, len(rows)) for name, get in extract.items()}
    return Columns(strata, values)


def number(name: str) -> Callable[[Mapping[str, Any]], float]:
    """An extractor of one numeric field (NaN when missing)."""
    return lambda row: _number(row, name)


@dataclass(frozen=True)
class Side:
    """One period's valid values for a signal, grouped by used segment, with their weights.

    ``weights`` sum to 1 and give each used segment its before share (``mix``): uniform on
    the before side, reweighted on the after side. ``blocks`` numbers each value's time block.
    """

    numerator: np.ndarray
    denominator: np.ndarray | None
    weights: np.ndarray
    starts: np.ndarray  # where each used segment's values begin
    sizes: np.ndarray
    share: np.ndarray  # each used segment's share
    blocks: np.ndarray  # per value, its block (0 .. blocks - 1)

    def resample_weights(self, rng: np.random.Generator, resamples: int) -> np.ndarray:
        """(resamples x values) weights: a random weight per block, scaled within each segment
        so that the segment keeps its share."""
        if not len(self.numerator):
            return np.zeros((resamples, 0))
        luck = rng.exponential(1.0, (resamples, int(self.blocks.max()) + 1))[:, self.blocks]
        per_segment = np.add.reduceat(luck, self.starts, axis=1)
        return luck * np.repeat(self.share / per_segment, self.sizes, axis=1)


@dataclass(frozen=True)
class Mix:
    """Which segments a signal compares, and with what weights (the before shares)."""

    used: np.ndarray  # segment indexes with at least ``min_requests`` valid requests on both sides
    share: np.ndarray  # per used segment, its share of the before requests among used ones
    coverage_before: float
    coverage_after: float


def mix_of(before: np.ndarray, after: np.ndarray, segments: int, min_requests: int) -> Mix:
    """The post-stratification of two periods' valid segment indexes.

    >>> m = mix_of(np.array([0] * 40 + [1] * 60 + [2] * 5), np.array([0] * 80 + [1] * 40), 3, 30)
    >>> m.used.tolist(), m.share.round(2).tolist(), round(m.coverage_before, 3), m.coverage_after
    ([0, 1], [0.4, 0.6], 0.952, 1.0)
    """
    nb = np.bincount(before, minlength=segments)
    na = np.bincount(after, minlength=segments)
    used = np.flatnonzero((nb >= min_requests) & (na >= min_requests))
    total = nb[used].sum()
    share = nb[used] / total if total else np.zeros(0)
    return Mix(used, share, float(total / max(nb.sum(), 1)), float(na[used].sum() / max(na.sum(), 1)))


def overlap(before: np.ndarray, after: np.ndarray, segments: int) -> float:
    """The share of requests the two periods have in common, segment by segment: the sum over
    segments of the smaller of their two shares (1: the same mix; 0: no segment in common).
    A segment holding 70 % of the before requests and 9 % of the after ones counts 9 %, not
    70 %: reweighting lets 9 % of one period stand for 70 % of the other, which it cannot.

    >>> overlap(np.array([0] * 70 + [1] * 30), np.array([0] * 9 + [1] * 91), 2)
    0.39
    """
    if not len(before) or not len(after):
        return 0.0
    shares_b = np.bincount(before, minlength=segments) / len(before)
    shares_a = np.bincount(after, minlength=segments) / len(after)
    return round(float(np.minimum(shares_b, shares_a).sum()), 12)


def side(
    stratum: np.ndarray, numerator: np.ndarray, denominator: np.ndarray | None, blocks: np.ndarray, mix: Mix
) -> Side:
    """Valid values of one period (already filtered), grouped by ``mix``'s segments and weighted;
    ``blocks``: each value's time block (any integers)."""
    parts, dens, weights, sizes, block_parts = [], [], [], [], []
    for segment, share in zip(mix.used, mix.share, strict=True):
        rows = np.flatnonzero(stratum == segment)
        parts.append(numerator[rows])
        if denominator is not None:
            dens.append(denominator[rows])
        weights.append(np.full(len(rows), share / len(rows)))
        sizes.append(len(rows))
        block_parts.append(blocks[rows])
    sizes_arr = np.array(sizes, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes_arr)[:-1])) if sizes else np.zeros(0, dtype=np.int64)

    def cat(arrays: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.zeros(0)

    block_ids = np.unique(cat(block_parts), return_inverse=True)[1].astype(np.int64) if parts else np.zeros(0, np.int64)
    return Side(cat(parts), cat(dens) if denominator is not None else None, cat(weights), starts, sizes_arr,
                np.asarray(mix.share, dtype=np.float64), block_ids)  # fmt: skip


def weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> np.ndarray:
    """Per row of ``weights`` (resamples x values), the ``q`` quantile of ``values`` under it.

    The inverted weighted CDF: the smallest value whose cumulative weight reaches ``q``.

    >>> weighted_quantile(np.array([4.0, 1.0, 2.0, 3.0]), np.array([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1]]), 0.5)
    array([4., 2.])
    """
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[:, order], axis=1)
    pos = np.argmax(cum >= q * cum[:, -1:] - 1e-12, axis=1)
    return values[order][pos]


def statistic(data: Side, weights: np.ndarray | None, quantile: float | None) -> np.ndarray:
    """The statistic under each row of ``weights`` (None: the observed sample's, one row)."""
    if weights is None:
        weights = data.weights[None, :]
    if quantile is not None:
        return weighted_quantile(data.numerator, weights, quantile)
    num = weights @ data.numerator
    if data.denominator is None:
        return num
    den = weights @ data.denominator
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def bootstrap(data: Side, quantile: float | None, rng: np.random.Generator, resamples: int) -> np.ndarray:
    """``resamples`` statistics of ``data`` under block-resampled weights (chunked to bound memory)."""
    chunk = max(1, _CHUNK_ENTRIES // max(len(data.numerator), 1))
    out = []
    for start in range(0, resamples, chunk):
        out.append(statistic(data, data.resample_weights(rng, min(chunk, resamples - start)), quantile))
    return np.concatenate(out) if out else np.zeros(0)
