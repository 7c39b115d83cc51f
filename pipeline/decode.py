"""Bytes from the requests topic -> validated ``RequestLog``s, and ``DeadLetter``s for the rest.

A message may carry one record (a JSON object), a batch (a JSON array) or NDJSON lines:
shippers batch hundreds of records per message because a worker pays per message. One bad
record in a batch costs only that record: it becomes a dead letter with its position and
reason, and the rest of the batch is used. Nothing here raises on bad input.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import ValidationError

from schemas.dead_letter import DeadLetter
from schemas.request_log import RequestLog

RAW_KEEP_BYTES = 64 * 1024


@dataclass
class Source:
    """Where a message came from, for dead letters and replay de-duplication."""

    topic: str | None = None
    partition: int | None = None
    offset: int | None = None


@dataclass
class Decoded:
    records: list[RequestLog] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)


def _dead_letter(reason: str, error: str, raw: bytes, source: Source, index: int | None = None) -> DeadLetter:
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


def internal_error(raw: bytes | None, source: Source, exc: Exception) -> DeadLetter:
    """A message that broke servewatch itself: kept, with the bug's message, for a retry after a fix."""
    return _dead_letter("internal_error", f"{type(exc).__name__}: {exc}", raw or b"", source)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "record"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _as_bytes(item: Any) -> bytes:
    """The item re-serialised for its dead letter; never raises (orjson stops at depth 254)."""
    try:
        return orjson.dumps(item)
    except (orjson.JSONEncodeError, TypeError):
        return repr(item)[:RAW_KEEP_BYTES].encode("utf-8", errors="replace")


def _validate(item: Any, raw: bytes | None, source: Source, index: int | None, out: Decoded) -> None:
    """Append a record or a dead letter. ``raw`` None: re-serialise the item, only if rejected."""
    if not isinstance(item, dict):
        reason, error = "not_an_object", f"expected a JSON object, got {type(item).__name__}"
    else:
        try:
            out.records.append(RequestLog.model_validate(item))
            return
        except ValidationError as exc:
            reason, error = "validation", _describe(exc)
    out.dead_letters.append(_dead_letter(reason, error, _as_bytes(item) if raw is None else raw, source, index))


def decode_message(raw: bytes | None, source: Source | None = None, max_bytes: int = 8 * 1024 * 1024) -> Decoded:
    """Decode one message: a JSON object, a JSON array of objects, or NDJSON."""
    source = source or Source()
    out = Decoded()
    if not raw:
        out.dead_letters.append(_dead_letter("empty", "empty message", b"", source))
        return out
    if len(raw) > max_bytes:
        out.dead_letters.append(
            _dead_letter("too_large", f"message of {len(raw)} bytes exceeds {max_bytes}", raw, source)
        )
        return out
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        lines = [line for line in raw.split(b"\n") if line.strip()]
        if len(lines) <= 1:
            out.dead_letters.append(_dead_letter("invalid_json", str(exc), raw, source))
            return out
        for index, line in enumerate(lines):  # NDJSON: each line on its own
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError as line_exc:
                out.dead_letters.append(_dead_letter("invalid_json", str(line_exc), line, source, index))
                continue
            _validate(item, line, source, index, out)
        return out
    if isinstance(value, list):
        for index, item in enumerate(value):
            _validate(item, None, source, index, out)
        return out
    _validate(value, raw, source, None, out)
    return out
