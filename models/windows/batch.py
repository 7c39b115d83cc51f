"""A batch of validated request logs as columns, and the evidence kept of a request.

The worker's hot path reads each field it needs once per batch, into a numpy column, and
works on columns from there (``models.windows.open_window``); a row as such is touched again only
when it is kept as evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from servewatch.models.windows.excerpt import excerpt
from servewatch.models.windows.rows import field_getter
from servewatch.models.windows.window import EVIDENCE_FIELDS, REASONS
from servewatch.schemas.request_log import FinishReason, cached_exceeds_prompt, ttft_exceeds_e2e


def normalise_reason(raw: str) -> str:
    """Engines disagree on case and vocabulary; unknown reasons are kept as ``other``."""
    lowered = raw.strip().lower()
    return lowered if lowered in REASONS else FinishReason.OTHER.value


#: Finish reasons as logged -> index in ``REASONS``, for every spelling met so far.
_REASON_CODES: dict[str, int] = {}


class RowBatch:
    """Validated rows plus the columns the hot path reads, each extracted once.

    Rows are mappings (``RequestLog.to_row`` dicts) or objects with the same attributes (the
    decoder's msgspec Structs); a missing optional value is None either way. Numeric
    columns are float64 (None becomes NaN; token counts are exact in float64 far beyond any
    plausible sum), built with one C-level pass each.
    """

    __slots__ = ("_by_attribute", "_columns", "positions", "rows")

    def __init__(self, rows: Sequence[Any], positions: np.ndarray | None = None) -> None:
        self.rows = rows
        # Where each row sat in its message (rows the decoder rejected leave gaps): evidence
        # is kept as (message, position) and read back from there.
        self.positions = np.arange(len(rows)) if positions is None else positions
        self._columns: dict[str, np.ndarray] = {}
        self._by_attribute = bool(rows) and not isinstance(rows[0], Mapping)

    def __len__(self) -> int:
        return len(self.rows)

    def values(self, name: str) -> list[Any]:
        """The field's value in each row (None where missing)."""
        if self._by_attribute:
            return list(map(attrgetter(name), self.rows))
        return [row.get(name) for row in self.rows]

    def column(self, name: str) -> np.ndarray:
        values = self._columns.get(name)
        if values is None:
            values = self._columns[name] = self._read_column(name)
        return values

    def _read_column(self, name: str) -> np.ndarray:
        if self._by_attribute:
            # Straight from the rows in C, no list in between; a missing value (None) stops
            # it, usually at the first row (the field is not logged), and the list path,
            # which reads None as NaN, takes over.
            try:
                return np.fromiter(map(attrgetter(name), self.rows), dtype=np.float64, count=len(self.rows))
            except TypeError:
                pass
        return np.array(self.values(name), dtype=np.float64)

    def reason_codes(self) -> np.ndarray:
        """Each row's finish reason as its index in ``REASONS`` (normalised, see ``normalise_reason``)."""
        raw = self.values("finish_reason")
        try:
            return np.fromiter(map(_REASON_CODES.__getitem__, raw), dtype=np.intp, count=len(raw))
        except KeyError:  # spellings not met before
            if len(_REASON_CODES) > 10_000:  # bounded: engines and gateways spell a handful
                _REASON_CODES.clear()
            _REASON_CODES.update({value: REASONS.index(normalise_reason(value)) for value in set(raw)})
            return np.fromiter(map(_REASON_CODES.__getitem__, raw), dtype=np.intp, count=len(raw))

    def inconsistent(self) -> np.ndarray:
        """Rows breaking the cross-field rules of ``RequestLog`` (NaN compares False: missing is fine)."""
        column = self.column
        broken = cached_exceeds_prompt(column("cached_tokens"), column("prompt_tokens"))
        return np.asarray(broken | ttft_exceeds_e2e(column("ttft_s"), column("e2e_s")))

    @classmethod
    def concat(cls, batches: Sequence[RowBatch]) -> RowBatch:
        """One batch of several (e.g. the messages a worker folds in one pass), keeping each
        row's position in its own message and the columns every part already extracted."""
        if len(batches) == 1:
            return batches[0]
        rows: list[Any] = []
        for part in batches:
            rows.extend(part.rows)
        joined = cls(rows, np.concatenate([part.positions for part in batches]))
        shared = set.intersection(*(set(part._columns) for part in batches)) if batches else set()
        joined._columns = {name: np.concatenate([part._columns[name] for part in batches]) for name in shared}
        return joined

    def slice(self, start: int, stop: int) -> RowBatch:
        """Rows ``start`` to ``stop`` (exclusive), with the columns read so far."""
        part = RowBatch(self.rows[start:stop], self.positions[start:stop])
        part._columns = {name: values[start:stop] for name, values in self._columns.items()}
        return part

    def without(self, drop: np.ndarray) -> RowBatch:
        keep = np.flatnonzero(~drop)
        kept = RowBatch([self.rows[i] for i in keep.tolist()], self.positions[keep])
        kept._columns = {name: values[keep] for name, values in self._columns.items()}
        return kept


def evidence_from_row(row: Any, excerpt_chars: int = 0, markers: Sequence[str] = ()) -> dict[str, Any]:
    """What a person needs to find the request in their own log store; never prompt text.

    With ``excerpt_chars`` > 0, a scrubbed excerpt of the answer (``models.windows.excerpt``) is
    added: around the first reasoning marker it contains (a leak), else its start; and of
    the reasoning text when the answer is empty (an empty response). Accepts a row
    (mapping or attributes) or an evidence dict (idempotent).
    """
    get = field_getter(row)
    record = {name: value for name in EVIDENCE_FIELDS if (value := get(name)) is not None}
    record["finish_reason"] = normalise_reason(str(get("finish_reason")))
    if excerpt_chars > 0:
        content, reasoning = get("content"), get("reasoning_content")
        if isinstance(content, str) and content.strip():
            marker = next((m for m in markers if m in content), None)
            record["content_excerpt"] = excerpt(content, marker, excerpt_chars)
        elif isinstance(reasoning, str) and reasoning.strip():
            record["reasoning_excerpt"] = excerpt(reasoning, None, excerpt_chars)
    return record
