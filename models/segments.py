"""Workload segments: which requests are compared with which.

A 200-token chat turn and a 60k-token RAG prompt have TTFTs two orders of magnitude
apart; averaging them hides both. A segment is a tuple of labels (model, route, prompt
length band, output length band by default). The number of segments is capped: past the
cap, new label combinations share one ``other`` segment, so memory never grows with
label cardinality (a tenant id sneaking into ``route`` must not take the worker down).
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DIMENSIONS = ("model", "route", "tenant", "instance", "engine", "prompt_band", "output_band")
DEFAULT_DIMENSIONS = ("model", "route", "prompt_band", "output_band")
OVERFLOW_KEY = "model=other|segment=overflow"
UNSET = "-"


def _short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def band_labels(edges: Sequence[int]) -> list[str]:
    """Human labels of the bands cut by ``edges``: ``<1k``, ``1k-8k``, ``>=8k``."""
    if not edges:
        return ["all"]
    labels = [f"<{_short(edges[0])}"]
    labels += [f"{_short(lo)}-{_short(hi)}" for lo, hi in itertools.pairwise(edges)]
    labels.append(f">={_short(edges[-1])}")
    return labels


def band_of(tokens: int, edges: Sequence[int], labels: Sequence[str]) -> str:
    for edge, label in zip(edges, labels, strict=False):
        if tokens < edge:
            return label
    return labels[-1]


def _clean(label: str | None) -> str | None:
    """Labels compare without surrounding blanks (``" chat"`` is ``chat``)."""
    return label.strip() or None if label is not None else None


def parse_key(key: str) -> dict[str, str]:
    """Labels of a segment key (``model=a|route=b`` -> ``{"model": "a", "route": "b"}``)."""
    labels = dict(part.split("=", 1) for part in key.split("|") if "=" in part)
    labels.setdefault("model", "other")
    return labels


@dataclass
class Segmenter:
    """Maps a request's labels and token counts to a bounded set of segment keys.

    >>> seg = Segmenter(max_segments=2)
    >>> seg.key_for(model="m", route="chat", prompt_tokens=500, output_tokens=50)
    'model=m|route=chat|prompt_band=<4k|output_band=<1k'
    >>> seg.key_for(model="m", route="rag", prompt_tokens=9000, output_tokens=50)
    'model=m|route=rag|prompt_band=4k-32k|output_band=<1k'
    >>> seg.key_for(model="m", route="code", prompt_tokens=9000, output_tokens=50)
    'model=other|segment=overflow'
    """

    dimensions: tuple[str, ...] = DEFAULT_DIMENSIONS
    prompt_band_edges: tuple[int, ...] = (4096, 32768)
    output_band_edges: tuple[int, ...] = (1024,)
    max_segments: int = 1000
    #: Every segment key seen, in order of first sight; a key's position is its stable id.
    keys: list[str] = field(default_factory=list, init=False, repr=False)
    _ids: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _overflow_id: int | None = field(default=None, init=False, repr=False)
    _prompt_labels: list[str] = field(default_factory=list, init=False, repr=False)
    _output_labels: list[str] = field(default_factory=list, init=False, repr=False)
    _combo_ids: dict[tuple[Any, ...], int] = field(default_factory=dict, init=False, repr=False)
    _prompt_edges: np.ndarray = field(init=False, repr=False)
    _output_edges: np.ndarray = field(init=False, repr=False)
    overflowed: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        unknown = set(self.dimensions) - set(DIMENSIONS)
        if unknown or "model" not in self.dimensions:
            raise ValueError(f"segment dimensions must include 'model' and come from {DIMENSIONS}; got {unknown}")
        if self.max_segments < 1:
            raise ValueError("max_segments must be at least 1")
        self._prompt_labels = band_labels(self.prompt_band_edges)
        self._output_labels = band_labels(self.output_band_edges)
        self._prompt_edges = np.asarray(self.prompt_band_edges)
        self._output_edges = np.asarray(self.output_band_edges)

    def key_for(
        self,
        *,
        model: str,
        prompt_tokens: int,
        output_tokens: int,
        route: str | None = None,
        tenant: str | None = None,
        instance: str | None = None,
        engine: str | None = None,
    ) -> str:
        values = {
            "model": model,
            "route": route or UNSET,
            "tenant": tenant or UNSET,
            "instance": instance or UNSET,
            "engine": engine or UNSET,
        }
        parts = []
        for dim in self.dimensions:
            if dim == "prompt_band":
                value = band_of(prompt_tokens, self.prompt_band_edges, self._prompt_labels)
            elif dim == "output_band":
                value = band_of(output_tokens, self.output_band_edges, self._output_labels)
            else:
                # '|' and '=' separate labels in the key; keep them out of values.
                value = values[dim].replace("|", "/").replace("=", ":")
            parts.append(f"{dim}={value}")
        key = "|".join(parts)
        known = self._ids.get(key)
        if known is not None:
            return self.keys[known]
        if len(self._ids) - (self._overflow_id is not None) >= self.max_segments:
            self.overflowed += 1
            key = OVERFLOW_KEY
            if self._overflow_id is not None:
                return key
            self._overflow_id = len(self.keys)
        key = sys.intern(key)  # stage 2 and the detectors share it, even when it came over the wire
        self._ids[key] = len(self.keys)
        self.keys.append(key)
        return key

    def ids_for_columns(
        self, labels: Mapping[str, Sequence[Any]], prompt: np.ndarray, output: np.ndarray
    ) -> np.ndarray:
        """Vectorised ``key_for``: the segment id of each row (``keys[id]`` is its key).

        ``labels`` holds one column (a value per row, None when missing) per label dimension.
        Bands come from ``searchsorted``; labels become integer codes per column, mixed into
        one integer per row, so Python runs per distinct combination, not per row. Ids are
        stable for the segmenter's lifetime, so callers can index tables by them.
        """
        prompt_band = np.searchsorted(self._prompt_edges, prompt, side="right")
        output_band = np.searchsorted(self._output_edges, output, side="right")
        label_dims = [d for d in self.dimensions if d not in ("prompt_band", "output_band")]
        # Each column to small integer codes (one dict probe per value, in C via map), a row's
        # codes mixed into one integer, and Python work only per distinct combination.
        n = len(prompt_band)
        columns = [list(labels[dim]) for dim in label_dims]
        distincts = [list(dict.fromkeys(column)) for column in columns]
        radices = [len(d) for d in distincts] + [len(self._prompt_edges) + 1, len(self._output_edges) + 1]
        if math.prod(radices) >= 2**62:  # would overflow int64: one tuple per row instead
            rows = zip(*columns, prompt_band.tolist(), output_band.tolist(), strict=True)
            local: dict[tuple[Any, ...], int] = {}
            codes = np.array([local.setdefault(row, len(local)) for row in rows], dtype=np.int64)
            ids = np.array([self._id_for_combo(label_dims, combo) for combo in local], dtype=np.int64)[codes]
        else:
            mixed = np.zeros(n, dtype=np.int64)
            for column, distinct in zip(columns, distincts, strict=True):
                code_of = {value: code for code, value in enumerate(distinct)}
                mixed = mixed * len(distinct) + np.fromiter(map(code_of.__getitem__, column), np.int64, count=n)
            mixed = (mixed * radices[-2] + prompt_band) * radices[-1] + output_band
            _, first, inverse = np.unique(mixed, return_index=True, return_inverse=True)
            combos = [
                (*(column[row] for column in columns), int(prompt_band[row]), int(output_band[row]))
                for row in first.tolist()
            ]
            ids = np.array([self._id_for_combo(label_dims, c) for c in combos], dtype=np.int64)[inverse.ravel()]
        if self._overflow_id is not None:
            self.overflowed += int(np.count_nonzero(ids == self._overflow_id))
        return ids

    def _id_for_combo(self, label_dims: list[str], combo: tuple[Any, ...]) -> int:
        cached = self._combo_ids.get(combo)
        if cached is not None:
            return cached
        labels = dict(zip(label_dims, combo[:-2], strict=True))
        overflowed = self.overflowed
        key = self.key_for(
            model=_clean(labels.get("model")) or UNSET,
            route=_clean(labels.get("route")),
            tenant=_clean(labels.get("tenant")),
            instance=_clean(labels.get("instance")),
            engine=_clean(labels.get("engine")),
            prompt_tokens=self._band_floor(self.prompt_band_edges, combo[-2]),
            output_tokens=self._band_floor(self.output_band_edges, combo[-1]),
        )
        self.overflowed = overflowed  # counted per row by the caller
        segment_id = self._ids[key]
        if key != OVERFLOW_KEY and len(self._combo_ids) < 4 * self.max_segments:
            # Bounded: never more combos than a few per segment. Interned, so the model
            # name a thousand segments share is one string, not a copy per segment.
            combo = tuple(sys.intern(v) if isinstance(v, str) else v for v in combo)
            self._combo_ids[combo] = segment_id
        return segment_id

    @staticmethod
    def _band_floor(edges: tuple[int, ...], band: int) -> int:
        """A token count that falls in ``band`` (its lower edge)."""
        return 0 if band == 0 else edges[band - 1]

    @property
    def live_segments(self) -> int:
        """Distinct segments, the shared overflow one excluded."""
        return len(self.keys) - (self._overflow_id is not None)
