"""One cause, one group: incidents of a model that share a likely cause, told once.

Alertmanager groups alerts by labels; here the grouping labels are the model and the
incident's likely cause, its top hint when it fired (``prefix_cache_ineffective``,
``capacity_lost``, ...; an incident with no hint is its own cause, its signal). While a
group has an open member, every incident of the same model and cause that fires joins it;
when its last member resolves, the group resolves, and the next such incident starts a new
group. Pure logic: no clock but the events' own windows.

**One burst, one group.** A burst of demand slows a model everywhere at once, and each
segment's incident names what it saw of it first: a queue building, a latency rise, slots
that look lost, bigger batches decoding slower, the engines saturated. Those are one story,
told by the load: an incident whose cause load can produce (``LOAD_PLAUSIBLE``) and that
fired while its model's demand was well above usual or its engines flat out with a queue
(``under_load``) joins the model's open *load group*, whatever its hint. The load group's
cause is the strongest explanation among its members (``capacity_saturated`` over
``queueing`` over ``traffic_shift``, a mix moved to longer prompts: load in tokens), and it
never pages (severity ``info``: routed to a channel, not a pager): a queue that demand built
is capacity to plan, not a fault to wake someone for. Causes load cannot produce (the cache
failing, truncations, errors, leaks, KV exhaustion) keep their own groups and page, surge or
not; so do a queue and a slower decode at usual demand (``capacity_lost`` and
``decode_slowdown`` without the load story).

**Stable severity.** A group's severity steps up at once (an ``update`` record), and steps
down only once its open members have been below it for ``step_down_after_s`` of event time:
a member that crosses the critical bound and back every window does not flap the group.

``IncidentGrouper.add`` takes each incident event in order and returns it with its
``group`` set, and the group's own records (``IncidentGroup``) when the group moves:
``firing`` with its first member, ``update`` when a member joins or the group's severity
steps up (a member's periodic updates move nothing), ``resolved`` with its last member.

>>> from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from scipy.special import pdtrc

from servewatch.models.detect.lifecycle import SEVERITY_RANK
from servewatch.models.detect.signal_detector import DetectorConfig, queue_makes_up
from servewatch.models.explain.hints import QUEUE_SIGNALS, slots_kept_full
from servewatch.models.explain.wording import event_id
from servewatch.schemas.anomaly import AnomalyEvent, Severity, Signal, Status
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import GroupMember, IncidentGroup

_FEEDBACK_KEPT = 10_000


#: Hints that say *when* an incident started, not what is wrong: they lead the event's hints
#: (the change is the first suspect) but do not group. Incidents after one change with
#: different diagnoses stay apart, and the change is on every member (``AnomalyEvent.change``).
CONTEXT_HINTS = frozenset({"change_marker"})

#: Causes that mean "the load did it", strongest first: a group holding one is explained by load.
#: A mix moved to longer prompts or outputs is load too, counted in tokens rather than requests.
LOAD_CAUSES = ("capacity_saturated", "queueing", "traffic_shift")
#: Causes a burst of demand can produce on its own (a queue and what it lengthens, bigger
#: batches decoding slower per token); an incident with one of these, fired under load, is
#: part of the load's story. The rest (the cache, truncation, errors, leaks, KV exhaustion)
#: are faults whatever the load. A decode slowdown at the usual arrivals still pages: demand
#: is read from arrivals, which a slower engine does not raise.
LOAD_PLAUSIBLE = frozenset(
    {*LOAD_CAUSES, "queue_building", "capacity_lost", "latency_rise", "latency_drift", "prefill_bound",
     "decode_slowdown", "kv_cache_pressure", "new_segment"}
    | {f"signal:{s.value}" for s in (Signal.TTFT, Signal.QUEUE_TIME, Signal.E2E, Signal.PREFILL_TIME,
                                     Signal.PREFILL_PER_TOKEN, Signal.THROUGHPUT, Signal.ITL)}
)  # fmt: skip
#: Demand (arrivals against the model's usual) from which a rise of a queue-sensitive signal is
#: read as the load's doing: the capacity model's surge ratio (``models.stats.capacity``).
DEMAND_SURGE = 1.3
#: How unlikely (-log10 of the chance) a window's arrivals must be under the model's usual
#: demand to count as a surge: 1 in 100, the bar at which the detector calls a window unusual
#: on its own (``DetectorConfig.threshold`` / 2).
SURGE_SURPRISE = DetectorConfig().unusual
#: Signals timed in seconds that include the wait for a slot: the queue's seconds are a share of them.
_QUEUE_TIMED = QUEUE_SIGNALS - {Signal.WAITING_REQUESTS}
#: The key under which a model's load group is kept open (one per model at a time).
_LOAD_KEY = "load"


def cause_of(event: AnomalyEvent) -> str:
    """An incident's likely cause, for grouping: its top diagnostic hint, else its signal."""
    codes = [hint.code for hint in event.hints if hint.code not in CONTEXT_HINTS]
    if codes and codes[0] == "replica_outlier":  # one group per replica: each one is drained on its own
        # (and an engine's own incidents join it while it is open: ``_group_for``)
        return f"replica_outlier {event.segment.get('instance', '')}"
    return codes[0] if codes else f"signal:{event.signal.value}"


