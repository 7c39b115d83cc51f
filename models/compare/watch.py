"""One change under watch: its model's requests before and after the marker, judged as they come.

The worker feeds a ``ChangeWatch`` every request of the marker's model (and instance, if the
marker names one) from ``before`` seconds ahead of the marker to ``after`` seconds past it,
in event time. Every ``check_every`` seconds of event time after the marker, and once more
when the period after is complete, ``check`` returns a ``ChangeReport`` (the signals on the
same mix, and each rollback condition) and the rollback anomalies that start or end: a
condition that holds fires a ``critical`` incident with hint ``rollback_condition_met``; it
resolves when the condition stops holding or a later change of the model supersedes it.

Memory is bounded: each period keeps a uniform reservoir of ``max_requests`` slim rows (the
fields the signals and the evidence read, content cut to an excerpt). What the comparison
holds fixed (each request's load and whether its prefix was seen before, ``strata``) is
taken from every request, not the sample: a ``TrafficLog`` keeps 16 bytes a request.

>>> from servewatch.schemas.change_marker import ChangeMarker
>>> marker = ChangeMarker(id="c1", at=1000.0, model="m", description="lower max_tokens")
>>> watch = ChangeWatch(marker, before_s=600, after_s=600, check_every_s=300,
...     conditions=[RollbackCondition("truncation_share", 1.0, min_requests=100)])
>>> rows = [{"request_id": f"r{i}", "timestamp": 400.0 + i, "model": "m", "prompt_tokens": 500,
...          "completion_tokens": 300, "ttft_s": 0.2, "e2e_s": 4.0,
...          "finish_reason": "length" if i >= 600 and i % 4 == 0 else "stop"} for i in range(1201)]
>>> watch.add(rows)
1200
>>> watch.due, watch.done
(True, True)
>>> report, events = watch.check()
>>> report.final, [row.verdict for row in report.signals if row.signal == "truncation_share"]
(True, ['regressed'])
>>> [(e.status.value, e.severity.value, e.hints[0].code, e.change.id) for e in events]
[('firing', 'critical', 'rollback_condition_met', 'c1')]
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from servewatch.models.compare.report import ChangeVerifier
from servewatch.models.compare.rollback import RollbackCondition, check, describe_change, evidence
from servewatch.models.compare.strata import POSITION, TrafficLog
from servewatch.models.detect.events import incident_event
from servewatch.models.detect.lifecycle import Transition
from servewatch.models.explain.wording import event_id
from servewatch.models.windows.excerpt import excerpt
from servewatch.models.windows.segment_keys import join_key, parse_key
from servewatch.models.windows.signal_columns import DEFAULT_REASONING_MARKERS
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.change_marker import ChangeMarker, ChangeRef
from servewatch.schemas.change_report import ChangeReport, Period, RollbackCheck

Row = Mapping[str, Any]

#: The fields a comparison and its evidence read; the rest of a request log is dropped.
KEPT = ("request_id", "timestamp", "model", "route", "instance", "engine", "engine_version", "prompt_tokens",
        "completion_tokens", "ttft_s", "e2e_s", "decode_s", "queue_s", "cached_tokens", "finish_reason",
        "status_code", "max_tokens")  # fmt: skip

#: Which anomaly signal a report signal pages as.
PAGES_AS = {
    "ttft_p50": Signal.TTFT,
    "ttft_p95": Signal.TTFT,
    "e2e_p95": Signal.E2E,
    "itl_p50": Signal.ITL,
    "tokens_per_s_p50": Signal.THROUGHPUT,
    "cache_hit_rate": Signal.CACHE_HIT_RATE,
    "truncation_share": Signal.LENGTH_TRUNCATION,
    "leak_share": Signal.REASONING_LEAK,
    "error_share": Signal.ERROR_RATE,
}


@dataclass
class _Reservoir:
    """A uniform sample of at most ``size`` rows of a stream (Algorithm R), seeded."""

    size: int
    rng: random.Random
    rows: list[Row] = field(default_factory=list)
    seen: int = 0

    def offer(self, row: Row) -> None:
        self.seen += 1
        if len(self.rows) < self.size:
            self.rows.append(row)
            return
        slot = self.rng.randrange(self.seen)
        if slot < self.size:
            self.rows[slot] = row


#: Event seconds within which a request seen again (same id and end time) is a repeat: a
#: shipper resends a batch it is unsure of within seconds; remembering every request of an
#: hour-long span would cost memory in proportion to the model's traffic.
DUPLICATE_HORIZON_S = 300.0


class _RecentIds:
    """(request id, end time) pairs of the last ``horizon_s`` of event time, by minute."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._by_minute: dict[int, set[tuple[str, float]]] = {}

    def add(self, request_id: str, stamp: float, watermark: float) -> bool:
        """Remember the pair; False if it was seen already (ids alone may repeat across engines)."""
        minute = int(stamp // 60)
        seen = self._by_minute.get(minute)
        if seen is None:
            oldest = int((watermark - self.horizon_s) // 60)
            for old in [m for m in self._by_minute if m < oldest]:
                del self._by_minute[old]
            seen = self._by_minute[minute] = set()
        if (request_id, stamp) in seen:
            return False
        seen.add((request_id, stamp))
        return True

    def __len__(self) -> int:
        return sum(len(seen) for seen in self._by_minute.values())


@dataclass
class ChangeWatch:
    """The two periods of one change marker and the rollback incidents they opened."""

    marker: ChangeMarker
    before_s: float = 1800.0
    after_s: float = 1800.0
    check_every_s: float = 300.0
    conditions: Sequence[RollbackCondition] = ()
    verifier: ChangeVerifier = field(default_factory=ChangeVerifier)
    max_requests: int = 50_000
    markers: Sequence[str] = DEFAULT_REASONING_MARKERS

    def __post_init__(self) -> None:
        rng = random.Random(self.marker.id)
        self._before = _Reservoir(self.max_requests, rng)
        self._after = _Reservoir(self.max_requests, rng)
        self._seen = _RecentIds(DUPLICATE_HORIZON_S)
        self._traffic = TrafficLog(lifetime_s=self.verifier.prefix_lifetime_s)
        self.watermark = -math.inf
        self._next_check = self.marker.at + self.check_every_s
        self._firing: dict[str, AnomalyEvent] = {}  # condition text -> its firing event
        self.finished = False

    @property
    def start(self) -> float:
        return self.marker.at - self.before_s

    @property
    def end(self) -> float:
        return self.marker.at + self.after_s

    @property
    def done(self) -> bool:
        """The period after is complete (event time passed its end)."""
        return self.watermark >= self.end

    @property
    def due(self) -> bool:
        """A check is due: ``check_every_s`` of the period after went by, or it is complete."""
        return not self.finished and (self.watermark >= self._next_check or self.done)

    @property
    def requests(self) -> tuple[int, int]:
        return self._before.seen, self._after.seen

    def observe(self, timestamp: float) -> None:
        """Event time reached ``timestamp`` (a request of any model finished then)."""
        self.watermark = max(self.watermark, timestamp)

    def add(self, rows: Iterable[Row]) -> int:
        """Take the marker's model's (and instance's) requests of either period; returns how
        many were taken. A request seen before (id and timestamp) is skipped: a replayed message.
        Those that finished before the period before count towards the load it starts with.
        Repeats are recognised within ``DUPLICATE_HORIZON_S`` of event time (a shipper's retry)."""
        marker, taken = self.marker, 0
        for row in rows:
            stamp = row.get("timestamp")
            if not isinstance(stamp, int | float):
                continue
            self.observe(float(stamp))
            if row.get("model") != marker.model or stamp >= self.end:
                continue
            if marker.instance is not None and row.get("instance") != marker.instance:
                continue
            if not self._seen.add(str(row.get("request_id")), float(stamp), self.watermark):
                continue
            position = self._traffic.add(row)
            if stamp < self.start:
                continue
            (self._after if stamp >= marker.at else self._before).offer({**self._slim(row), POSITION: position})
            taken += 1
        return taken

    def _slim(self, row: Row) -> dict[str, Any]:
        slim = {name: row[name] for name in KEPT if row.get(name) is not None}
        content = row.get("content")
        if isinstance(content, str):
            marker = next((m for m in self.markers if m in content), None)
            slim["content"] = (marker or "") + "\u2026" if marker else excerpt(content, None, 80) or ""
        return slim

    def check(self, final: bool = False) -> tuple[ChangeReport, list[AnomalyEvent]]:
        """The report so far (final once the period after is complete, or when told) and the
        rollback incidents that fire or resolve with it."""
        final = final or self.done
        if self.watermark >= self._next_check:
            steps = math.floor((self.watermark - self.marker.at) / self.check_every_s) + 1
            self._next_check = self.marker.at + steps * self.check_every_s
        before, after = self._traffic.labelled(self._before.rows, self._after.rows)
        (report,) = self.verifier.compare(before, after, model=self.marker.model) or [self._empty_report()]
        checks = [check(condition, before, after, self.verifier, self.marker.model) for condition in self.conditions]
        events = [event for condition, result in zip(self.conditions, checks, strict=True)
                  for event in self._transition(condition, result, after)]  # fmt: skip
        self.finished = final
        report = report.model_copy(update={"change": self.marker.id, "description": self.marker.description,
                                           "final": final, "rollback": checks})  # fmt: skip
        return report, events

    def supersede(self, later: ChangeMarker) -> list[AnomalyEvent]:
        """A later change of the model ends this one's period after (what follows is the later
        change's) and its rollback incidents (the later change is likely the rollback)."""
        self.after_s = max(0.0, min(self.after_s, later.at - self.marker.at))
        self._after.rows[:] = [row for row in self._after.rows if row["timestamp"] < self.end]
        return [self._resolved(text, f"superseded by change {later.id}: '{later.description}'")
                for text in list(self._firing)]  # fmt: skip

    def _empty_report(self) -> ChangeReport:
        return ChangeReport(model=self.marker.model, before=Period(requests=0), after=Period(requests=0), segments=0,
                            confidence=self.verifier.confidence, resamples=self.verifier.resamples,
                            min_requests=self.verifier.min_requests, signals=[])  # fmt: skip

    def _transition(
        self, condition: RollbackCondition, result: RollbackCheck, after: Sequence[Row]
    ) -> list[AnomalyEvent]:
        text = condition.text
        if result.holds and text not in self._firing:
            return [self._fire(condition, result, after)]
        if not result.holds and text in self._firing and result.detail.startswith("not crossed"):
            return [self._resolved(text, "the condition no longer holds")]
        return []

    def _fire(self, condition: RollbackCondition, result: RollbackCheck, after: Sequence[Row]) -> AnomalyEvent:
        marker = self.marker
        key = result.where if result.where and result.where != marker.model else join_key({"model": marker.model})
        summary = (
            f"Rollback condition met after change {marker.id} on {marker.model} ('{marker.description}'): "
            f"{condition.text}; {result.detail}."
        )
        advice = f"roll back change {marker.id} ('{marker.description}') or mark why it stays"
        summary += f" {advice[0].upper()}{advice[1:]}."
        sample = "faulty" if condition.spec.points else "slowest"
        event = incident_event(
            key=key,
            signal=PAGES_AS[condition.signal],
            incident_start=marker.at,
            transition=Transition.FIRING,
            labels=parse_key(key),
            window=(marker.at, max(self.watermark, marker.at)),
            observed=result.change if result.change is not None else math.nan,
            expected=0.0 if condition.spec.points else 1.0,  # no change
            score=-math.log10((1 - self.verifier.confidence) / 2),  # at least: the interval excluded no change
            severity=Severity.CRITICAL,
            summary=summary,
            hints=[Hint(code="rollback_condition_met", message=f"{condition.text}: {_described(condition, result)}")],
            evidence=[{**row, "sample": sample} for row in evidence(condition, after, result.where, count=5)],
            incident_name=f"rollback:{marker.id}:{condition.text}",
            change=ChangeRef(id=marker.id, at=marker.at, description=marker.description, windows_after=0),
        )
        self._firing[condition.text] = event
        return event

    def _resolved(self, text: str, why: str) -> AnomalyEvent:
        firing = self._firing.pop(text)
        end = max(self.watermark, firing.window_end)
        return firing.model_copy(
            update={
                "id": event_id(firing.fingerprint, "resolved:resolved", end),
                "status": Status.RESOLVED,
                "transition": "resolved",
                "window_start": end,
                "window_end": end,
                "summary": f"Resolved: {text} after change {self.marker.id} ({why}).",
                "evidence": [],
            }
        )


def _described(condition: RollbackCondition, result: RollbackCheck) -> str:
    """``+34.2 % [+21.0, +48.9] on route=chat|...``: the check's change in the report's wording."""
    kind = "points" if condition.spec.points else "ratio"
    return describe_change(kind, result.change, result.ci_low, result.ci_high) + (
        f" on {result.where}" if result.where else ""
    )
