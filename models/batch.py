"""A batch of validated request logs as columns, and the evidence kept of a request.

The worker's hot path reads each field it needs once per batch, into a numpy column, and
works on columns from there (``models.open_window``); a row as such is touched again only
when it is kept as evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from models.window import EVIDENCE_FIELDS
from schemas.request_log import FinishReason, RequestLogRow

#: Finish reasons in the order of a window's reason counts.
REASONS = tuple(reason.value for reason in FinishReason)


def normalise_reason(raw: str) -> str:
    """Engines disagree on case and vocabulary; unknown reasons are kept as ``other``."""
    lowered = raw.strip().lower()
    return lowered if lowered in REASONS else FinishReason.OTHER.value


class RowBatch:
    """Validated rows plus the columns the hot path reads, each extracted once.

    Rows are mappings (``RequestLogRow`` dicts) or objects with the same attributes (the
    decoder's msgspec Structs); a missing optional value is None either way. Numeric
    columns are float64 (None becomes NaN; token counts are exact in float64 far beyond any
    plausible sum), built with one C-level pass each.
    """

    __slots__ = ("_by_attribute", "_columns", "rows")

    def __init__(self, rows: Sequence[Any]) -> None:
        self.rows = rows
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
            values = self._columns[name] = np.array(self.values(name), dtype=np.float64)
        return values

    def evidence(self, index: int) -> tuple[Any, ...]:
        """Row ``index`` as a ``compact_evidence`` tuple."""
        row = self.rows[index]
        return _EVIDENCE_OF(row) if self._by_attribute else compact_evidence(row)

    def inconsistent(self) -> np.ndarray:
        """Rows breaking the cross-field rules of ``RequestLog`` (NaN compares False: missing is fine)."""
        return (self.column("cached_tokens") > self.column("prompt_tokens")) | (
            self.column("ttft_s") > self.column("e2e_s") + 1e-3
        )

    def without(self, drop: np.ndarray) -> RowBatch:
        keep = np.flatnonzero(~drop)
        kept = RowBatch([self.rows[i] for i in keep.tolist()])
        kept._columns = {name: values[keep] for name, values in self._columns.items()}
        return kept


_EVIDENCE_OF = attrgetter(*EVIDENCE_FIELDS)


def evidence_from_row(row: RequestLogRow | dict[str, Any] | tuple[Any, ...]) -> dict[str, Any]:
    """What a person needs to find the request in their own log store; never prompt or answer text.

    Accepts a row, an evidence dict (idempotent) or a ``compact_evidence`` tuple.
    """
    source: Any = dict(zip(EVIDENCE_FIELDS, row, strict=True)) if isinstance(row, tuple) else row
    record = {name: source[name] for name in EVIDENCE_FIELDS if source.get(name) is not None}
    record["finish_reason"] = normalise_reason(source["finish_reason"])
    return record


def compact_evidence(row: Mapping[str, Any]) -> tuple[Any, ...]:
    """The evidence fields' values only: what an open window keeps (a fraction of the row's memory)."""
    get = row.get
    return tuple(get(name) for name in EVIDENCE_FIELDS)
