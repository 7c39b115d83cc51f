"""``IncidentGroup``: incidents that share a likely cause, told as one.

One cause rarely stays in one segment: prefix caching switched off slows TTFT and prefill
and drops the hit rate in every segment of the model at once, dozens of incidents. They
share a *group*: the same model, the same top hint, overlapping in time (Alertmanager's
grouping, with the cause as the grouping label). Each member's ``AnomalyEvent`` names its
``group``; the group itself is told by ``IncidentGroup`` records on the same anomaly topic,
one per lifecycle step (``firing`` when its first incident fires, ``update`` when members
join or its severity steps up, ``resolved`` when its last member resolves), so a sink can
page once per group. ``kind`` tells the two record types apart (``parse_anomaly_record``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import from_json

from servewatch.schemas.anomaly import AnomalyEvent, Severity, Signal, Status
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.version import SCHEMA_VERSION


class GroupMember(BaseModel):
    model_config = ConfigDict(extra="forbid")

    fingerprint: str
    signal: Signal
    segment: dict[str, str]
    status: Status
    severity: Severity


class IncidentGroup(BaseModel):
    """One lifecycle step of a group of incidents of one model with one likely cause."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    kind: Literal["group"] = "group"
    id: str = Field(description="Unique and deterministic per group and lifecycle step.")
    group: str = Field(description="Stable per model + cause + the group's start: the key members carry.")
    status: Status
    transition: Literal["firing", "update", "resolved"]
    cause: str = Field(description="The hint code the members share (their likely cause).")
    model: str
    severity: Severity = Field(
        description="The highest severity among members still open (down only after it has held a while); always "
        "'info' for a group explained by load."
    )
    window_start: float = Field(description="Unix seconds: when the group's first incident started.")
    window_end: float = Field(description="Unix seconds: the end of the window that moved the group.")
    members: list[GroupMember] = Field(description="Every incident the group has held, its latest state.")
    signals: list[Signal] = Field(description="The members' signals, in order of first appearance.")
    segments: int = Field(description="Distinct segments among the members.")
    title: str = Field(description="One line: the cause, the model, how many segments, which signals.")
    summary: str
    feedback: Feedback | None = Field(default=None, description="On-call's latest verdict on the group.")
    explained_by_load: bool = Field(
        default=False,
        description="The model's load group: incidents a burst or surge of demand explains (a queue, what it "
        "lengthens), told together and never paging.",
    )

    @property
    def pages(self) -> bool:
        return self.status is Status.FIRING and self.severity is not Severity.INFO


#: A record of the anomaly topic: an incident's event or a group's.
AnomalyRecord = Annotated[AnomalyEvent | IncidentGroup, Field(discriminator="kind")]
_RECORD: TypeAdapter[AnomalyEvent | IncidentGroup] = TypeAdapter(AnomalyRecord)


def parse_anomaly_record(raw: bytes | str) -> AnomalyEvent | IncidentGroup:
    """One anomaly-topic record (JSON), whichever kind it is.

    Fields this version does not know are ignored on read: during a rolling upgrade a newer
    worker's records (a field added by a minor version) must not stop an older reader. The
    models still forbid them when built in code, where an unknown field is a typo.
    """
    try:
        return _RECORD.validate_json(raw)
    except ValidationError as exc:
        if not exc.errors() or any(err["type"] != "extra_forbidden" for err in exc.errors()):
            raise
    data = from_json(raw)
    known = (IncidentGroup if data.get("kind") == "group" else AnomalyEvent).model_fields
    return _RECORD.validate_python({key: value for key, value in data.items() if key in known})
