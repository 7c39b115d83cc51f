"""The bank of every segment's detectors: segments met, restored and stored, the windows a
worker releases together judged, each model's traffic and replicas watched beside them,
and silent segments resolved or dropped.

One segment's detectors are in ``models.detect.detector``; a model's traffic in
``models.detect.traffic_watch``; its replicas in ``models.detect.replicas``.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servewatch.models.detect.detector import SegmentDetectors
from servewatch.models.detect.no_data import no_data_events
from servewatch.models.detect.replicas import ReplicaWatch
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.detect.signals import SPEC_SETS
from servewatch.models.detect.tolerance import Tolerances
from servewatch.models.detect.traffic_watch import TrafficWatch
from servewatch.models.stats.capacity import Capacity
from servewatch.models.stats.rates import BetaBinomialRate
from servewatch.models.windows.segment_keys import is_replica_key
from servewatch.models.windows.window import WindowStats
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.series import SeriesPoint

logger = logging.getLogger(__name__)

#: Windows of traffic counts kept waiting for evidence that traffic went on past them.
TRAFFIC_PENDING_MAX = 60


@dataclass
class DetectorBank:
    """All segments' detectors. Bounded: segments are capped upstream by the ``Segmenter``.

    ``restore(key)`` (optional) returns a segment's stored state (``SegmentDetectors.state``)
    when the bank first meets it, e.g. from a changelog-backed table after a restart or a
    rebalance; ``states_to_save`` hands back what changed, for storing: a segment's state
    every ``save_every`` windows it is judged, and at once when its lifecycle moves.
    """

    config: DetectorConfig = field(default_factory=DetectorConfig)
    detectors: dict[str, SegmentDetectors] = field(default_factory=dict)
    # Model-level rates, learned from every segment of a model: a new segment's prior.
    pooled: dict[tuple[str, Signal], BetaBinomialRate] = field(default_factory=dict)
    # Per model and latency signal (and its capacity), its best-known segment's model: what a
    # new one borrows.
    templates: dict[tuple[str, Any], Any] = field(default_factory=dict)
    # Both are stored beside the segments (``model_key``), as often as the models' traffic,
    # and restored when a model's windows first come: a restarted worker that learned them
    # afresh would judge new segments against other priors than the worker before it (and a
    # replay of the same records), and its young segments would borrow from whichever segment
    # happened to be judged first.
    _models_met: set[str] = field(default_factory=set, repr=False)
    restore: Callable[[str], dict[str, Any] | None] | None = None
    save_every: int = 1
    windows_judged: int = 0
    # Windows that ended no later than their segment's last judged one: a replay after a
    # crash (already judged), or a backlog older than the segment's state. Not judged again,
    # not learned from: counted, with their records, so that nothing goes unaccounted.
    windows_skipped: int = 0
    records_skipped: int = 0
    restored: int = 0  # segments whose state was restored
    discarded: int = 0  # stored states refused (another version, or corrupt): started fresh
    clock: float = -math.inf  # event time: the latest window end judged
    #: ``stream_clock(key)``: the event time the stream that carries a segment's windows has
    #: reached, where streams can run apart (the worker's partials partitions: one read again
    #: after a crash is minutes behind the others). A segment is silent only in its own
    #: stream; without it, every segment's is ``clock``.
    stream_clock: Callable[[str], float] | None = None
    window_s: float = math.inf  # the windows' length (of the last judged)
    traffic: TrafficWatch = field(init=False)  # requests per model per window (models going dark)
    replicas: ReplicaWatch = field(init=False)  # each serving instance against its peers
    #: Event time up to which every stream carrying this bank's windows has released them
    #: (the worker's partials partitions: ``WindowAssembler.complete_until``). A model's
    #: segments travel through several, released apart: its traffic in a window is counted
    #: whole, and judged, only once all have released it.
    traffic_complete_until: float = math.inf
    # Windows' requests per model not judged yet, the latest window requests started in, and
    # the end of the last window whose traffic was judged.
    _traffic_pending: dict[tuple[float, float], dict[str, int]] = field(default_factory=dict, repr=False)
    _started_in: float = -math.inf
    _traffic_judged_until: float = -math.inf
    expired: list[str] = field(default_factory=list)  # keys of segments dropped as idle, not yet told
    #: Judged windows as points for charts (``SeriesPoint``), when kept (a list: the worker
    #: drains it after every round); ``None``, the default, costs nothing (replays, backtests).
    series: list[SeriesPoint] | None = None
    #: Signals on-call called "expected", judged with a wider tolerance for a while.
    tolerances: Tolerances = field(default_factory=Tolerances)

    def __post_init__(self) -> None:
        self.traffic = TrafficWatch(self.config, restore=lambda key: self.restore(key) if self.restore else None)
        self.replicas = ReplicaWatch(
            self.config,
            min_ratio=self.config.replica_min_ratio,
            warmup_requests=self.config.replica_warmup_requests,
            restore=lambda key: self.restore(key) if self.restore else None,
        )

    def segment(self, key: str) -> SegmentDetectors:
        detectors = self.detectors.get(key)
        if detectors is None:
            detectors = self.detectors[key] = SegmentDetectors(key, self.config)
            # Segments that appear together (a worker's start) take their turns spread over
            # the period, not all in one window: a store costs a changelog message each.
            detectors.unsaved = -(zlib.crc32(key.encode()) % self.save_every)
            stored = self.restore(key) if self.restore is not None else None
            if stored is not None:
                try:
                    detectors.load_state(stored)
                    self.restored += 1
                except (ValueError, KeyError, TypeError, IndexError) as exc:
                    # Deliberately fresh, and said so: an upgrade that cannot read old state
                    # costs a segment its grace windows, never the worker.
                    logger.warning("stored state of %s not loaded (%s): starting fresh", key, exc)
                    detectors = self.detectors[key] = SegmentDetectors(key, self.config)
                    self.discarded += 1
        return detectors

    def forget(self, which: Callable[[str], bool]) -> int:
        """Drop the segments ``which(key)`` selects (e.g. of partitions handed to another
        worker); ``restore`` brings them back if they return. Returns how many."""
        gone = [key for key in self.detectors if which(key)]
        for key in gone:
            del self.detectors[key]
        return len(gone)

    def states_to_save(self, every_one: bool = False, unsaved: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """(key, state) of segments judged ``save_every`` windows since last saved, or whose
        lifecycle moved (an event, or a run of anomalous windows in progress), or whose oldest
        unsaved window is ``2 * save_every`` windows old (a segment gone sparse: it must not
        hold ``stored_until`` back); with ``unsaved``, of every segment judged since it was
        last saved (the input went quiet: no later window will make them due); of every
        segment with ``every_one`` (before a worker lets its segments go)."""
        due = []
        every = self.save_every
        stale = math.inf if unsaved else self.clock - 2 * every * self.window_s
        for key, detectors in self.detectors.items():
            if every_one or detectors.unsaved >= every or detectors.transitioned or detectors.unsaved_from < stale:
                detectors.unsaved, detectors.transitioned, detectors.unsaved_from = 0, False, math.inf
                due.append((key, detectors.state()))
        if every_one or self.traffic.judged >= every:  # each model's traffic, as often as a segment's
            due += self.traffic.states()
            due += self.replicas.states()
            due += [
                (self.model_key("pooled", model, what), pool.state()) for (model, what), pool in self.pooled.items()
            ]
            due += [
                (self.model_key("template", model, what), kept.state())
                for (model, what), kept in self.templates.items()
            ]
        return due

    def model_key(self, kind: str, model: str, what: Signal | str) -> str:
        """The state table key of a figure of a whole model (``pooled`` rates, ``template``s):
        a ``~`` starts no segment's nor engine's key, and the source keeps the request logs'
        and the engines' apart."""
        return f"~{kind}|{self.config.source}|{model}|{what.value if isinstance(what, Signal) else what}"

    def _meet_model(self, model: str) -> None:
        """Take ``model``'s stored pooled rates and templates, the first time its windows come."""
        self._models_met.add(model)
        if self.restore is None:
            return
        kept: list[tuple[str, Signal | str, Any]] = [("template", "capacity", Capacity())]
        for spec in SPEC_SETS[self.config.source].values():
            if spec.signal.value not in self.config.signals:
                continue
            if spec.kind == "rate":
                kept.append(("pooled", spec.signal, BetaBinomialRate(grace_windows=0)))
            elif spec.kind == "latency":
                kept.append(("template", spec.signal, spec.build(self.config.grace_windows)))
        for kind, what, fresh in kept:
            found: dict[Any, Any] = self.pooled if kind == "pooled" else self.templates
            stored = None if (model, what) in found else self.restore(self.model_key(kind, model, what))
            if stored is None:
                continue
            try:
                fresh.load_state(stored)
            except (KeyError, TypeError, ValueError, IndexError):  # another version: learned afresh
                continue
            found[(model, what)] = fresh

    def stored_until(self) -> float:
        """Event time up to which every judged window is in the states taken for storage:
        the inputs of windows ending by then may be let go (their offsets committed); a
        later window's would be needed to judge it again after a crash."""
        return min((detectors.unsaved_from for detectors in self.detectors.values()), default=math.inf)

    def observe(self, window: WindowStats) -> list[AnomalyEvent]:
        if (model := window.labels.get("model", "other")) not in self._models_met:
            self._meet_model(model)
        detectors = self.segment(window.key)
        if detectors.judged(window):
            self.windows_skipped += 1
            self.records_skipped += int(window.requests)
            return []
        self.windows_judged += 1
        self.window_s = window.length
        return detectors.observe(window, self.pooled, self.templates, self.series, self.tolerances)

    def observe_all(self, windows: list[WindowStats], final: bool = False) -> list[AnomalyEvent]:
        """Judge windows released together; then, once per new window end, each model's
        traffic in it (``models.stats.traffic``) and the silent segments (``models.detect.no_data``).
        ``final``: the stream's end flushed them, and its last windows are cut short by that
        end, not by their traffic."""
        replica_rows = [window for window in windows if is_replica_key(window.key)]
        if replica_rows:  # each instance against its peers (``models.detect.replicas``)
            windows = [window for window in windows if not is_replica_key(window.key)]
        events = [event for window in windows for event in self.observe(window)]
        if replica_rows:
            events += self.replicas.observe(replica_rows, self.series)
        if not final:
            events += self._judge_traffic(windows)
        now = max((window.end for window in windows), default=self.clock)
        if now > self.clock:
            self.clock = now
            events += self.sweep(now)
        return events

    def _judge_traffic(self, windows: list[WindowStats]) -> list[AnomalyEvent]:
        """Each model's requests per window, judged once requests have *started* in a later
        window: traffic went on past it, so a window with few requests is not merely the
        end of the input (a file replayed, whose last windows hold the drain of requests
        still finishing)."""
        pending = self._traffic_pending
        for window in windows:
            if window.end > self._traffic_judged_until:
                per_model = pending.setdefault((window.start, window.end), {})
                model = window.labels.get("model", "other")
                per_model[model] = per_model.get(model, 0) + int(window.requests)
            if window.start <= self._started_in:
                continue  # no start in it can be later than one already seen
            for lag, (arrived, _) in enumerate(window.arrival_counts()):
                if arrived > 0:  # requests that started ``lag`` windows before this one
                    self._started_in = max(self._started_in, window.start - lag * window.length)
                    break
        events = []
        for start, end in sorted(pending):
            if start >= self._started_in or end > self.traffic_complete_until:
                break
            events += self.traffic.observe(start, end, pending.pop((start, end)))
            self._traffic_judged_until = end
        while len(pending) > TRAFFIC_PENDING_MAX:  # no start times seen (requests all longer
            del pending[min(pending)]  # than ARRIVAL_LAGS windows): those go unjudged
        return events

    def sweep(self, now: float) -> list[AnomalyEvent]:
        """Open incidents of segments silent for ``no_data_after_s`` resolve as ``no_data``;
        segments silent for ``segment_idle_s`` are dropped (their keys go to ``expired``, for
        their stored state to go too). Silent in event time, in their own stream
        (``stream_clock``)."""
        events: list[AnomalyEvent] = []
        config = self.config
        quiet_s = min(config.no_data_after_s, config.segment_idle_s)
        for key, segment in list(self.detectors.items()):
            silent_s = now - segment.last_window_end
            if silent_s >= quiet_s and self.stream_clock is not None:
                # Few segments get here, so the stream's clock is asked only of them. A stream
                # behind the others is not silence: its windows are still being judged.
                silent_s = min(now, self.stream_clock(key)) - segment.last_window_end
            if silent_s >= config.no_data_after_s and segment.active:
                events += no_data_events(segment, now)
            if silent_s >= config.segment_idle_s:
                del self.detectors[key]
                self.expired.append(key)
        return events
