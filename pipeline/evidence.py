"""Reading evidence back: the request logs a firing event points at, from where they are.

Windows keep their slowest requests by location only (``models.open_window``): a live
segment then costs a few bytes of evidence, not a few kilobytes of request fields. When an
event fires, its evidence pointers (``{"ttft_s", "location"}``) are filled in here with the
records' evidence fields (and scrubbed answer excerpts), read back from the requests topic (``KafkaMessageReader``) or,
in a replay, from the replayed file. A record that can no longer be read (retention ran
out, the embedded broker was restarted) stays a pointer with ``"unavailable": true``: the
event still says where to look.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from models.batch import evidence_from_row
from models.faulty_requests import shows_fault
from models.hints import mention_max_tokens
from pipeline.decode import Source, decode_message
from schemas.anomaly import AnomalyEvent, Signal

logger = logging.getLogger(__name__)

MessageKey = tuple[int, int]  # (partition, offset)


#: Messages of a window read back for one rate event's scan: enough to find a few of the
#: requests it counted (each message holds hundreds, from every segment), few enough that
#: a firing event costs milliseconds.
SCAN_MESSAGES = 16
#: Requests a scan keeps as evidence.
SCAN_KEEP = 5


def scanned(sources: Iterable[Sequence[int]], budget: int = SCAN_MESSAGES) -> list[MessageKey]:
    """The messages a scan reads: the first of each source's offset range, in turn, up to ``budget``."""
    ranges = [(int(p), int(first), int(last)) for p, first, last in sources]
    picked: list[MessageKey] = []
    step = 0
    while len(picked) < budget and any(first + step <= last for _, first, last in ranges):
        for partition, first, last in ranges:
            if first + step <= last and len(picked) < budget:
                picked.append((partition, first + step))
        step += 1
    return picked


def wanted(events: Iterable[AnomalyEvent]) -> set[MessageKey]:
    """The messages holding the requests these events point at, or that their scans read."""
    keys: set[MessageKey] = set()
    for event in events:
        for record in event.evidence:
            if "scan" in record:
                keys.update(scanned(record["sources"]))
            elif "location" in record and "request_id" not in record:
                keys.add((record["location"]["partition"], record["location"]["offset"]))
    return keys


def fill(
    events: Iterable[AnomalyEvent],
    messages: Mapping[MessageKey, bytes | None],
    excerpt_chars: int = 0,
    markers: Sequence[str] = (),
    segment_of: Callable[[Any], str] | None = None,
) -> None:
    """Replace each event's evidence pointers by the records they point at (in place), with
    scrubbed answer excerpts of at most ``excerpt_chars`` (0: none; see ``models.excerpt``).

    A scan (a rate event's) becomes the first ``SCAN_KEEP`` requests of its segment
    (``segment_of(row)``, the segmenter's key before the cap) in the messages read that
    show its fault; without ``segment_of`` it is dropped.
    """
    rows_of: dict[MessageKey, dict[int, Any]] = {}

    def rows(key: MessageKey) -> dict[int, Any]:
        if key not in rows_of:
            rows_of[key] = _rows_by_position(messages.get(key), key)
        return rows_of[key]

    for event in events:
        filled = []
        for record in event.evidence:
            if "scan" in record:
                if segment_of is not None:
                    filled.extend(_scan(record, rows, excerpt_chars, markers, segment_of))
                continue
            location = record.get("location")
            if location is None or "request_id" in record:
                filled.append(record)
                continue
            row = rows((location["partition"], location["offset"])).get(location["index"])
            if row is None:
                filled.append({**record, "unavailable": True})
            else:
                filled.append({**evidence_from_row(row, excerpt_chars, markers), "location": location})
        event.evidence = filled
        mention_max_tokens(event)  # what the evidence adds to its hint


def _scan(
    pointer: dict[str, Any],
    rows: Callable[[MessageKey], dict[int, Any]],
    excerpt_chars: int,
    markers: Sequence[str],
    segment_of: Callable[[Any], str],
) -> list[dict[str, Any]]:
    signal, segment = Signal(pointer["scan"]), pointer["segment"]
    found: list[dict[str, Any]] = []
    for partition, offset in scanned(pointer["sources"]):
        for index, row in rows((partition, offset)).items():
            if shows_fault(signal, row, markers) and segment_of(row) == segment:
                location = {"partition": partition, "offset": offset, "index": index}
                found.append({**evidence_from_row(row, excerpt_chars, markers), "location": location})
                if len(found) == SCAN_KEEP:
                    return found
    return found


def _rows_by_position(raw: bytes | None, key: MessageKey) -> dict[int, Any]:
    if raw is None:
        return {}
    decoded = decode_message(raw, Source(partition=key[0], offset=key[1]), max_bytes=len(raw) + 1)
    batch = decoded.rows()
    return dict(zip(batch.positions.tolist(), batch.rows, strict=True))


async def resolve(
    events: list[AnomalyEvent],
    read: Callable[[set[MessageKey]], Awaitable[dict[MessageKey, bytes]]],
    excerpt_chars: int = 0,
    markers: Sequence[str] = (),
    segment_of: Callable[[Any], str] | None = None,
) -> None:
    """Fill in the evidence of ``events`` with messages from ``read`` (never raises)."""
    keys = wanted(events)
    if not keys:
        return
    try:
        messages = await read(keys)
    except Exception:  # evidence is worth a retry, never an event
        logger.exception("could not read evidence back from %d messages", len(keys))
        messages = {}
    fill(events, messages, excerpt_chars, markers, segment_of)


class KafkaMessageReader:
    """Reads single messages of a topic by (partition, offset), with its own group-less consumer.

    Started on first use and kept: an incident fires a handful of events, each pointing at
    up to ``evidence_k`` messages.
    """

    def __init__(self, bootstrap: str, topic: str, max_message_bytes: int, timeout_s: float = 1.0) -> None:
        self.bootstrap, self.topic, self.timeout_s = bootstrap, topic, timeout_s
        self.max_fetch = max_message_bytes + 65_536
        self._consumer: AIOKafkaConsumer | None = None

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                group_id=None,
                enable_auto_commit=False,
                fetch_max_bytes=self.max_fetch,
                max_partition_fetch_bytes=self.max_fetch,
                fetch_max_wait_ms=10,
            )
            await consumer.start()
            self._consumer = consumer
        return self._consumer

    async def read(self, keys: set[MessageKey]) -> dict[MessageKey, bytes]:
        consumer = await self._started()
        found: dict[MessageKey, bytes] = {}
        for partition, offset in sorted(keys):
            # One partition at a time: records prefetched for another assigned partition
            # would hold the fetcher back (aiokafka's prefetch backoff).
            tp = TopicPartition(self.topic, partition)
            if consumer.assignment() != {tp}:
                consumer.assign([tp])
            consumer.seek(tp, offset)
            batches = await consumer.getmany(tp, timeout_ms=int(self.timeout_s * 1000), max_records=1)
            for message in batches.get(tp, []):
                if message.offset == offset and message.value is not None:
                    found[(partition, offset)] = message.value
        return found

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
