"""One cause, one group: incidents of a model that share a likely cause, told once.

Alertmanager groups alerts by labels; here the grouping labels are the model and the
incident's likely cause, its top hint when it fired (``prefix_cache_ineffective``,
``capacity_lost``, ...; an incident with no hint is its own cause, its signal). While a
group has an open member, every incident of the same model and cause that fires joins it;
when its last member resolves, the group resolves, and the next such incident starts a new
group. Pure logic: no clock but the events' own windows.

``IncidentGrouper.add`` takes each incident event in order and returns it with its
``group`` set, and the group's own records (``IncidentGroup``) when the group moves:
``firing`` with its first member, ``update`` when a member joins or the group's severity
steps up (a member's periodic updates move nothing), ``resolved`` with its last member.

>>> from schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
>>> def event(fp, signal, route, status="firing", transition="firing", end=10.0):
...     return AnomalyEvent(id=fp + transition, fingerprint=fp, status=status, transition=transition,
...         signal=signal, segment={"model": "m", "route": route}, window_start=end - 10, window_end=end,
...         observed=2.0, expected=1.0, score=6.0, severity=Severity.WARNING, load={}, explained_by_load=False,
...         hints=[Hint(code="prefix_cache_ineffective", message="hit rate fell")], summary="")
>>> grouper = IncidentGrouper()
>>> first, told = grouper.add(event("a", Signal.TTFT, "chat"))
>>> [(g.transition, g.segments) for g in told], first.group == told[0].group
([('firing', 1)], True)
>>> _, told = grouper.add(event("b", Signal.CACHE_HIT_RATE, "rag", end=20.0))
>>> told[0].title
'prefix_cache_ineffective on m: 2 segments, ttft/cache_hit_rate'
>>> _, told = grouper.add(event("a", Signal.TTFT, "chat", "resolved", "resolved", end=60.0))
>>> told
[]
>>> _, told = grouper.add(event("b", Signal.CACHE_HIT_RATE, "rag", "resolved", "resolved", end=70.0))
>>> [g.transition for g in told]
['resolved']
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

from servewatch.models.detect.lifecycle import SEVERITY_RANK
from servewatch.models.explain.wording import event_id
from servewatch.schemas.anomaly import AnomalyEvent, Severity, Signal, Status
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import GroupMember, IncidentGroup

_FEEDBACK_KEPT = 10_000


#: Hints that say *when* an incident started, not what is wrong: they lead the event's hints
#: (the change is the first suspect) but do not group. Incidents after one change with
#: different diagnoses stay apart, and the change is on every member (``AnomalyEvent.change``).
CONTEXT_HINTS = frozenset({"change_marker"})


def cause_of(event: AnomalyEvent) -> str:
    """An incident's likely cause, for grouping: its top diagnostic hint, else its signal."""
    codes = [hint.code for hint in event.hints if hint.code not in CONTEXT_HINTS]
    return codes[0] if codes else f"signal:{event.signal.value}"


def group_title(cause: str, model: str, segments: int, signals: list[Signal]) -> str:
    """One line: the cause, the model, how many segments, which signals."""
    names = "/".join(s.value for s in signals)
    return f"{cause} on {model}: {segments} segment{'s' if segments != 1 else ''}, {names}"


def group_key(model: str, cause: str, start: float) -> str:
    return hashlib.blake2b(f"{model}\x1f{cause}\x1f{start:.3f}".encode(), digest_size=8).hexdigest()


@dataclass
class _Group:
    key: str
    model: str
    cause: str
    start: float
    members: dict[str, GroupMember] = field(default_factory=dict)  # by fingerprint, in order of joining
    severity: Severity = Severity.INFO

    @property
    def open_members(self) -> list[GroupMember]:
        return [m for m in self.members.values() if m.status is Status.FIRING]

    def current_severity(self) -> Severity:
        open_ = self.open_members or list(self.members.values())
        return max((m.severity for m in open_), key=SEVERITY_RANK.__getitem__, default=Severity.INFO)


class IncidentGrouper:
    """Open groups by (model, cause), and which group each open incident is in."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], _Group] = {}
        self._member_of: dict[str, _Group] = {}  # fingerprint -> its group, while the group is open
        self._feedback: dict[str, Feedback] = {}  # group key -> on-call's latest verdict

    def note_feedback(self, feedback: Feedback) -> None:
        """On-call's verdict on a group: carried on the group's later records and members' events."""
        known = self._feedback.get(feedback.group)
        if known is None or feedback.at >= known.at:
            self._feedback[feedback.group] = feedback
        if len(self._feedback) > _FEEDBACK_KEPT:  # oldest verdicts go first (insertion order)
            del self._feedback[next(iter(self._feedback))]

    def __len__(self) -> int:
        return len(self._open)

    def add(self, event: AnomalyEvent) -> tuple[AnomalyEvent, list[IncidentGroup]]:
        """``event`` with its group set, and the group records it causes (none, or one)."""
        group = self._member_of.get(event.fingerprint)
        joined = False
        if group is None:
            if event.status is Status.RESOLVED:
                return event, []  # an incident from before this grouper (a restart): alone
            model, cause = event.segment.get("model", "other"), cause_of(event)
            group = self._open.get((model, cause))
            if group is None:
                group = _Group(group_key(model, cause, event.window_start), model, cause, event.window_start)
                self._open[(model, cause)] = group
            self._member_of[event.fingerprint] = group
            joined = True
        new = not group.members
        group.members[event.fingerprint] = GroupMember(
            fingerprint=event.fingerprint, signal=event.signal, segment=event.segment, status=event.status,
            severity=event.severity,
        )  # fmt: skip
        event = event.model_copy(update={"group": group.key, "feedback": self._feedback.get(group.key)})
        severity = group.current_severity()
        stepped_up = SEVERITY_RANK[severity] > SEVERITY_RANK[group.severity]
        group.severity = severity
        if not group.open_members:  # the last member resolved: so does the group
            del self._open[(group.model, group.cause)]
            for fingerprint in group.members:
                self._member_of.pop(fingerprint, None)
            return event, [self._record(group, event, "resolved")]
        if new:
            return event, [self._record(group, event, "firing")]
        if joined or stepped_up:
            return event, [self._record(group, event, "update")]
        return event, []

    def _record(
        self, group: _Group, event: AnomalyEvent, transition: Literal["firing", "update", "resolved"]
    ) -> IncidentGroup:
        members = list(group.members.values())
        signals = list(dict.fromkeys(m.signal for m in members))
        segments = len({tuple(sorted(m.segment.items())) for m in members})
        title = group_title(group.cause, group.model, segments, signals)
        still = len(group.open_members)
        if transition == "resolved":
            summary = f"Resolved: {title}; every member incident ended."
        else:
            summary = f"{title}; {still} of {len(members)} incidents open. Latest: {event.summary}".rstrip()
        return IncidentGroup(
            id=event_id(group.key, f"group:{transition}", event.window_start),
            group=group.key,
            status=Status.RESOLVED if transition == "resolved" else Status.FIRING,
            transition=transition,
            cause=group.cause,
            model=group.model,
            severity=group.severity,
            window_start=group.start,
            window_end=event.window_end,
            members=members,
            signals=signals,
            segments=segments,
            title=title,
            summary=summary,
            feedback=self._feedback.get(group.key),
        )


__all__ = ["IncidentGrouper", "cause_of", "group_key"]
