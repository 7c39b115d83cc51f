"""How events read: the segment, the values, and an event's stable id (``models.detect.summary``
words a judged window's sentence)."""

from __future__ import annotations

import hashlib


def segment_phrase(labels: dict[str, str]) -> str:
    rest = [
        f"{name.replace('_band', '')} {value}" for name, value in labels.items() if name != "model" and value != "-"
    ]
    return f"model {labels.get('model', 'other')}" + (f" ({', '.join(rest)})" if rest else "")


def event_id(fp: str, status: str, window_start: float) -> str:
    return hashlib.blake2b(f"{fp}|{status}|{window_start:.3f}".encode(), digest_size=12).hexdigest()


def with_unit(value: float, unit: str) -> str:
    if unit == "":  # a share: enough digits that a small usual rate is not shown as 0
        return f"{value:.3%}" if 0 < value < 0.001 else f"{value:.2%}"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:,.1f} {unit}"
