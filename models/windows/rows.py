"""Reading a request log's fields whatever form it has here.

Rows reach ``models`` as mappings (tests, JSON) or as objects with attributes (the hot
path's msgspec Structs); code that reads a few fields of one row takes either.

>>> field_getter({"model": "m"})("model"), field_getter(object())("model")
('m', None)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def field_getter(row: Any) -> Callable[[str], Any]:
    """A function of a field name giving ``row``'s value of it (None when it has none)."""
    if isinstance(row, Mapping):
        return row.get
    return lambda name: getattr(row, name, None)