def under_load(event: AnomalyEvent) -> bool:
    """Whether ``event`` fired as part of a load story: load explained it, or its model's
    demand was well above usual, or the engines were flat out while requests queued."""
    # Saturation and queueing explain wherever they rank; a mix shift only as the top cause (as a
    # lesser hint beside, say, slower prefill per token, it is context, not the explanation).
    if event.explained_by_load or cause_of(event) in LOAD_CAUSES or any(h.code in LOAD_CAUSES[:2] for h in event.hints):
        return True
    load = event.load
    if demand_explains(load, event.window_end - event.window_start):
        return True
    # Engines flat out explain a rise only where a queue makes a good part of it (as
    # ``SignalDetector._saturated`` asks): an engine that is usually near full is flat out at
    # its usual demand too, and a slower decode or prefill there is a fault, not the load.
    queue = load.get("queue_s", 0.0)
    queued = event.signal is Signal.QUEUE_TIME or (
        event.signal in _QUEUE_TIMED and queue_makes_up(event.signal, load, event.observed)
    )
    return queued and queue > 0 and slots_kept_full(load, unknown=False)


def demand_explains(load: Mapping[str, float], window_s: float) -> bool:
    """Whether a window's load alone tells a load story: its engines saturated, or its model's
    demand surged (``demand_surged``)."""
    return load.get("saturated", 0.0) > 0 or demand_surged(load, window_s)


def demand_surged(load: Mapping[str, float], window_s: float) -> bool:
    """Whether a window's demand was well above its model's usual, read two ways that must
    agree: the latency model's index (arrivals and their prompt tokens against the segment's
    reference) swings with a few long prompts in one window; the capacity model's arrivals
    against their usual rate do not. And the arrivals must be more than the luck of counting:
    a model that usually gets 17 requests a window gets 24 or more about one window in
    twenty, a ratio of 1.4 that means nothing, while 200 where 140 are usual is a surge. So
    the count must be one that usual demand (a Poisson count at its usual mean) reaches less
    often than ``SURGE_SURPRISE``. An event whose load carries no arrival count is judged on
    the ratios alone. (Real traffic is burstier than Poisson, so this errs towards a surge:
    towards the load group, as before the count was asked.)

    >>> surge = {"demand_vs_usual": 1.45, "arrivals_vs_usual": 1.4}
    >>> [demand_surged({**surge, "model_arrivals_per_s": rate}, 10.0) for rate in (2.4, 20.0)]
    [False, True]
    >>> demand_surged(surge, 10.0)
    True
    """
    readings = [load[name] for name in ("demand_vs_usual", "arrivals_vs_usual") if load.get(name, 0.0) > 0]
    if not readings or min(readings) < DEMAND_SURGE:
        return False
    arrivals, ratio = load.get("model_arrivals_per_s", 0.0) * window_s, load.get("arrivals_vs_usual", 0.0)
    if arrivals <= 0 or ratio <= 0:
        return True
    # P(N >= arrivals) for N ~ Poisson(usual): pdtrc(k, m) is P(N > k). The arrivals are a
    # count (a rate times the window): rounded, so float noise cannot add a request.
    chance = float(pdtrc(round(arrivals) - 1, arrivals / ratio))
    return chance <= 10.0**-SURGE_SURPRISE


