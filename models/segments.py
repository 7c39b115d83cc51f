"""Workload segments: which requests are compared with which.

A 200-token chat turn and a 60k-token RAG prompt have TTFTs two orders of magnitude
apart; averaging them hides both. A segment is a tuple of labels (model, route, prompt
length band, output length band by default). The number of segments is capped: past the
cap, new label combinations share one ``other`` segment, so memory never grows with
label cardinality (a tenant id sneaking into ``route`` must not take the worker down).
"""

from __future__ import annotations

import itertools
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
    _known: set[str] = field(default_factory=set, init=False, repr=False)
    _prompt_labels: list[str] = field(default_factory=list, init=False, repr=False)
    _output_labels: list[str] = field(default_factory=list, init=False, repr=False)
    _combo_keys: dict[tuple[Any, ...], str] = field(default_factory=dict, init=False, repr=False)
    overflowed: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        unknown = set(self.dimensions) - set(DIMENSIONS)
        if unknown or "model" not in self.dimensions:
            raise ValueError(f"segment dimensions must include 'model' and come from {DIMENSIONS}; got {unknown}")
        if self.max_segments < 1:
            raise ValueError("max_segments must be at least 1")
        self._prompt_labels = band_labels(self.prompt_band_edges)
        self._output_labels = band_labels(self.output_band_edges)

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
        if key in self._known:
            return key
        if len(self._known) >= self.max_segments:
            self.overflowed += 1
            return OVERFLOW_KEY
        self._known.add(key)
        return key

    def ids_for_rows(
        self, rows: Sequence[Mapping[str, Any]], prompt: np.ndarray, output: np.ndarray
    ) -> tuple[np.ndarray, list[str]]:
        """Vectorised ``key_for``: a segment id per row, and the keys those ids index.

        Bands come from ``searchsorted``; the label part of each row is a tuple looked up in a
        cache, so the Python work per row is one tuple and one dict lookup.
        """
        prompt_band = np.searchsorted(np.asarray(self.prompt_band_edges), prompt, side="right")
        output_band = np.searchsorted(np.asarray(self.output_band_edges), output, side="right")
        label_dims = [d for d in self.dimensions if d not in ("prompt_band", "output_band")]
        columns = [[row.get(d) for row in rows] for d in label_dims]
        combos = zip(*columns, prompt_band.tolist(), output_band.tolist(), strict=True)
        local: dict[tuple[Any, ...], int] = {}
        ids = np.array([local.setdefault(combo, len(local)) for combo in combos], dtype=np.int64)
        return ids, [self._key_for_combo(label_dims, combo) for combo in local]  # dicts keep insertion order

    def _key_for_combo(self, label_dims: list[str], combo: tuple[Any, ...]) -> str:
        cached = self._combo_keys.get(combo)
        if cached is not None:
            return cached
        labels = dict(zip(label_dims, combo[:-2], strict=True))
        key = self.key_for(
            model=labels.get("model") or UNSET,
            route=labels.get("route"),
            tenant=labels.get("tenant"),
            instance=labels.get("instance"),
            engine=labels.get("engine"),
            prompt_tokens=self._band_floor(self.prompt_band_edges, combo[-2]),
            output_tokens=self._band_floor(self.output_band_edges, combo[-1]),
        )
        if key != OVERFLOW_KEY and len(self._combo_keys) < 4 * self.max_segments:
            self._combo_keys[combo] = key  # bounded: never more combos than a few per segment
        return key

    @staticmethod
    def _band_floor(edges: tuple[int, ...], band: int) -> int:
        """A token count that falls in ``band`` (its lower edge)."""
        return 0 if band == 0 else edges[band - 1]

    @property
    def live_segments(self) -> int:
        return len(self._known)
