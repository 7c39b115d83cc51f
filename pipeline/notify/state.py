"""What the notifier knows of one model's incident groups, and what each sink was told.

Kept per model (the anomaly topic's key), stored as JSON in a changelog-backed table after
every change, so a notifier that restarts, or takes a model over from another, knows which
notifications already went out and never sends them twice. Applying a record is
idempotent: records already applied (by ``id``) and groups already finished are ignored,
because after a crash Faust replays the anomaly topic from the last committed offset.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from servewatch.models.detect.grouping import cause_of, group_title
from servewatch.models.detect.lifecycle import SEVERITY_RANK
from servewatch.schemas.anomaly import AnomalyEvent, Status
from servewatch.schemas.delivery import Delivery
from servewatch.schemas.incident_group import GroupMember, IncidentGroup

#: Record ids remembered per group (replays reach back a few commits, never hundreds).
_SEEN_IDS = 256
#: Evidence rows kept per member: messages show three; the rest is on the anomaly topic.
_EVIDENCE_KEPT = 6
#: Finished groups remembered, so a replayed record cannot bring one back (and page again).
_DONE_KEPT = 5000
_DONE_FOR_S = 7 * 86400.0
#: Outcomes kept unreported per model at most. A notifications topic that refuses records
#: for hours (deleted, an ACL) must not grow the stored state past what its changelog takes
#: (a few hundred bytes each, the whole state in one record): beyond it the oldest go, said.
MAX_UNREPORTED = 1000


class SinkProgress(BaseModel):
    """One sink's account of one group (Alertmanager's notification log entry)."""

    first_seen: float = Field(description="Wall clock when the sink first wanted the group: group_wait runs from it.")
    sent_seq: int = 0
    sent_version: int = -1
    sent_status: Status | None = Field(default=None, description="Status of the last notification the sink took.")
    last_sent_at: float | None = None
    silenced_version: int = -1
    done: bool = False
    memo: dict[str, str] = Field(default_factory=dict)


class GroupState(BaseModel):
    group: IncidentGroup | None = None  # None until the group's own record arrives
    members: dict[str, AnomalyEvent] = Field(default_factory=dict)  # latest event per fingerprint
    version: int = 0  # bumped whenever the group moves (a new member, severity, status)
    seen: list[str] = Field(default_factory=list)
    sinks: dict[str, SinkProgress] = Field(default_factory=dict)

    def sorted_members(self) -> list[AnomalyEvent]:
        """Open members first, then the most severe, then the most surprising."""
        return sorted(
            self.members.values(),
            key=lambda m: (m.status is not Status.FIRING, -SEVERITY_RANK[m.severity], -m.score, m.fingerprint),
        )


class ModelState(BaseModel):
    model: str
    groups: dict[str, GroupState] = Field(default_factory=dict)
    done: dict[str, float] = Field(default_factory=dict)  # group key -> when it was finished
    #: Outcomes booked here and not yet on the notifications topic: stored with the booking,
    #: published after it, dropped once the broker has them (an outbox), so a crash between
    #: the two republishes them rather than losing them.
    unreported: list[Delivery] = Field(default_factory=list)

    def report_later(self, delivery: Delivery) -> int:
        """Keep ``delivery`` until it is on the notifications topic; returns how many of the
        oldest unreported outcomes were dropped to stay within ``MAX_UNREPORTED``."""
        self.unreported.append(delivery)
        over = max(len(self.unreported) - MAX_UNREPORTED, 0)
        del self.unreported[:over]
        return over

    def apply(self, record: AnomalyEvent | IncidentGroup) -> bool:
        """Fold one anomaly-topic record in; ``False`` when it changed nothing (a replay)."""
        key = record.group if isinstance(record, IncidentGroup) or record.group else record.fingerprint
        assert key is not None
        if key in self.done:
            return False
        state = self.groups.setdefault(key, GroupState())
        if record.id in state.seen:
            return False
        state.seen = [*state.seen, record.id][-_SEEN_IDS:]
        if isinstance(record, IncidentGroup):
            if state.group is None or record.window_end >= state.group.window_end:
                state.group = record
                state.version += 1
            return True
        state.members[record.fingerprint] = _trimmed(record)
        if record.group is None:  # an incident no grouper saw: it is its own group
            before = state.group
            state.group = _own_group(record)
            if before is None or (before.status, before.severity) != (state.group.status, state.group.severity):
                state.version += 1
        return True

    def finish(self, key: str, now: float) -> None:
        """Forget a group every sink is done with; remember that it is finished."""
        self.groups.pop(key, None)
        self.done[key] = now
        horizon = now - _DONE_FOR_S
        kept = sorted(((at, k) for k, at in self.done.items() if at >= horizon), reverse=True)[:_DONE_KEPT]
        self.done = {k: at for at, k in kept}


def _trimmed(event: AnomalyEvent) -> AnomalyEvent:
    return event.model_copy(update={"evidence": event.evidence[:_EVIDENCE_KEPT], "facets": None})


def _own_group(event: AnomalyEvent) -> IncidentGroup:
    member = GroupMember(fingerprint=event.fingerprint, signal=event.signal, segment=event.segment,
                         status=event.status, severity=event.severity)  # fmt: skip
    return IncidentGroup(
        id=event.id, group=event.fingerprint, status=event.status, transition=event.transition,
        cause=cause_of(event), model=event.segment.get("model", "other"), severity=event.severity,
        window_start=event.window_start, window_end=event.window_end, members=[member], signals=[event.signal],
        segments=1, title=group_title(cause_of(event), event.segment.get("model", "other"), 1, [event.signal]),
        summary=event.summary,
    )  # fmt: skip
