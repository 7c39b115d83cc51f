"""``AnomalyEvent``: what servewatch tells people and machines about a deviation.

Identity follows Alertmanager: ``fingerprint`` is derived from labels (segment, signal and
the incident's start), everything else describes. One incident produces a ``firing`` event,
periodic updates while it lasts, and one ``resolved`` event.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from servewatch.schemas.change_marker import ChangeRef
from servewatch.schemas.evidence_pointer import EvidencePointer
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.signal import Signal
from servewatch.schemas.version import SCHEMA_VERSION

__all__ = ["AnomalyEvent", "Facets", "Hint", "Quantiles", "Severity", "Signal", "Status", "WindowFacets"]


class Status(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class Severity(StrEnum):
    """``info`` never pages (e.g. explained by load); ``warning`` and ``critical`` do."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class Hint(BaseModel):
    """A likely cause, from a documented set of codes."""

    model_config = ConfigDict(frozen=True)

    code: str
    message: str


class Quantiles(BaseModel):
    model_config = ConfigDict(frozen=True)

    p50: float
    p90: float
    p99: float


class WindowFacets(BaseModel):
    """How one window's requests of a segment looked, from the sample read back when the event fired."""

    window_start: float
    requests_sampled: int = Field(description="Requests of the segment and window in the messages read back.")
    finish_reasons: dict[str, float] = Field(description="Share of sampled requests per finish reason.")
    cached_token_share: float | None = Field(description="Prompt tokens served from the prefix cache.")
    shared_prefix_share: float | None = Field(
        description="Share of sampled requests whose prefix_hash another sampled request shares."
    )
    prompt_tokens: Quantiles | None
    completion_tokens: Quantiles | None
    instances: dict[str, float] = Field(description="Share of sampled requests per instance (the top five).")


class Facets(BaseModel):
    """The anomalous window against the segment's latest normal one, and what differs in words."""

    anomalous: WindowFacets | None = None
    baseline: WindowFacets | None = None
    changes: list[str] = Field(default_factory=list, description="Plain-language differences, largest first.")


class AnomalyEvent(BaseModel):
    """One lifecycle step (firing, update, resolved) of one incident of one signal in one segment.

    Frozen: built by one builder (``models.detect.events``); what is added after judging (the
    engines' config, the change it follows, the evidence read back, the group) makes a copy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    kind: Literal["incident"] = Field(
        default="incident", description="What this record on the anomaly topic is: one incident's event."
    )
    id: str = Field(description="Unique and deterministic per fingerprint, window and status.")
    fingerprint: str = Field(description="Stable per segment + signal + incident.")
    status: Status
    transition: Literal["firing", "update", "resolved"] = Field(
        default="firing",
        description="The incident's lifecycle step: 'firing' when it starts (or reopens), 'update' while it "
        "lasts (every few windows, or at once when its severity steps up), 'resolved' when it ends. A sink "
        "pages on 'firing' and may refresh on 'update'.",
    )
    signal: Signal
    segment: dict[str, str] = Field(description="Workload segment labels; always has 'model'.")
    window_start: float = Field(description="Unix seconds, inclusive.")
    window_end: float = Field(description="Unix seconds, exclusive.")
    observed: float
    expected: float
    score: float = Field(
        description="Surprise: -log10 of the tail probability of `observed` under the model "
        "(2 = 1 in 100, 3 = 1 in 1,000). The same scale on every signal."
    )
    severity: Severity
    load: dict[str, float] = Field(description="Load figures of the window: requests/s and tokens/s.")
    explained_by_load: bool
    hints: list[Hint] = Field(default_factory=list)
    evidence: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Request logs (never prompts), each with 'sample': 'slowest' or 'faulty' (the worst of the "
        "anomalous window by the signal), 'uniform' (a random pick of it) or 'baseline' (a random pick of the "
        "segment's latest normal window); a record that could not be read back has 'unavailable': true.",
    )
    facets: Facets | None = Field(default=None, description="The anomalous window's request mix vs the baseline's.")
    summary: str
    baseline_young: bool = Field(default=False, description="True while the segment's baseline has seen few windows.")
    group: str | None = Field(
        default=None,
        description="Key of the incident group this incident belongs to: incidents of one model with the same "
        "likely cause (top hint) that overlap in time (``IncidentGroup``, on the same topic).",
    )

    feedback: Feedback | None = Field(
        default=None, description="On-call's latest verdict on this incident's group (from the triage page)."
    )
    change: ChangeRef | None = Field(
        default=None,
        description="The change marker this incident started soon after (its model's latest, within the horizon).",
    )
    # Where the evidence is, between judging and the evidence read back; never on the wire.
    pointers: SkipJsonSchema[tuple[EvidencePointer, ...]] = Field(default=(), exclude=True, repr=False)

    @property
    def pages(self) -> bool:
        return self.status is Status.FIRING and self.severity is not Severity.INFO
