"""``Notification``: one message about one incident group, for one sink, ready to render.

The plan (``plan``) decides *when* a group is due at a sink and builds this snapshot;
a sink (``sinks/``) decides *how* it looks on the wire. Everything a payload needs is
here, so payload builders are pure functions of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from servewatch.schemas.anomaly import AnomalyEvent, Status
from servewatch.schemas.incident_group import IncidentGroup


@dataclass(frozen=True)
class Notification:
    sink: str
    group: IncidentGroup = field(repr=False)
    #: The latest event of every member incident, open ones first, the most severe and
    #: surprising first: ``members[0]`` is the one a one-incident message shows.
    members: tuple[AnomalyEvent, ...] = field(repr=False)
    seq: int  # notifications of this group to this sink so far, this one included
    sent_at: float  # wall clock when it was planned (Unix seconds)
    triage_url: str | None = None
    runbook_url: str | None = None
    #: What earlier deliveries of this group to this sink left behind (Slack bot: the
    #: message's ``channel`` and ``ts``, to edit it).
    memo: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return self.group.group

    @property
    def status(self) -> Status:
        return self.group.status

    @property
    def step(self) -> str:
        """What this message is *to its receiver*: ``firing`` (the first it hears of the group),
        ``update`` or ``resolved``. Not the group's own transition: after group_wait, the first
        message often carries a group that has already moved on from its firing record."""
        if self.status is Status.RESOLVED:
            return "resolved"
        return "firing" if self.seq == 1 else "update"

    @property
    def idempotency_key(self) -> str:
        """Stable for this group, status and sequence number: receivers may dedupe on it."""
        return f"servewatch:{self.key}:{self.status.value}:{self.seq}"

    @property
    def lead(self) -> AnomalyEvent | None:
        return self.members[0] if self.members else None
