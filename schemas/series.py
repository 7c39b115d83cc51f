"""``SeriesPoint``: what one segment's signals looked like in one judged window, against
what was expected and the band outside which a window is anomalous.

The worker sends one per segment and judged window to ``servewatch.series`` (keyed by the
segment key), so a chart can show a signal over hours with its expected band and the load
beneath on the same time axis: "not explained by volume" at a glance. Bands are the
single-window bounds at the paging threshold; an incident can also fire on a run of
windows inside them (two looks, drift, a rate's cumulative evidence).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.version import SCHEMA_VERSION


class SignalPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    observed: float
    expected: float
    low: float | None = Field(default=None, description="Lower bound of the normal band (None: not modelled).")
    high: float | None = Field(default=None, description="Upper bound of the normal band (None: not modelled).")
    score: float = Field(description="Surprise of the window (-log10 p), as on AnomalyEvent.")
    anomalous: bool = Field(description="The window itself was beyond the paging threshold.")
    firing: bool = Field(description="An incident of this signal was open after this window.")


class SeriesPoint(BaseModel):
    """One segment's judged window: each signal against its expected value and band, and the load."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    kind: Literal["series"] = "series"
    key: str = Field(description="The segment key (stable, e.g. 'model=m|route=chat|...').")
    segment: dict[str, str] = Field(description="Segment labels; always has 'model'.")
    window_start: float
    window_end: float
    load: dict[str, float] = Field(description="requests_per_s, prompt_tokens_per_s, output_tokens_per_s, ...")
    signals: dict[str, SignalPoint] = Field(description="Judged signals of the window, by signal name.")