def load_story(event: AnomalyEvent) -> bool:
    """Whether ``event`` belongs in its model's load group: a cause load can produce, under load."""
    return cause_of(event) in LOAD_PLAUSIBLE and under_load(event)


def strongest_cause(causes: list[str]) -> str:
    """A load group's cause: the strongest explanation among its members' (load first), else
    the first member's."""
    for cause in LOAD_CAUSES:
        if cause in causes:
            return cause
    return causes[0]


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
    load: bool = False  # the model's load group: explained by load, never pages
    causes: list[str] = field(default_factory=list)  # the members' own causes (a load group's)
    lower_since: float | None = None  # event time from which the open members were below ``severity``

    @property
    def slot(self) -> tuple[str, str]:
        """Where the grouper keeps it open: by model and cause, or as the model's load group."""
        return self.model, _LOAD_KEY if self.load else self.cause

    @property
    def open_members(self) -> list[GroupMember]:
        return [m for m in self.members.values() if m.status is Status.FIRING]

    def members_severity(self) -> Severity:
        open_ = self.open_members or list(self.members.values())
        return max((m.severity for m in open_), key=SEVERITY_RANK.__getitem__, default=Severity.INFO)

    def settle_severity(self, now: float, step_down_after_s: float) -> bool:
        """Move the group's severity to its members' as of ``now``: up at once, down only once
        they have been lower for ``step_down_after_s``; a load group stays ``info``. Whether it
        stepped up."""
        target = Severity.INFO if self.load else self.members_severity()
        rank, held = SEVERITY_RANK[target], SEVERITY_RANK[self.severity]
        if rank >= held:
            self.lower_since = None
            self.severity = target
            return rank > held
        if self.lower_since is None:
            self.lower_since = now
        if now - self.lower_since >= step_down_after_s:
            self.severity, self.lower_since = target, None
        return False


class IncidentGrouper:
    """Open groups by (model, cause), and which group each open incident is in."""

    def __init__(self, step_down_after_s: float = 60.0) -> None:
        self.step_down_after_s = step_down_after_s
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
            group = self._group_for(event)
            self._member_of[event.fingerprint] = group
            joined = True
        new = not group.members
        group.members[event.fingerprint] = GroupMember(
            fingerprint=event.fingerprint, signal=event.signal, segment=event.segment, status=event.status,
            severity=event.severity,
        )  # fmt: skip
        event = event.model_copy(update={"group": group.key, "feedback": self._feedback.get(group.key)})
        if joined and group.load:
            group.causes.append(cause_of(event))
            group.cause = strongest_cause(group.causes)
        stepped_up = group.settle_severity(event.window_end, self.step_down_after_s)
        if not group.open_members:  # the last member resolved: so does the group
            del self._open[group.slot]
            for fingerprint in group.members:
                self._member_of.pop(fingerprint, None)
            return event, [self._record(group, event, "resolved")]
        if new:
            return event, [self._record(group, event, "firing")]
        if joined or stepped_up:
            return event, [self._record(group, event, "update")]
        return event, []

    def _group_for(self, event: AnomalyEvent) -> _Group:
        """The open group ``event`` joins: its model's load group if it is part of the load's
        story, else its model's group of its cause; a new one if there is none."""
        model, cause = event.segment.get("model", "other"), cause_of(event)
        load = load_story(event)
        instance = event.segment.get("instance")
        if instance and not load:  # an engine's own pages join its open replica_outlier group: one story
            replica = self._open.get((model, f"replica_outlier {instance}"))
            if replica is not None:
                return replica
        group = self._open.get((model, _LOAD_KEY if load else cause))
        if group is None:
            group = _Group("", model, cause, event.window_start, load=load)
            group.key = group_key(*group.slot, event.window_start)
            self._open[group.slot] = group
        return group

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
            explained_by_load=group.load,
        )


__all__ = ["IncidentGrouper", "cause_of", "group_key", "load_story"]
