"""Where an event's evidence is, before it is read back: small frozen pointers.

The detector judges aggregates, not requests; what it can say is where the requests worth
showing are. Stage 2 gives the baseline sample its messages (``RecentSources``), and the
evidence stage reads the requests back from the requests topic and replaces the pointers by
them (``pipeline.worker.evidence``). Pointers never go on the wire: an event carries them
only between judging and its evidence.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.signal import Signal


class RequestAt(BaseModel):
    """A request log's place: the requests topic's partition and offset, and its index in the message."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    partition: int
    offset: int
    index: int


class KeptRequest(BaseModel):
    """One of the window's slowest requests by TTFT, kept by the fold with its place."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["kept"] = "kept"
    ttft_s: float
    location: RequestAt


class WorstBy(BaseModel):
    """The window sample's slowest requests by the signal's own measure (decode, prefill...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["worst"] = "worst"
    signal: Signal


class FaultScan(BaseModel):
    """The window sample's requests that show the signal's fault (cut, leaked, failed...)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["scan"] = "scan"
    signal: Signal


class WindowSample(BaseModel):
    """A segment's window whose requests are sampled: the anomalous one, or its latest normal
    one (``baseline``). ``sources`` are the (partition, first offset, last offset) ranges of
    the messages that fed it; None until stage 2 finds them for a baseline window."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["window_sample"] = "window_sample"
    sample: Literal["anomalous", "baseline"]
    segment: str
    window_start: float
    window_end: float
    sources: tuple[tuple[int, int, int], ...] | None = None


EvidencePointer = Annotated[KeptRequest | WorstBy | FaultScan | WindowSample, Field(discriminator="kind")]
