"""Change verification's config: how long the periods are, and the rollback conditions.

YAML or TOML (``SERVEWATCH_CHANGES_CONFIG``)::

    before: 30m          # the period before a marker compared with ...
    after: 30m           # ... the period after it (event time)
    check_every: 5m      # a report (and the rollback check) this often while the period after fills
    rollback:
      - signal: ttft_p95
        worse_by: 20%    # latencies and throughput: a percentage; shares: points ("0.1pt")
        scope: segment   # any segment (route and prompt band) ... or "model"
        min_requests: 200
      - signal: error_share
        worse_by: 0.1pt

A condition holds when the estimate crossed its limit and the interval excludes no change
(``models.compare.rollback``); it then pages ``critical`` through the notifier's sinks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from servewatch.models.compare.rollback import RollbackCondition
from servewatch.models.compare.signals import SIGNALS
from servewatch.pipeline.config_files import ConfigError, parse_mapping, read_config_text
from servewatch.pipeline.durations import Duration

_POINTS = {spec.name for spec in SIGNALS if spec.points}


class ConditionConfig(BaseModel):
    """One rollback condition as declared; ``condition()`` is its checkable form."""

    model_config = ConfigDict(extra="forbid")

    signal: str
    worse_by: float | str
    scope: Literal["model", "segment"] = "model"
    min_requests: int = Field(default=200, ge=1)

    @field_validator("signal")
    @classmethod
    def _known(cls, value: str) -> str:
        names = [spec.name for spec in SIGNALS]
        if value not in names:
            raise ValueError(f"unknown signal {value!r}; one of {', '.join(names)}")
        return value

    @model_validator(mode="after")
    def _amount(self) -> ConditionConfig:
        self.worse_by = amount(self.worse_by, points=self.signal in _POINTS)
        return self

    def condition(self) -> RollbackCondition:
        return RollbackCondition(self.signal, float(self.worse_by), self.scope, self.min_requests)


def amount(value: float | str, points: bool) -> float:
    """``20%`` (0.2) for ratio signals, ``0.1pt`` (0.1) for shares, or a plain number.

    >>> amount("20%", points=False), amount("0.1pt", points=True), amount(0.3, points=False)
    (0.2, 0.1, 0.3)
    """
    text = str(value).strip().replace(" ", "")
    if text.endswith("%"):
        if points:
            raise ValueError(f"worse_by {value!r}: a share's limit is in points (e.g. 0.1pt)")
        number = float(text[:-1]) / 100
    elif text.endswith("pt"):
        if not points:
            raise ValueError(f"worse_by {value!r}: a latency's or throughput's limit is a percentage (e.g. 20%)")
        number = float(text[:-2])
    else:
        number = float(text)
    if not number > 0:
        raise ValueError(f"worse_by {value!r} must be positive")
    return number


class ChangesConfig(BaseModel):
    """The periods compared around each marker and the rollback conditions."""

    model_config = ConfigDict(extra="forbid")

    before: Duration = Field(default=1800.0, gt=0)
    after: Duration = Field(default=1800.0, gt=0)
    check_every: Duration = Field(default=300.0, gt=0)
    min_requests: int = Field(default=30, ge=1, description="Requests a segment needs on both sides in a report.")
    resamples: int = Field(default=500, ge=50)
    max_requests: int = Field(
        default=50_000, ge=100, description="Requests kept per period (a uniform reservoir beyond it)."
    )
    idle_final: Duration = Field(
        default=300.0, gt=0, description="Wall seconds without a new request of the model before a report is final."
    )
    prefix_lifetime: Duration = Field(
        default=600.0,
        gt=0,
        description="How long a prompt prefix counts as cached after a request with it "
        "arrived: a request is cache-eligible when one with its prefix_hash came within it.",
    )
    min_stratum_requests: int = Field(
        default=10,
        ge=1,
        description="Requests a stratum (segment, prompt octave, eligibility, load band) needs "
        "on both sides to count in the comparison.",
    )
    rollback: list[ConditionConfig] = Field(default_factory=list)

    def conditions(self) -> list[RollbackCondition]:
        return [item.condition() for item in self.rollback]


def parse_changes_config(text: str, suffix: str) -> ChangesConfig:
    raw: Any = parse_mapping(text, suffix)
    if not isinstance(raw or {}, dict):
        raise ConfigError("the file must hold a mapping (before, after, check_every, rollback)")
    try:
        return ChangesConfig.model_validate(raw or {})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(problems) from None


def load_changes_config(path: str | Path | None) -> ChangesConfig:
    """The file's config (``None``: the defaults, no rollback conditions)."""
    if path is None:
        return ChangesConfig()
    text, suffix = read_config_text(path)
    return parse_changes_config(text, suffix)
