"""``Feedback``: on-call's verdict on an incident group, from the triage page.

Written to ``servewatch.feedback`` (keyed by group) with who and when. The worker carries
the latest verdict on the group's later records, and an ``expected`` verdict widens the
tolerance of the group's signals in its model's segments for a while (see
docs/triage.md, "What a verdict changes"), so a known, accepted change stops paging.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.version import SCHEMA_VERSION

Verdict = Literal["expected", "not_expected", "acknowledged"]


class Feedback(BaseModel):
    """On-call's verdict on an incident group, with who gave it and when."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    kind: Literal["feedback"] = "feedback"
    group: str = Field(description="The incident group's key.")
    model: str
    verdict: Verdict
    signals: list[str] = Field(default_factory=list, description="The group's signals when the verdict was given.")
    by: str = Field(min_length=1, description="Who gave it.")
    at: float = Field(description="Unix seconds.")
    comment: str = Field(default="", max_length=2000)
