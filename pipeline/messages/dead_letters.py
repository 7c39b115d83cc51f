"""Dead letters: a record or message servewatch could not use, kept with where it came
from and why, so that nothing is lost and a fix can replay it."""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import ValidationError

from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.schemas.dead_letter import DeadLetter

#: How much of a refused message a dead letter keeps.
RAW_KEEP_BYTES = 64 * 1024


def dead_letter(reason: str, error: str, raw: bytes, source: MessageOrigin, index: int | None = None) -> DeadLetter:
    return DeadLetter(
        reason=reason,
        error=error[:2000],
        raw=raw[:RAW_KEEP_BYTES].decode("utf-8", errors="replace"),
        raw_truncated=len(raw) > RAW_KEEP_BYTES,
        source_topic=source.topic,
        source_partition=source.partition,
        source_offset=source.offset,
        record_index=index,
        received_at=time.time(),
    )


def row_letter(reason: str, error: str, row: Any, source: MessageOrigin, index: int | None) -> DeadLetter:
    """A dead letter for a row that passed validation but breaks a rule of the stream
    (a timestamp too far in the future): its fields as JSON."""
    fields = row.to_row() if hasattr(row, "to_row") else dict(row)
    return dead_letter(reason, error, orjson.dumps(fields), source, index)


def internal_error(raw: bytes | None, source: MessageOrigin, exc: Exception) -> DeadLetter:
    """A message that broke servewatch itself: kept, with the bug's message, for a retry after a fix."""
    return dead_letter("internal_error", f"{type(exc).__name__}: {exc}", raw or b"", source)


def summarise_validation_error(exc: ValidationError) -> str:
    """A validation failure in one line, for a dead letter: the first five fields and why."""
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "record"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def why_unreadable(exc: ValueError) -> str:
    """A record's failure to read, in one line, for its dead letter."""
    return summarise_validation_error(exc) if isinstance(exc, ValidationError) else str(exc)[:500]
