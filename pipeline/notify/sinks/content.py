"""What a message says, whichever receiver shows it: the lead incident's figures, labels and
requests as plain text.

Slack, PagerDuty and Alertmanager word the same facts; wording them once here keeps the
three from drifting apart. Everything returned is raw text: escaping for a receiver's
markup is the receiver module's job (``slack_blocks.escape_mrkdwn``).

>>> segment_text({"model": "llama-70b", "route": "chat", "prompt_band": "1k-4k"})
'route=chat, prompt_band=1k-4k'
>>> load_text({"requests_per_s": 12.34, "prompt_tokens_per_s": 45210.0, "demand_vs_usual": 1.8})
'12.3 req/s, 45,210 prompt tok/s, demand 1.8× usual'
>>> duration_text(45), duration_text(330), duration_text(7500)
('45 s', '6 min', '2 h 5 min')
>>> rfc3339(1767225620.5)
'2026-01-01T00:00:20.500Z'
>>> clip("fish &amp; chips", 8)
'fish…'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from servewatch.models.detect.signals import BY_SIGNAL
from servewatch.models.explain.wording import with_unit
from servewatch.schemas.anomaly import Hint, Signal

#: Evidence rows a message shows: a person looks up a few requests, not a window's worth.
EVIDENCE_ROWS = 3
#: The rows worth a look first: the worst of the anomalous window by the event's signal.
_TELLING = ("slowest", "faulty")
_TIMINGS = (
    ("ttft_s", "ttft"),
    ("queue_s", "queue"),
    ("prefill_s", "prefill"),
    ("decode_s", "decode"),
    ("e2e_s", "e2e"),
)
_LOAD = (
    ("requests_per_s", "{:,.1f} req/s"),
    ("prompt_tokens_per_s", "{:,.0f} prompt tok/s"),
    ("output_tokens_per_s", "{:,.0f} output tok/s"),
)
#: Where a quote of the answer sits in a row (``models.windows.batch.evidence_from_row``).
_EXCERPTS = ("content_excerpt", "reasoning_excerpt", "excerpt")


def segment_text(segment: Mapping[str, str]) -> str:
    """The segment's labels as ``name=value``; the model is told on its own, so it is left out."""
    return ", ".join(f"{name}={value}" for name, value in segment.items() if name != "model") or "whole model"


def figure(signal: Signal, value: float) -> str:
    """A signal's value in its unit (``1.84 s``, ``12.50%``), as the events' summaries word it."""
    spec = BY_SIGNAL.get(signal)
    return f"{value:,.4g}" if spec is None else with_unit(value, spec.unit)


def load_text(load: Mapping[str, float]) -> str:
    """The window's load in a few figures: requests/s, tokens/s and demand against usual."""
    parts = [shape.format(load[name]) for name, shape in _LOAD if name in load]
    if "demand_vs_usual" in load:
        parts.append(f"demand {load['demand_vs_usual']:.1f}× usual")
    return ", ".join(parts) or "not measured"


def duration_text(seconds: float) -> str:
    """How long an incident lasted, as a person would say it."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60} min"


def hint_text(hint: Hint) -> str:
    return f"{hint.code}: {hint.message}"


def pick_evidence(rows: Sequence[Mapping[str, Any]], limit: int = EVIDENCE_ROWS) -> list[Mapping[str, Any]]:
    """At most ``limit`` rows: the window's worst first, then the other readable ones, then
    pointers that could not be read back (they still say where to look)."""

    def rank(row: Mapping[str, Any]) -> int:
        if row.get("unavailable"):
            return 2
        return 0 if row.get("sample") in _TELLING else 1

    return sorted(rows, key=rank)[:limit]  # sorted() is stable: the worker's order within a rank


def excerpt_of(row: Mapping[str, Any]) -> str | None:
    return next((str(row[name]) for name in _EXCERPTS if row.get(name)), None)


def evidence_line(row: Mapping[str, Any]) -> str:
    """One request in one line: what to search one's own logs for, and why it stands out.

    >>> evidence_line({"request_id": "r-9", "ttft_s": 4.2, "prompt_tokens": 3812, "completion_tokens": 256,
    ...                "finish_reason": "stop", "sample": "slowest"})
    'r-9: ttft 4.20 s, 3,812 prompt → 256 completion tokens, stop (slowest)'
    """
    where = row.get("location")
    if row.get("unavailable"):
        spot = f"partition {where.get('partition')} offset {where.get('offset')}" if isinstance(where, dict) else "?"
        return f"{row.get('request_id', 'request')} at {spot}: no longer readable"
    parts = [f"{label} {with_unit(float(row[name]), 's')}" for name, label in _TIMINGS if _number(row.get(name))]
    if _number(row.get("prompt_tokens")):
        cached = f" ({row['cached_tokens']:,} cached)" if _number(row.get("cached_tokens")) else ""
        done = f" → {row['completion_tokens']:,} completion" if _number(row.get("completion_tokens")) else ""
        parts.append(f"{row['prompt_tokens']:,} prompt{cached}{done} tokens")
    parts += [str(row[name]) for name in ("finish_reason", "status_code") if row.get(name) is not None]
    if row.get("instance"):
        parts.append(f"on {row['instance']}")
    line = f"{row.get('request_id', 'request')}: {', '.join(parts)}"
    if row.get("sample"):
        line += f" ({row['sample']})"
    quote = excerpt_of(row)
    return f"{line} “{quote}”" if quote else line


def clip(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, "…" marking a cut; never inside an entity
    (``&amp;``) of text escaped for Slack, where half of one would show as such."""
    if len(text) <= limit:
        return text
    kept = text[: limit - 1]
    amp = kept.rfind("&", max(len(kept) - 4, 0))  # "&amp" is the longest start of an entity
    if amp >= 0 and ";" not in kept[amp:]:
        kept = kept[:amp]
    return kept.rstrip() + "…"


def rfc3339(seconds: float) -> str:
    """Unix seconds as RFC 3339 in UTC with milliseconds (ISO 8601 as well)."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
