"""Reading evidence back: the request logs a firing event points at, from where they are.

Windows keep their slowest requests by location only (``models.windows.open_window``): a live
segment then costs a few bytes of evidence, not a few kilobytes of request fields. When an
event fires, its pointers (``schemas.evidence_pointer``) are replaced here by the requests
they point at, read back from the requests topic (``KafkaMessageReader``) or, in a replay,
from the replayed file; each evidence row says which ``sample`` it is:

- ``KeptRequest``: one of the window's slowest requests (``"slowest"``);
- ``WorstBy``: the slowest by that phase of the window sample below (``"slowest"``);
- ``FaultScan``: a rate event's requests that show its fault, found in the window sample
  below (``"faulty"``; ``models.explain.faulty_requests``);
- ``WindowSample``: the segment's requests of a window (the anomalous one, or its latest
  normal one) in messages spread over it (``models.explain.evidence_sample``): a uniform pick
  of them (``"uniform"``, ``"baseline"``) and the event's ``facets`` (``models.explain.facets``).

A kept request that can no longer be read (retention ran out, the embedded broker was
restarted) stays a row with its place and ``"unavailable": true``: the event still says
where to look.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from servewatch.models.explain.evidence_sample import EvidenceBudget, MessageKey, location_key, spread, uniform_pick
from servewatch.models.explain.facets import compare, window_facets
from servewatch.models.explain.faulty_requests import shows_fault, slowness
from servewatch.models.explain.hints import mention_engine_versions, mention_max_tokens
from servewatch.models.windows.batch import evidence_from_row
from servewatch.models.windows.rows import field_getter
from servewatch.pipeline.kafka import PLAINTEXT, KafkaAuth
from servewatch.pipeline.messages.decode import decode_message
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.schemas.anomaly import AnomalyEvent, Facets, Signal
from servewatch.schemas.evidence_pointer import FaultScan, KeptRequest, WindowSample, WorstBy

logger = logging.getLogger(__name__)

DEFAULT_BUDGET = EvidenceBudget()


def wanted(events: Iterable[AnomalyEvent]) -> set[MessageKey]:
    """The messages holding the requests these events point at, or that their samples read."""
    keys: set[MessageKey] = set()
    for event in events:
        for pointer in event.pointers:
            if isinstance(pointer, WindowSample):
                keys.update(spread(pointer.sources or ()))
            elif isinstance(pointer, KeptRequest):
                keys.add((pointer.location.partition, pointer.location.offset))
    return keys


#: A request log read back, with where it is.
Located = tuple[dict[str, int], Any]


def fill(
    events: Iterable[AnomalyEvent],
    messages: Mapping[MessageKey, bytes | None],
    budget: EvidenceBudget = DEFAULT_BUDGET,
    segment_of: Callable[[Any], str] | None = None,
) -> list[AnomalyEvent]:
    """The events with their evidence pointers replaced by the records they point at, their
    facets set, and what the evidence adds to their hints. Scans and window samples keep the requests of their segment
    (``segment_of(row)``, the segmenter's key before the cap); without ``segment_of`` they
    are dropped."""
    read = ReadBack(messages, segment_of)
    filled = []
    for event in events:
        if not event.pointers:  # nothing to read back: an engine's event, or one filled already
            filled.append(event)
            continue
        samples = _window_samples(event, read)
        worst = _worst(event, read, budget, samples)
        shown = {location_key(r["location"]) for r in worst if "location" in r}
        evidence = worst + _picks(event, samples, budget, shown)
        event = event.model_copy(update={"evidence": evidence, "facets": _facets(samples), "pointers": ()})
        filled.append(mention_engine_versions(mention_max_tokens(event)))  # what the evidence adds to its hints
    return filled


def _window_samples(event: AnomalyEvent, read: ReadBack) -> dict[str, tuple[float, list[Located]]]:
    """The event's window samples ("anomalous", "baseline"): window start and requests read back."""
    if read.segment_of is None:
        return {}
    return {
        pointer.sample: (pointer.window_start, _window_rows(pointer, read))
        for pointer in event.pointers
        if isinstance(pointer, WindowSample)
    }


def _worst(
    event: AnomalyEvent, read: ReadBack, budget: EvidenceBudget, samples: dict[str, tuple[float, list[Located]]]
) -> list[dict[str, Any]]:
    """Up to ``budget.worst`` of the anomalous window's worst requests by the event's signal:
    its slowest (kept by location, or the sample's slowest by a phase) or those showing its fault."""
    worst: list[dict[str, Any]] = []
    anomalous = samples["anomalous"][1] if "anomalous" in samples else None
    for pointer in event.pointers:
        if isinstance(pointer, WorstBy) and anomalous is not None:
            worst.extend(_shown(_slowest(anomalous, pointer.signal, budget.worst), "slowest", budget))
        elif isinstance(pointer, FaultScan) and anomalous is not None:
            faulty = [item for item in anomalous if shows_fault(pointer.signal, item[1], budget.markers)]
            worst.extend(_shown(faulty[: budget.worst], "faulty", budget))
        elif isinstance(pointer, KeptRequest):
            at, location = pointer.location, pointer.location.model_dump()
            if (row := read.rows((at.partition, at.offset)).get(at.index)) is None:
                worst.append({"ttft_s": pointer.ttft_s, "location": location, "unavailable": True, "sample": "slowest"})
            else:
                worst.extend(_shown([(location, row)], "slowest", budget))
    return worst[: budget.worst]


def _picks(
    event: AnomalyEvent, samples: dict[str, tuple[float, list[Located]]], budget: EvidenceBudget, shown: set[str]
) -> list[dict[str, Any]]:
    """A reproducible uniform pick of each window sample, leaving out the requests already shown."""
    picks: list[dict[str, Any]] = []
    for kind, k, label in (("anomalous", budget.uniform, "uniform"), ("baseline", budget.baseline, "baseline")):
        if kind in samples:
            start, located = samples[kind]
            unseen = [item for item in located if location_key(item[0]) not in shown]
            seed = f"{event.fingerprint}|{start}"
            picks.extend(_shown(uniform_pick(unseen, [location_key(at) for at, _ in unseen], k, seed), label, budget))
    return picks


def _shown(found: list[Located], sample: str, budget: EvidenceBudget) -> list[dict[str, Any]]:
    return [
        {**evidence_from_row(row, budget.excerpt_chars, budget.markers), "location": location, "sample": sample}
        for location, row in found
    ]


def _slowest(located: list[Located], signal: Signal, keep: int) -> list[Located]:
    """The ``keep`` slowest by ``signal`` (``models.explain.faulty_requests.slowness``), slowest first."""
    timed = [(value, item) for item in located if (value := slowness(signal, item[1])) is not None]
    timed.sort(key=lambda pair: pair[0], reverse=True)
    return [item for _, item in timed[:keep]]


def _facets(samples: dict[str, tuple[float, list[Located]]]) -> Facets | None:
    faceted = {kind: window_facets([row for _, row in located], start) for kind, (start, located) in samples.items()
               if located}  # fmt: skip
    if not faceted:
        return None
    now, before = faceted.get("anomalous"), faceted.get("baseline")
    return Facets(anomalous=now, baseline=before, changes=compare(now, before) if now and before else [])


def _in_window(row: Any, start: float, end: float) -> bool:
    timestamp = field_getter(row)("timestamp")
    return timestamp is not None and start <= float(timestamp) < end


class ReadBack:
    """The messages read back for a batch of events: each decoded once, and its rows grouped
    by segment once (``segment_of`` runs in Python per row: every event of a window scans the
    same messages, and a message holds thousands of requests of every segment)."""

    def __init__(self, messages: Mapping[MessageKey, bytes | None], segment_of: Callable[[Any], str] | None) -> None:
        self.messages, self.segment_of = messages, segment_of
        self._rows: dict[MessageKey, dict[int, Any]] = {}
        self._by_segment: dict[MessageKey, dict[str, list[tuple[int, Any]]]] = {}

    def rows(self, key: MessageKey) -> dict[int, Any]:
        """The message's rows by position (none if it was not read)."""
        if key not in self._rows:
            self._rows[key] = _rows_by_position(self.messages.get(key), key)
        return self._rows[key]

    def of_segment(self, key: MessageKey, segment: str) -> list[tuple[int, Any]]:
        """(position, row) of the message's rows of ``segment``."""
        groups = self._by_segment.get(key)
        if groups is None:
            groups = self._by_segment[key] = {}
            if self.segment_of is not None:
                for index, row in self.rows(key).items():
                    groups.setdefault(self.segment_of(row), []).append((index, row))
        return groups.get(segment, [])


def _window_rows(pointer: WindowSample, read: ReadBack) -> list[Located]:
    """The segment's requests of the pointer's window in the messages spread over its ranges."""
    segment, start, end = pointer.segment, pointer.window_start, pointer.window_end
    found: list[Located] = []
    for partition, offset in spread(pointer.sources or ()):
        for index, row in read.of_segment((partition, offset), segment):
            if _in_window(row, start, end):
                found.append(({"partition": partition, "offset": offset, "index": index}, row))
    return found


def _rows_by_position(raw: bytes | None, key: MessageKey) -> dict[int, Any]:
    if raw is None:
        return {}
    decoded = decode_message(raw, MessageOrigin(partition=key[0], offset=key[1]), max_bytes=len(raw) + 1)
    batch = decoded.rows()
    return dict(zip(batch.positions.tolist(), batch.rows, strict=True))


async def resolve(
    events: list[AnomalyEvent],
    read: Callable[[set[MessageKey]], Awaitable[dict[MessageKey, bytes]]],
    budget: EvidenceBudget = DEFAULT_BUDGET,
    segment_of: Callable[[Any], str] | None = None,
) -> list[AnomalyEvent]:
    """The events with their evidence filled in from the messages ``read`` gives (never raises)."""
    keys = wanted(events)
    if not keys:
        return events
    try:
        messages = await read(keys)
    except Exception:  # evidence is worth a retry, never an event
        logger.exception("could not read evidence back from %d messages", len(keys))
        messages = {}
    return fill(events, messages, budget, segment_of)


#: Bytes a read-back fetch asks for. Brokers return the first record batch of a fetch whole
#: even when it is larger (KIP-74; Tansu too), so this never cuts a message short: it stops
#: the fetch from also carrying the megabytes that follow the one message wanted (an 8 MiB
#: fetch made each read ~3x slower).
READ_BACK_FETCH_BYTES = 64 * 1024


class KafkaMessageReader:
    """Reads single messages of a topic by (partition, offset), with its own group-less consumer.

    Started on first use and kept: an incident fires a handful of events, each reading a
    few dozen messages back.
    """

    def __init__(self, bootstrap: str, topic: str, timeout_s: float = 1.0, auth: KafkaAuth = PLAINTEXT) -> None:
        self.bootstrap, self.topic, self.timeout_s, self.auth = bootstrap, topic, timeout_s, auth
        self._consumer: AIOKafkaConsumer | None = None

    async def _started(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap,
                group_id=None,
                enable_auto_commit=False,
                fetch_max_bytes=READ_BACK_FETCH_BYTES,
                max_partition_fetch_bytes=READ_BACK_FETCH_BYTES,
                fetch_max_wait_ms=10,
                **self.auth.client_options(),
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
