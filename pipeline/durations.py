"""Durations as people write them, one parser for every flag and config file.

Prometheus's form (``30s``, ``5m``, ``1h30m``, ``250ms``, ``7d``) or plain seconds: ``ship
--linger 1h30m`` reads as ``silence add --duration 1h30m`` and a notifier's ``group_wait``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def seconds_of(value: Any) -> Any:
    """``value`` in seconds when it is a string; anything else as it is (pydantic checks it).

    >>> seconds_of("1h30m"), seconds_of("250ms"), seconds_of(" 10s "), seconds_of("2.5"), seconds_of(12)
    (5400.0, 0.25, 10.0, 2.5, 12)
    """
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if not text or _DURATION.sub("", text):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{value!r} is not a duration (e.g. 30s, 5m, 4h, 1h30m)") from None
    return sum(float(number) * _UNITS[unit] for number, unit in _DURATION.findall(text))


def parse_duration(text: str) -> float:
    """A duration flag's text in seconds; ``ValueError`` saying how to write one."""
    return float(seconds_of(text))


#: A config field holding a duration (seconds, or the text form).
Duration = Annotated[float, BeforeValidator(seconds_of), Field(ge=0)]
