"""Learned state as a run of doubles in a buffer that many models may share.

A worker holds thousands of segments, each with up to a dozen small models. As Python
objects (a model, its floats, its array, the segment's dict of models) they cost about
twice their numbers. So a model keeps its learned state at ``_at`` in ``_buf``, an
``array('d')``: its own when built alone (``learn_one`` on a fresh model just works), or
the segment's, holding every model of the segment one after the other
(``SegmentDetectors``). The segment then keeps no model objects at all: when a window is
judged it makes a short-lived ``view`` of each model on its buffer, sharing the
constructor arguments of a template (``models.stats.params``).

>>> from servewatch.models.stats.rates import BetaBinomialRate
>>> from array import array
>>> alone = BetaBinomialRate(prior_rate=0.01)
>>> shared = array("d", [7.0])  # another model's numbers come first
>>> view = alone.view(shared, alone.append_to(shared))
>>> view.learn_one({"trials": 100}, 3)
>>> shared[0], view.n_learned, round(view.expected_rate, 3), alone.n_learned
(7.0, 1, 0.023, 0)
"""

from __future__ import annotations

from array import array
from typing import Any, ClassVar, Self


def number(index: int) -> Any:
    """A float property stored at ``index`` of the model's run of doubles."""

    def get(model: CompactState) -> float:
        return model._buf[model._at + index]

    def put(model: CompactState, value: float) -> None:
        model._buf[model._at + index] = value

    return property(get, put, doc=f"Learned number {index} of the model's state.")


def count(index: int) -> Any:
    """An int property stored (exactly, below 2**53) as a double at ``index``."""

    def get(model: CompactState) -> int:
        return int(model._buf[model._at + index])

    def put(model: CompactState, value: int) -> None:
        model._buf[model._at + index] = value

    return property(get, put, doc=f"Learned count {index} of the model's state.")


class CompactState:
    """Base of models whose learned state is ``STATE_SIZE`` doubles at ``_at`` in ``_buf``.

    Subclasses set ``STATE_SIZE``, fill their state with ``_own`` in ``__init__``, and keep
    their constructor arguments in ``_params`` (shared, see ``models.stats.params``).
    """

    __slots__ = ("_at", "_buf", "_params")
    STATE_SIZE: ClassVar[int]

    _params: Any

    def _own(self, values: list[float]) -> None:
        if len(values) != self.STATE_SIZE:
            raise ValueError(f"{type(self).__name__} keeps {self.STATE_SIZE} numbers, got {len(values)}")
        self._buf, self._at = array("d", values), 0

    @property
    def numbers(self) -> list[float]:
        """The learned state, as plain floats (a copy)."""
        return self._buf[self._at : self._at + self.STATE_SIZE].tolist()

    def _set_numbers(self, start: int, values: list[float]) -> None:
        """Overwrite the state from ``start`` on; never changes the buffer's length."""
        end = self._at + start + len(values)
        if start < 0 or end > self._at + self.STATE_SIZE:
            raise IndexError("state write out of the model's range")
        self._buf[self._at + start : end] = array("d", values)

    def append_to(self, buffer: array[float]) -> int:
        """Copy the state to the end of ``buffer``; returns where it starts there."""
        at = len(buffer)
        buffer.extend(self._buf[self._at : self._at + self.STATE_SIZE])
        return at

    def view(self, buffer: array[float], at: int) -> Self:
        """A model with this one's constructor arguments whose state is at ``at`` in ``buffer``."""
        other = object.__new__(type(self))
        other._params, other._buf, other._at = self._params, buffer, at
        return other
