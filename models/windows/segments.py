"""Workload segments: which requests are compared with which.

A 200-token chat turn and a 60k-token RAG prompt have TTFTs two orders of magnitude
apart; averaging them hides both. A segment is a tuple of labels (model, route, prompt
length band, output length band by default). The number of segments is capped: past the
cap, new label combinations share one ``other`` segment, so memory never grows with
label cardinality (a tenant id sneaking into ``route`` must not take the worker down).
Here requests become segment ids; ``segment_keys`` writes and reads the keys that name them.
"""

from __future__ import annotations

import bisect
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Required, TypedDict, Unpack

import numpy as np

from servewatch.models.windows.code_map import UNKNOWN, CodeMap
from servewatch.models.windows.rows import field_getter
from servewatch.models.windows.segment_keys import (
    DEFAULT_DIMENSIONS,
    DIMENSIONS,
    LABEL_DIMENSIONS,
    OVERFLOW_KEY,
    UNSET,
    band_labels,
    band_of,
    clean_label,
    escape_label,
)

#: Largest product of the radices ``Segmenter.ids_for_columns`` mixes label codes and bands
#: with into one int64; fleets with more possible combinations take the per-row path.
_MIXED_MAX = 1 << 62
#: Combinations ``Segmenter.ids_for_columns`` remembers per segment the cap allows (12 bytes
#: each): past that the traffic's combinations moved on (or overflow), and are met afresh.
_CODES_PER_SEGMENT = 16
#: How many of ``Segmenter.key_of_row``'s remembered keys it keeps per segment the cap allows
#: (a segment's requests come in a few combinations of labels and bands).
_ROW_KEYS_PER_SEGMENT = 4


class LabelCodes:
    """Stable small integer codes for the values of each label dimension, kept across batches.

    A column becomes codes with one dict probe per value in C (``map``); Python runs only
    for values never seen before. Bounded: when a dimension has seen ``max_values`` distinct
    values (a request id sneaking into a label), every dimension starts over, in a new
    ``generation``: ``Segmenter``'s map of combinations is keyed by it.

    >>> codes = LabelCodes(2)
    >>> [c.tolist() for c in codes.encode([["m", "n", "m"], ["chat", None, "chat"]])]
    [[0, 1, 0], [0, 1, 0]]
    >>> codes.counts, codes.values_of([1, 0])
    ((2, 2), ['n', 'chat'])
    """

    __slots__ = ("_codes", "_values", "generation", "max_values")

    def __init__(self, dimensions: int, max_values: int = 65_536) -> None:
        self.max_values = max_values
        self.generation = 0  # how many times the codes started over: codes of another generation differ
        self._codes: list[dict[Any, int]] = [{} for _ in range(dimensions)]
        self._values: list[list[Any]] = [[] for _ in range(dimensions)]

    @property
    def counts(self) -> tuple[int, ...]:
        """Distinct values seen per dimension."""
        return tuple(len(values) for values in self._values)

    def encode(self, columns: Sequence[Sequence[Any]]) -> list[np.ndarray]:
        """One int64 code column per label column."""
        if any(len(values) > self.max_values for values in self._values):
            for code_of, values in zip(self._codes, self._values, strict=True):
                code_of.clear()
                values.clear()
            self.generation += 1
        out = []
        for code_of, values, column in zip(self._codes, self._values, columns, strict=True):
            try:
                out.append(np.fromiter(map(code_of.__getitem__, column), np.int64, count=len(column)))
            except KeyError:  # new values: learn them in order of first sight, then encode
                for value in dict.fromkeys(column):
                    if value not in code_of:
                        # Interned: the segment keys and detectors share the label strings.
                        value = sys.intern(value) if type(value) is str else value
                        code_of[value] = len(values)
                        values.append(value)
                out.append(np.fromiter(map(code_of.__getitem__, column), np.int64, count=len(column)))
        return out

    def values_of(self, codes: Sequence[int]) -> list[Any]:
        return [values[code] for values, code in zip(self._values, codes, strict=True)]


