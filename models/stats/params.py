"""Constructor arguments shared by every model built with the same ones.

Thousands of segments each hold a dozen models; a model's constructor arguments are its
config (river's convention), and they are almost always the same for every segment. So a
model keeps them in one interned named tuple (``shared``), reads them through properties
(``param``), and stores only its learned state in slots.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, TypeVar

T = TypeVar("T")


@functools.lru_cache(maxsize=1024)
def shared(params_type: type[T], *values: Any) -> T:
    """The one instance of ``params_type(*values)`` (values must be hashable)."""
    return params_type(*values)


def param(name: str) -> Any:
    """A read-only property for constructor argument ``name``, read from ``self._params``.

    Its getter is an ``attrgetter``: arguments are read many times per judged window, and a
    Python function as the getter costs half as much again (about 95 ns a read against 60)."""
    return property(operator.attrgetter(f"_params.{name}"), doc=f"Constructor argument ``{name}``.")
