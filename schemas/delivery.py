"""``Delivery``: what the notifier did with one notification for one sink.

Written to ``servewatch.notifications`` for every outcome, so who was told what, and what
was kept quiet by a silence, can be read back later (``servewatch tail`` reads anomalies;
this topic answers "did the page go out?"). At least once: a notifier that crashes after
booking an outcome publishes it again when it restarts, so read them by ``idempotency_key``
and ``outcome``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.anomaly import Status
from servewatch.schemas.version import SCHEMA_VERSION

#: ``sent``: the receiver accepted it. ``silenced``: a silence matched, nothing was sent.
#: ``rejected``: the receiver refused it for good (4xx other than 429): dead-lettered.
#: ``abandoned``: retried until the sink's ``give_up_after``: dead-lettered.
Outcome = Literal["sent", "silenced", "rejected", "abandoned"]


class Delivery(BaseModel):
    """One notification's outcome at one sink: sent, silenced, rejected or abandoned."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    kind: Literal["delivery"] = "delivery"
    sink: str
    sink_type: str
    group: str = Field(description="The incident group's key (or an ungrouped incident's fingerprint).")
    model: str
    status: Status
    seq: int = Field(description="Notifications of this group to this sink so far, this one included.")
    idempotency_key: str
    outcome: Outcome
    at: float = Field(description="Unix seconds (wall clock) of the outcome.")
    attempts: int = 0
    silence: str | None = Field(default=None, description="The id of the silence that muted it.")
    detail: str = Field(default="", description="The receiver's answer on failure; empty otherwise.")