class RequestLabels(TypedDict, total=False):
    """What a request's segment key is made of (``Segmenter.key_for``)."""

    model: Required[str]
    prompt_tokens: Required[int]
    output_tokens: Required[int]
    route: str | None
    tenant: str | None
    instance: str | None
    engine: str | None


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
    #: Put before every key (``REPLICA_PREFIX`` for the replica rows' segmenter).
    key_prefix: str = ""
    #: Event seconds without requests after which a segment's id may go to a new label
    #: combination once the cap is reached (``note_seen``); infinite: never.
    idle_s: float = math.inf
    #: Every segment key seen, in order of first sight; a key's position is its stable id
    #: (until the segment is idle for ``idle_s`` and its id is needed for a new key).
    keys: list[str] = field(default_factory=list, init=False, repr=False)
    #: Per id, the end of the last window it had requests in (event time), and the latest of them.
    last_seen: array[float] = field(default_factory=lambda: array("d"), init=False, repr=False)
    clock: float = field(default=-math.inf, init=False, repr=False)
    reclaimed: int = field(default=0, init=False)
    _ids: dict[str, int] = field(default_factory=dict, init=False, repr=False)
    _overflow_id: int | None = field(default=None, init=False, repr=False)
    _prompt_labels: list[str] = field(default_factory=list, init=False, repr=False)
    _output_labels: list[str] = field(default_factory=list, init=False, repr=False)
    _label_codes: LabelCodes = field(init=False, repr=False)
    # Mixed label and band codes -> segment id, for the combinations met (``CodeMap``), and
    # the codes and radices it holds codes of.
    _lookup: CodeMap = field(default_factory=CodeMap, init=False, repr=False)
    _lookup_of: tuple[int, tuple[int, ...]] = field(default=(0, ()), init=False, repr=False)
    # While a batch's new combinations are met (``_ids_of_new``): each segment's last window with
    # requests, those with requests in the batch at infinity (not idle, whatever they were).
    _free_ages: np.ndarray | None = field(default=None, init=False, repr=False)
    # ``key_of_row``'s keys by combination of labels and bands (bounded: ``_ROW_KEYS_PER_SEGMENT``).
    _row_keys: dict[tuple[Any, ...], str] = field(default_factory=dict, init=False, repr=False)
    # Without a table (too many label combinations): segment id per row of codes, one generation's.
    _row_ids: dict[tuple[int, ...], int] = field(default_factory=dict, init=False, repr=False)
    _row_ids_generation: int = field(default=0, init=False, repr=False)
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
        self._label_codes = LabelCodes(sum(d not in ("prompt_band", "output_band") for d in self.dimensions))

    def key_for(self, **request: Unpack[RequestLabels]) -> str:
        """The segment key of a request (``natural_key``), registered; past ``max_segments``
        distinct keys, new ones share ``OVERFLOW_KEY``."""
        key = self.natural_key(**request)
        known = self._ids.get(key)
        if known is not None:
            return self.keys[known]
        if len(self._ids) - (self._overflow_id is not None) >= self.max_segments:
            idle = self._idle_id()
            if idle is not None:
                return self._reassign(idle, key)
            self.overflowed += 1
            key = self.key_prefix + OVERFLOW_KEY
            if self._overflow_id is not None:
                return key
            self._overflow_id = len(self.keys)
        key = sys.intern(key)  # stage 2 and the detectors share it, even when it came over the wire
        self._ids[key] = len(self.keys)
        self.keys.append(key)
        self.last_seen.append(self.clock)
        return key

    def note_seen(self, ids: Sequence[int], when: float) -> None:
        """The segments ``ids`` had requests in the window that ended at ``when`` (event time)."""
        seen = self.last_seen
        for segment_id in ids:
            if seen[segment_id] < when:
                seen[segment_id] = when
        self.clock = max(self.clock, when)

    def _idle_id(self) -> int | None:
        """The id of the segment idle longest, if idle for ``idle_s`` (never the overflow one)."""
        if not math.isfinite(self.idle_s) or not self.last_seen:
            return None
        ages = np.frombuffer(self.last_seen, dtype=np.float64) if self._free_ages is None else self._free_ages
        oldest = int(np.argmin(ages))
        if oldest == self._overflow_id:
            ages = ages.copy()
            ages[oldest] = np.inf
            oldest = int(np.argmin(ages))
        return oldest if self.clock - ages[oldest] >= self.idle_s else None

    def _reassign(self, segment_id: int, key: str) -> str:
        """Give an idle segment's id to a new key: the old key's label combinations lose it
        (they get a fresh id or the overflow segment if they come back)."""
        del self._ids[self.keys[segment_id]]
        key = sys.intern(key)
        self.keys[segment_id] = key
        self._ids[key] = segment_id
        self.last_seen[segment_id] = self.clock
        self._lookup.forget(segment_id)
        for row in [row for row, found in self._row_ids.items() if found == segment_id]:
            del self._row_ids[row]
        self.reclaimed += 1
        return key

    def natural_key(self, **request: Unpack[RequestLabels]) -> str:
        """The key of a request's segment before the cap (``key_for`` without registering it)."""
        optional = ("route", "tenant", "instance", "engine")
        values: dict[str, str] = {dim: str(request.get(dim) or UNSET) for dim in optional}
        values["model"] = request["model"]
        prompt_tokens, output_tokens = request["prompt_tokens"], request["output_tokens"]
        parts = []
        for dim in self.dimensions:
            if dim == "prompt_band":
                value = band_of(prompt_tokens, self.prompt_band_edges, self._prompt_labels)
            elif dim == "output_band":
                value = band_of(output_tokens, self.output_band_edges, self._output_labels)
            else:
                # Escaped, never replaced: the labels read back from the key (what events,
                # titles and the triage page show) are the requests' own.
                value = escape_label(values[dim])
            parts.append(f"{dim}={value}")
        return self.key_prefix + "|".join(parts)

    def key_of_row(self, row: Any) -> str:
        """``natural_key`` of a request log (a mapping or an object with its fields).

        Remembered per combination of labels and bands: reading evidence back keys every
        request of the messages a window spread over, thousands of the same few combinations,
        and building a key costs several times looking one up."""
        get = field_getter(row)
        prompt_tokens, output_tokens = int(get("prompt_tokens") or 0), int(get("completion_tokens") or 0)
        model, route, tenant, instance, engine = (get(name) for name in LABEL_DIMENSIONS)
        combination = (
            model, bisect.bisect_right(self.prompt_band_edges, prompt_tokens),
            bisect.bisect_right(self.output_band_edges, output_tokens), route, tenant, instance, engine,
        )  # fmt: skip
        key = self._row_keys.get(combination)
        if key is None:
            if len(self._row_keys) >= _ROW_KEYS_PER_SEGMENT * self.max_segments:
                self._row_keys.clear()  # bounded: the traffic's combinations moved on
            key = self._row_keys[combination] = self.natural_key(
                model=str(model), prompt_tokens=prompt_tokens, output_tokens=output_tokens, route=route,
                tenant=tenant, instance=instance, engine=engine,
            )  # fmt: skip
        return key

    def ids_for_columns(
        self, labels: Mapping[str, Sequence[Any]], prompt: np.ndarray, output: np.ndarray
    ) -> np.ndarray:
        """Vectorised ``key_for``: the segment id of each row (``keys[id]`` is its key).

        ``labels`` holds one column (a value per row, None when missing) per label dimension.
        Bands come from ``searchsorted``; labels become stable integer codes per dimension
        (``LabelCodes``), mixed into one integer per row, which a map of the combinations met,
        kept across batches (``CodeMap``), gives the segment id of: Python runs per new
        combination, not per row or batch.
        Ids are stable for the segmenter's lifetime, so callers can index tables by them.
        """
        prompt_band = np.searchsorted(self._prompt_edges, prompt, side="right")
        output_band = np.searchsorted(self._output_edges, output, side="right")
        label_dims = [d for d in self.dimensions if d not in ("prompt_band", "output_band")]
        codes = self._label_codes.encode([labels[dim] for dim in label_dims])
        # Room for twice the label values seen so far (powers of two), so that the mixed codes
        # met stay valid until a dimension doubles.
        radices = (
            *(1 << (2 * count - 1).bit_length() for count in self._label_codes.counts),
            len(self._prompt_edges) + 1,
            len(self._output_edges) + 1,
        )
        if math.prod(radices) > _MIXED_MAX:  # more combinations than an int64 mixes: per distinct row
            ids = self._ids_by_rows(label_dims, codes, prompt_band, output_band)
        else:
            mixed = np.zeros(len(prompt_band), dtype=np.int64)
            for column, radix in zip(codes, radices[:-2], strict=True):
                mixed = mixed * radix + column
            mixed = (mixed * radices[-2] + prompt_band) * radices[-1] + output_band
            built_on = (self._label_codes.generation, radices)
            if self._lookup_of != built_on:
                self._lookup.clear()  # codes of other radices
                self._lookup_of = built_on
            elif len(self._lookup) >= _CODES_PER_SEGMENT * self.max_segments:
                # Bounded: the overflow's combinations go first (past the cap, a fleet's label
                # combinations are many), then all (the traffic's combinations moved on).
                if self._overflow_id is not None:
                    self._lookup.forget(self._overflow_id)
                if len(self._lookup) >= _CODES_PER_SEGMENT * self.max_segments // 2:
                    self._lookup.clear()
            ids = self._lookup.lookup(mixed)
            unknown = ids == UNKNOWN
            if unknown.any():
                new = np.unique(mixed[unknown]).tolist()
                found = self._ids_of_new(label_dims, [self._digits(code, radices) for code in new], ids[~unknown])
                self._lookup.add(dict(zip(new, found, strict=True)))
                ids[unknown] = self._lookup.lookup(mixed[unknown])
        if self._overflow_id is not None:
            self.overflowed += int(np.count_nonzero(ids == self._overflow_id))
        return ids

    def _ids_of_new(
        self, label_dims: list[str], combinations: list[tuple[int, ...]], known_ids: Sequence[int] | np.ndarray
    ) -> list[int]:
        """``_id_for`` of each combination of label codes and bands, in turn. Segments with
        requests in the batch at hand (``known_ids``, and those found here) are not idle:
        their rows were just given their ids, which must not go to a new key of the batch."""
        free = None
        if math.isfinite(self.idle_s):  # ids may be reclaimed, should the cap be reached
            free = np.frombuffer(self.last_seen, dtype=np.float64).copy()
            free[np.asarray(known_ids, dtype=np.intp)] = np.inf
        self._free_ages = free
        found = []
        try:
            for digits in combinations:
                found.append(segment_id := self._id_for(label_dims, digits))
                if free is not None and segment_id < len(free):
                    free[segment_id] = np.inf
        finally:
            self._free_ages = None
        return found

    @staticmethod
    def _digits(mixed: int, radices: tuple[int, ...]) -> tuple[int, ...]:
        """The (label codes..., prompt band, output band) a mixed code stands for."""
        digits = []
        for radix in reversed(radices):
            mixed, digit = divmod(mixed, radix)
            digits.append(digit)
        return tuple(reversed(digits))

    def _ids_by_rows(
        self, label_dims: list[str], codes: list[np.ndarray], prompt_band: np.ndarray, output_band: np.ndarray
    ) -> np.ndarray:
        """``ids_for_columns`` where the combinations are too many to mix into an int64: a
        dict probe per distinct row."""
        if self._row_ids_generation != self._label_codes.generation:
            self._row_ids.clear()
            self._row_ids_generation = self._label_codes.generation
        distinct, inverse = np.unique(np.column_stack((*codes, prompt_band, output_band)), axis=0, return_inverse=True)
        rows = list(map(tuple, distinct.tolist()))
        ids = [self._row_ids.get(row, UNKNOWN) for row in rows]
        missing = [i for i, found in enumerate(ids) if found == UNKNOWN]
        if missing:
            found = self._ids_of_new(label_dims, [rows[i] for i in missing], [i for i in ids if i != UNKNOWN])
            for i, segment_id in zip(missing, found, strict=True):
                ids[i] = segment_id
                if len(self._row_ids) < 4 * self.max_segments:  # bounded: a few combinations per segment
                    self._row_ids[rows[i]] = segment_id
        return np.array(ids, dtype=np.int64)[inverse.ravel()]

    def _id_for(self, label_dims: list[str], digits: tuple[int, ...]) -> int:
        """The segment id of one combination of label codes and bands (``key_for``'s)."""
        labels = dict(zip(label_dims, self._label_codes.values_of(digits[:-2]), strict=True))
        overflowed = self.overflowed
        key = self.key_for(
            model=clean_label(labels.get("model")) or UNSET,
            route=clean_label(labels.get("route")),
            tenant=clean_label(labels.get("tenant")),
            instance=clean_label(labels.get("instance")),
            engine=clean_label(labels.get("engine")),
            prompt_tokens=self._band_floor(self.prompt_band_edges, digits[-2]),
            output_tokens=self._band_floor(self.output_band_edges, digits[-1]),
        )
        self.overflowed = overflowed  # counted per row by the caller
        return self._ids[key]

    @staticmethod
    def _band_floor(edges: tuple[int, ...], band: int) -> int:
        """A token count that falls in ``band`` (its lower edge)."""
        return 0 if band == 0 else edges[band - 1]

    @property
    def live_segments(self) -> int:
        """Distinct segments, the shared overflow one excluded."""
        return len(self.keys) - (self._overflow_id is not None)
