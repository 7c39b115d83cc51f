"""``ChangeReport``: did a change (a deploy, a config flip) make a model's serving better or worse?

Written by ``models.compare`` from the requests before and after a marker, read by
``servewatch compare`` and anything that gates a rollout on it. Each signal row says what the
period after would have shown with the period before's mix of segments, load and cache
eligibility (post-stratified), so a shift towards longer prompts, a quieter hour or less
prefix reuse does not pass for a regression; rendering is the CLI's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.version import SCHEMA_VERSION

#: ``inconclusive``: enough requests, but too few of them had a counterpart on the other side
#: (same segment, load band and cache eligibility) for a verdict to be earned.
Verdict = Literal["improved", "no change", "regressed", "insufficient data", "inconclusive"]


class Period(BaseModel):
    """One side of the comparison: its first and last request (unix seconds) and how many."""

    model_config = ConfigDict(frozen=True)

    first: float | None = None
    last: float | None = None
    requests: int = Field(ge=0)


class TrafficMix(BaseModel):
    """What each period's traffic was, held fixed by the comparison rather than judged: its
    arrival rate (requests per second), and the share of its requests whose prompt prefix was seen shortly before
    (cache-eligible; None where the logs carry no prefix hash)."""

    model_config = ConfigDict(frozen=True)

    rate_before: float | None
    rate_after: float | None
    eligible_before: float | None = None
    eligible_after: float | None = None


class SignalChange(BaseModel):
    """One signal, before against after, both weighted to the before period's segment mix.

    ``change`` is after / before for latencies and throughput (``kind="ratio"``: 1.10 is 10 %
    more), after - before in percentage points for shares (``kind="points"``); ``ci_low`` and
    ``ci_high`` bound it (stratified bootstrap). Shares ``before`` and ``after`` are fractions.
    """

    model_config = ConfigDict(frozen=True)

    signal: str
    kind: Literal["ratio", "points"]
    better: Literal["lower", "higher"]
    before: float | None
    after: float | None
    change: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: Verdict
    reason: str | None = Field(default=None, description="Why the verdict is inconclusive, in the traffic's terms.")
    segments_used: int = Field(
        ge=0, description="strata (segment, load band, cache eligibility) with enough requests on both sides"
    )
    coverage_before: float = Field(ge=0.0, le=1.0, description="share of the before requests in those strata")
    coverage_after: float = Field(ge=0.0, le=1.0, description="share of the after requests in those strata")


class RollbackCheck(BaseModel):
    """One declared rollback condition, evaluated on a report's periods."""

    model_config = ConfigDict(frozen=True)

    condition: str = Field(description='The condition as declared: "ttft_p95 +20 % on any segment >= 200 requests".')
    holds: bool
    where: str | None = Field(default=None, description="The segment (or 'model') where it held, the worst first.")
    change: float | None = Field(default=None, description="The signal's change there (ratio or points).")
    ci_low: float | None = None
    ci_high: float | None = None
    detail: str = Field(default="", description="In words: what was compared and what it showed.")


class ChangeReport(BaseModel):
    """Per model: the two periods and a verdict per signal."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = SCHEMA_VERSION
    kind: Literal["change_report"] = "change_report"
    model: str
    before: Period
    after: Period
    segments: int = Field(ge=0, description="segments seen on either side")
    confidence: float = Field(gt=0.0, lt=1.0)
    resamples: int = Field(ge=1)
    min_requests: int = Field(ge=1)
    signals: list[SignalChange]
    simultaneous: bool = Field(
        default=False, description="The CIs hold together over the signals (Bonferroni): a report's family error."
    )
    change: str | None = Field(default=None, description="The ChangeMarker's id (live reports).")
    description: str | None = Field(default=None, description="The change's description (live reports).")
    final: bool = Field(default=True, description="False while the period after is still filling (live reports).")
    rollback: list[RollbackCheck] = Field(default_factory=list, description="Declared rollback conditions.")
    traffic: TrafficMix | None = Field(default=None, description="The traffic held fixed (None: not held).")
