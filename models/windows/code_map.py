"""A map from integer codes to segment ids, looked up a whole column at a time.

The segmenter mixes a request's label codes and length bands into one int64 (``Segmenter.
ids_for_columns``). A dense table indexed by that code costs 4 bytes for every code that
*could* occur: the product of every dimension's distinct values, most of which no request
ever has (tenants times routes times instances). This map holds only the codes met: two
sorted arrays, 12 bytes a code, and one ``searchsorted`` per column.

>>> import numpy as np
>>> known = CodeMap()
>>> known.add({40: 0, 7: 1})
>>> known.lookup(np.array([7, 40, 8, 7])).tolist()
[1, 0, -1, 1]
>>> known.forget(1)
>>> known.lookup(np.array([7, 40])).tolist(), len(known)
([-1, 0], 1)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

#: What ``lookup`` gives for a code not met (no segment id is negative).
UNKNOWN = -1


class CodeMap:
    """Codes met so far and their ids, kept sorted by code."""

    __slots__ = ("_codes", "_ids")

    def __init__(self) -> None:
        self._codes = np.empty(0, dtype=np.int64)
        self._ids = np.empty(0, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._codes)

    @property
    def nbytes(self) -> int:
        return self._codes.nbytes + self._ids.nbytes

    def lookup(self, codes: np.ndarray) -> np.ndarray:
        """The id of each code (int32), ``UNKNOWN`` where the code was not met."""
        if not len(self._codes):
            return np.full(len(codes), UNKNOWN, dtype=np.int32)
        at = np.searchsorted(self._codes, codes)
        np.minimum(at, len(self._codes) - 1, out=at)
        return np.where(self._codes[at] == codes, self._ids[at], np.int32(UNKNOWN))

    def add(self, ids_of: Mapping[int, int]) -> None:
        """Remember each code's id (codes not met before: new combinations are rare, so the
        arrays are sorted again as a whole)."""
        if not ids_of:
            return
        codes = np.concatenate((self._codes, np.fromiter(ids_of.keys(), dtype=np.int64, count=len(ids_of))))
        ids = np.concatenate((self._ids, np.fromiter(ids_of.values(), dtype=np.int32, count=len(ids_of))))
        order = np.argsort(codes, kind="stable")
        self._codes, self._ids = codes[order], ids[order]

    def forget(self, segment_id: int) -> None:
        """Drop every code of ``segment_id`` (its id went to another segment)."""
        kept = self._ids != segment_id
        if not kept.all():
            self._codes, self._ids = self._codes[kept], self._ids[kept]

    def clear(self) -> None:
        """Forget every code (the codes were mixed with other radices)."""
        self._codes = np.empty(0, dtype=np.int64)
        self._ids = np.empty(0, dtype=np.int32)
