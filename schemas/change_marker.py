"""``ChangeMarker``: a change to a model's serving (a deploy, a config flip) at a point in time.

Written to ``servewatch.changes`` (keyed by model) by ``servewatch mark`` or a deploy pipeline
POSTing to the shipper's ``/v1/changes``. The worker names the latest marker on anomaly events
that start soon after it (``ChangeRef``), and verifies the change: the requests after it
against those before (``ChangeReport``, on the same topic), with rollback conditions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.version import SCHEMA_VERSION

Label = str


class ChangeMarker(BaseModel):
    """What changed, where and when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int = SCHEMA_VERSION
    kind: Literal["change_marker"] = "change_marker"
    id: str = Field(min_length=1, max_length=128, description="Unique per change (a UUID unless given).")
    at: float = Field(description="When the change took effect: unix seconds (event time of the request logs).")
    model: str = Field(min_length=1, max_length=256)
    instance: str | None = Field(default=None, max_length=256, description="The one instance changed, if not all.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free-form labels: deploy id, ticket, version.")
    description: str = Field(min_length=1, max_length=500, description='What changed: "enable prefix caching".')
    by: str = Field(default="", max_length=256, description="Who or what posted it.")
    source: Literal["cli", "http", "api"] = "cli"


class ChangeRef(BaseModel):
    """The change an anomaly event follows: which, and how many windows after it the anomaly started."""

    model_config = ConfigDict(frozen=True)

    id: str
    at: float
    description: str
    windows_after: int = Field(ge=0)
