"""Bytes from the requests topic -> validated rows (``FastRow`` Structs), and ``DeadLetter``s.

A message may carry one record (a JSON object), a batch (a JSON array) or NDJSON lines;
runs of one-record messages are validated together (``decode_records``). One bad
record in a batch costs only that record: it becomes a dead letter with its position and
reason, and the rest of the batch is used. Nothing here raises on bad input.

Fast path: a clean JSON array (or NDJSON) is parsed and validated in one call, in C
(msgspec, see ``pipeline.messages.fast_rows``), faster than parsing it into dicts. Anything else,
or a message with a bad record, takes the careful path: item by item, with ``RequestLog``
(the authoritative model) judging what the fast validator refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import orjson
from pydantic import ValidationError

from servewatch.models.windows.batch import RowBatch
from servewatch.pipeline.messages.dead_letters import RAW_KEEP_BYTES, dead_letter, summarise_validation_error
from servewatch.pipeline.messages.fast_rows import FastRow, decode_array, decode_lines
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.incident_group import parse_anomaly_record
from servewatch.schemas.request_log import RequestLog, cached_exceeds_prompt, ttft_exceeds_e2e


@dataclass
class Decoded:
    accepted: list[FastRow] = field(default_factory=list)
    # Position in the message of each row accepted one by one (the careful path); the fast
    # path's rows carry theirs in ``batch``.
    positions: list[int] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    batch: RowBatch | None = None  # the fast path's rows with their columns, when it applied

    def rows(self) -> RowBatch:
        """The accepted rows as a ``RowBatch`` (columns already extracted on the fast path)."""
        if self.batch is not None:
            return self.batch
        return RowBatch(self.accepted, np.array(self.positions, dtype=np.int64))

    def accept(self, row: FastRow, position: int | None) -> None:
        self.accepted.append(row)
        self.positions.append(position or 0)

    @property
    def records(self) -> list[dict[str, Any]]:
        """The accepted rows as plain dicts (for people and tests; the hot path reads ``rows()``)."""
        return [row.to_row() for row in self.accepted]


def _as_bytes(item: Any) -> bytes:
    """The item re-serialised for its dead letter; never raises (orjson stops at depth 254)."""
    try:
        return orjson.dumps(item)
    except (orjson.JSONEncodeError, TypeError):
        return repr(item)[:RAW_KEEP_BYTES].encode("utf-8", errors="replace")


def _inconsistent(row: FastRow) -> bool:
    """The cross-field rules ``RequestLog`` enforces and a Struct cannot express."""
    cached, ttft = row.cached_tokens, row.ttft_s
    return bool(
        (cached is not None and cached_exceeds_prompt(cached, row.prompt_tokens))
        or (ttft is not None and ttft_exceeds_e2e(ttft, row.e2e_s))
    )


def _validate(item: Any, raw: bytes | None, source: MessageOrigin, index: int | None, out: Decoded) -> None:
    """Append a row or a dead letter. ``raw`` None: re-serialise the item, only if rejected."""
    if not isinstance(item, dict):
        reason, error = "not_an_object", f"expected a JSON object, got {type(item).__name__}"
    else:
        try:
            row = msgspec.convert(item, FastRow)
            if not _inconsistent(row):
                out.accept(row, index)
                return
        except msgspec.ValidationError:
            pass
        try:  # the authoritative model: accepts what the fast one may not (ISO timestamps...)
            out.accept(FastRow(**RequestLog.model_validate(item).to_row()), index)
            return
        except ValidationError as exc:
            reason, error = "validation", summarise_validation_error(exc)
    out.dead_letters.append(dead_letter(reason, error, _as_bytes(item) if raw is None else raw, source, index))


def _fast(raw: bytes, lines: bool, source: MessageOrigin, out: Decoded) -> bool:
    """The whole message validated in one call; False when any item needs the careful path."""
    try:
        rows = decode_lines(raw) if lines else decode_array(raw)
    except msgspec.DecodeError:  # also raised for a value that breaks a rule
        return False
    batch = RowBatch(rows)
    bad = batch.inconsistent()
    if bad.any():
        for index in np.flatnonzero(bad).tolist():
            # RequestLog enforces the same two rules: it words the reason of a dead letter.
            _validate(rows[index].to_row(), None, source, index, out)
        batch = batch.without(bad)
    out.accepted.extend(batch.rows)
    out.batch = batch
    return True


def decode_message(raw: bytes | None, source: MessageOrigin | None = None, max_bytes: int = 8 * 1024 * 1024) -> Decoded:
    """Decode one message: a JSON object, a JSON array of objects, or NDJSON."""
    source = source or MessageOrigin()
    out = Decoded()
    if not raw:
        out.dead_letters.append(dead_letter("empty", "empty message", b"", source))
        return out
    if len(raw) > max_bytes:
        out.dead_letters.append(
            dead_letter("too_large", f"message of {len(raw)} bytes exceeds {max_bytes}", raw, source)
        )
        return out
    head = raw.lstrip()[:1]
    # One object or NDJSON (newlines only separate records in JSON), or an array.
    if head in (b"[", b"{") and _fast(raw, head == b"{", source, out):
        return out
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        lines = [line for line in raw.split(b"\n") if line.strip()]
        if len(lines) <= 1:
            out.dead_letters.append(dead_letter("invalid_json", str(exc), raw, source))
            return out
        for index, line in enumerate(lines):  # NDJSON: each line on its own
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError as line_exc:
                out.dead_letters.append(dead_letter("invalid_json", str(line_exc), line, source, index))
                continue
            _validate(item, line, source, index, out)
        return out
    if isinstance(value, list):
        for index, item in enumerate(value):
            _validate(item, None, source, index, out)
        return out
    _validate(value, raw, source, None, out)
    return out


def one_record_line(raw: bytes | None) -> bool:
    """Whether ``raw`` is a message holding one JSON object on one line (what most log
    shippers send; a trailing newline allowed): such messages joined with newlines are
    NDJSON. A raw newline inside JSON is whitespace between tokens, never inside a string."""
    if not raw or raw[0] != 0x7B:  # "{"
        return False
    newline = raw.find(b"\n")
    return newline < 0 or newline == len(raw) - 1


def decode_records(lines: Sequence[bytes]) -> RowBatch | None:
    """One-record messages (each ``one_record_line``) validated in one call, as one row per
    message in order; None when any of them needs the careful path (``decode_message``,
    message by message), which words each bad record's dead letter.

    A worker fed one record per message pays per message: this is what lets it read them at
    the consumer's pace rather than at the pace of one decode call per message.
    """
    try:
        rows = decode_lines(b"\n".join(lines))
    except msgspec.DecodeError:
        return None
    if len(rows) != len(lines):
        return None
    batch = RowBatch(rows, np.zeros(len(rows), dtype=np.int64))
    return None if batch.inconsistent().any() else batch


def read_incident_event(raw: bytes) -> AnomalyEvent:
    """An incident event off the incidents topic (fields of a newer minor version ignored);
    ``ValueError`` (a ``ValidationError`` among them) when the record is not one."""
    record = parse_anomaly_record(raw)
    if not isinstance(record, AnomalyEvent):
        raise ValueError(f"a {record.kind} record where an incident event was expected")
    return record
