"""Stage 2 of the worker, without Kafka: partials -> merged windows -> ``AnomalyEvent``s,
through the ``WindowAssembler`` and the segments' detectors, with every record accounted
for (judged, late, or skipped as older than its segment's state)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from servewatch.models.detect.bank import DetectorBank
from servewatch.models.explain.evidence_sample import RecentSources
from servewatch.models.windows.segment_keys import is_replica_key
from servewatch.models.windows.window import WindowStats
from servewatch.models.windows.windowing import WindowAssembler
from servewatch.models.windows.wire import windows_from_wire
from servewatch.pipeline import topics
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker import metrics
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.evidence_pointer import EvidencePointer, WindowSample

logger = logging.getLogger(__name__)


@dataclass
class StageTwo:
    settings: Settings
    # The partials partition (``via``) each segment's windows come through, where there are
    # several (the worker's, ``partials_partition``): their streams can run apart, and a
    # segment's silence is measured in its own (``DetectorBank.stream_clock``). A replay has one.
    via_of: Callable[[str], int] | None = None
    assembler: WindowAssembler = field(init=False)
    bank: DetectorBank = field(init=False)
    # Where recent windows' records are: a firing event's baseline sample is read from there.
    recent: RecentSources = field(init=False, default_factory=RecentSources)
    # Late partials' letters for the dead-letter topic (the caller takes them) and counts.
    late_letters: list[DeadLetter] = field(init=False, default_factory=list)
    late_records: int = 0
    judged_records: int = 0
    _skipped_logged_at: float = field(init=False, default=-math.inf)
    # Partials messages not acknowledged yet, per partials partition in offset order, with the
    # end of the newest window each fed: let go only once those windows were judged and are in
    # stored state (``judged_and_stored``). A worker killed while a window waits here for other
    # partitions' partials, or before a quiet segment's state was stored, reads them again.
    unacked: dict[int, deque[tuple[Any, float]]] = field(init=False, default_factory=dict)
    _partials_heard: float = field(init=False, default=-math.inf)  # monotonic time partials last came
    handed_over: set[int] = field(init=False, default_factory=set)  # partials partitions revoked, not back yet

    def __post_init__(self) -> None:
        self.assembler = WindowAssembler(
            grace_s=self.settings.windows.assembler_grace_s,
            max_wait_s=self.settings.windows.assembler_max_wait_s,
            expected_partitions=self.settings.kafka.topic_partitions,
        )
        self.bank = DetectorBank(self.settings.detector_config(), save_every=self.settings.windows.state_every_windows)
        if self.via_of is not None:
            released, via_of = self.assembler.released_until, self.via_of
            self.bank.stream_clock = lambda key: released.get(via_of(key), -math.inf)

    def add(self, partial: WindowStats, now: float | None = None, via: int = 0) -> None:
        late, overlapping = self.assembler.late_partials, self.assembler.overlapping_partials
        self.assembler.add(partial, time.monotonic() if now is None else now, via)
        if is_replica_key(partial.key):
            return  # the same records as their segment's partial: counted and dead-lettered there
        if self.assembler.late_partials > late:
            self._count_unjudged(partial, "late", "window_judged", "arrived after their window ({window}) was judged")
        elif self.assembler.overlapping_partials > overlapping:
            self._count_unjudged(
                partial, "partly_merged", "partly_merged",
                "came in one partial with records their window ({window}) had merged already (a re-read after "
                "a crash), so they were not merged",
            )  # fmt: skip

    def _count_unjudged(self, partial: WindowStats, reason: str, label: str, why: str) -> None:
        """A partial not merged into its window: its records are counted late (``label``) and
        dead-lettered as one letter (``reason``) that says where they are."""
        records = int(partial.requests)
        metrics.LATE_PARTIALS.inc()
        metrics.LATE_RECORDS.labels(label).inc(records)
        self.late_records += records
        ranges = [list(source) for source in partial.sources]
        first = ranges[0] if ranges else [None, None, None]
        raw = orjson.dumps({"segment": partial.key, "window_start": partial.start, "window_end": partial.end,
                            "records": records, "sources": ranges})  # fmt: skip
        window = f"{partial.start:.0f}-{partial.end:.0f}"
        error = (
            f"{records} records of segment {partial.key} {why.format(window=window)}; "
            "they are in the requests topic at the ranges in raw"
        )
        self.late_letters.append(
            DeadLetter(reason=reason, error=error, raw=raw.decode(), source_topic=topics.REQUESTS,
                       source_partition=first[0], source_offset=first[1], received_at=time.time())
        )  # fmt: skip

    def restart_waits(self, now: float | None = None) -> None:
        """The broker did not answer: the silence of the partials' sources is not idleness, and
        the windows waiting for them wait again in full (``WindowAssembler.restart_silence``)."""
        self.assembler.restart_silence(time.monotonic() if now is None else now)

    def heartbeat(self, source: int, watermark: float, via: int, now: float | None = None) -> None:
        self.assembler.heartbeat(source, watermark, time.monotonic() if now is None else now, via)

    def receive(self, raw: bytes, via: int, now: float | None = None, token: Any = None) -> list[AnomalyEvent]:
        """One bundle from stage 1 (see ``StageOne.bundles``): merge, advance, judge what is due.
        ``token`` (its message) comes back from ``judged_and_stored`` once all it fed is judged.

        An unreadable bundle is logged and dropped: the topic is internal, so this is a bug
        or a version skew, and it must not stop the worker.
        """
        now = time.monotonic() if now is None else now
        self.handed_over.discard(via)
        held = self.unacked.setdefault(via, deque()) if token is not None else None
        try:
            bundle = orjson.loads(raw)
            if "windows" in bundle:
                partials = windows_from_wire(bundle["windows"])
            else:  # a partial per object, as workers before the columnar format sent them
                partials = WindowStats.from_dicts(bundle["partials"])
            marks = [(int(source), float(mark)) for source, mark in bundle["watermarks"].items()]
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            logger.error("unreadable partials bundle dropped: %s", exc)
            if held is not None:
                held.append((token, -math.inf))
            return []
        if held is not None:
            held.append((token, max((partial.end for partial in partials), default=-math.inf)))
        if partials:
            self._partials_heard = now
        for partial in partials:
            self.add(partial, now, via)
        for source, mark in marks:
            self.heartbeat(source, mark, via, now)
        return self.release_due(now) if marks else []

    def hand_over(self, vias: set[int]) -> None:
        """Partials partitions revoked: whoever judges them next reads their unacknowledged
        messages again. What was released here stays known (``released_until`` and the
        offsets each window held): if they come back at offsets this worker had read past
        (a rejoin after the broker stopped answering), their partials are told apart as
        replays of windows judged here, not judged again and counted late."""
        for via in vias:
            self.unacked.pop(via, None)
            self.handed_over.add(via)
            with contextlib.suppress(KeyError):
                metrics.JUDGED_UNTIL.remove(str(via))

    def judged_and_stored(self) -> list[Any]:
        """Tokens of held messages (``receive``) whose every window was judged and is covered by
        the states taken for storage: once those are on the broker, the messages may be acknowledged."""
        stored: float | None = None  # a pass over every segment: only when a message is judged
        done: list[Any] = []
        for via, waiting in self.unacked.items():
            released = self.assembler.released_until.get(via, -math.inf)
            while waiting and waiting[0][1] <= released:  # in order: Kafka commits a prefix of offsets
                if stored is None:
                    stored = self.bank.stored_until()
                if waiting[0][1] > stored:
                    break
                done.append(waiting.popleft()[0])
        return done

    def quiet(self, now: float | None = None) -> bool:
        """Messages wait for stored state while no partials came for ``idle_flush_s``: the
        input went quiet, and the segments judged last are to be stored now (see
        ``DetectorBank.states_to_save``), or their messages would never be let go."""
        now = time.monotonic() if now is None else now
        return now - self._partials_heard >= self.settings.windows.idle_flush_s and any(self.unacked.values())

    def release_due(self, now: float | None = None) -> list[AnomalyEvent]:
        now = time.monotonic() if now is None else now
        windows = self.assembler.due(now)
        if self.via_of is not None:  # a model's segments travel through several partitions
            self.bank.traffic_complete_until = self.assembler.complete_until(now)
        return self._judge(windows)

    def release_all(self, final: bool = False) -> list[AnomalyEvent]:
        """Judge every window still held (``final``: the stream ended; its last windows are partial)."""
        self.bank.traffic_complete_until = math.inf  # nothing held back any more
        return self._judge(self.assembler.flush_all(), final)

    def _judge(self, windows: list[WindowStats], final: bool = False) -> list[AnomalyEvent]:
        for window in windows:
            self.recent.note(window.start, window.sources)
        skipped_windows, skipped_records = self.bank.windows_skipped, self.bank.records_skipped
        events = [self._locate_baseline(event) for event in self.bank.observe_all(windows, final)]
        skipped = self.bank.records_skipped - skipped_records
        # Replica rows hold the segments' records again: counted once, with their segments.
        segment_windows = [window for window in windows if not is_replica_key(window.key)]
        judged = sum(int(window.requests) for window in segment_windows) - skipped
        self.judged_records += judged
        metrics.JUDGED_RECORDS.inc(judged)
        if skipped:
            metrics.LATE_RECORDS.labels("older_than_state").inc(skipped)
            self._log_skipped(self.bank.windows_skipped - skipped_windows, skipped)
        metrics.WINDOWS.inc(len(segment_windows) - (self.bank.windows_skipped - skipped_windows))
        for via, until in self.assembler.released_until.items():
            if via not in self.handed_over:
                metrics.JUDGED_UNTIL.labels(str(via)).set(until)
        metrics.LIVE_SEGMENTS.set(len(self.bank.detectors))
        metrics.RESTORED_SEGMENTS.set(self.bank.restored)
        metrics.DISCARDED_STATES.set(self.bank.discarded)
        for event in events:
            metrics.ANOMALY_EVENTS.labels(event.signal.value, event.status.value, event.severity.value).inc()
        return events

    def _log_skipped(self, windows: int, records: int) -> None:
        """One line a minute at most: windows no later than their segment's last judged one
        are not judged again (a backlog older than the state is for ``servewatch replay``)."""
        now = time.monotonic()
        if now - self._skipped_logged_at >= 60.0:
            self._skipped_logged_at = now
            logger.info(
                "%d windows (%d records) skipped: no later than their segment's last judged window (a replay after "
                "a restart, or a backlog older than the detectors' state; replay a backlog with servewatch replay); "
                "servewatch_late_records_total{reason=\"older_than_state\"} counts them all",
                windows, records,
            )  # fmt: skip

    def _locate_baseline(self, event: AnomalyEvent) -> AnomalyEvent:
        """The event with its baseline-sample pointer given the ranges of its window, or without
        it when that window is too old to be remembered (no baseline sample then)."""
        kept: list[EvidencePointer] = []
        for pointer in event.pointers:
            if isinstance(pointer, WindowSample) and pointer.sample == "baseline" and pointer.sources is None:
                ranges = self.recent.of(pointer.window_start)
                if ranges is None:
                    continue
                pointer = pointer.model_copy(update={"sources": tuple(tuple(r) for r in ranges)})
            kept.append(pointer)
        return event.model_copy(update={"pointers": tuple(kept)}) if tuple(kept) != event.pointers else event
