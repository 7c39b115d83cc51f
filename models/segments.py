"""Workload segments: which requests are compared with which.

A 200-token chat turn and a 60k-token RAG prompt have TTFTs two orders of magnitude
apart; averaging them hides both. A segment is a tuple of labels (model, route, prompt
length band, output length band by default). The number of segments is capped: past the
cap, new label combinations share one ``other`` segment, so memory never grows with
label cardinality (a tenant id sneaking into ``route`` must not take the worker down).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

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

    @property
    def live_segments(self) -> int:
        return len(self._known)
