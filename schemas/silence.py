"""``Silence``: mute notifications that match, for a while or on a schedule.

As in Alertmanager, a silence is a set of label matchers plus a time span; a notification
whose labels satisfy every matcher while the silence is active is not sent, but still
recorded (``Delivery`` with outcome ``silenced``). A *maintenance window* is the same with a
weekly ``recurrence``: active on the listed weekdays between two times of day (UTC),
within ``starts_at``/``ends_at``. Silences live on a compacted topic keyed by ``id``; the
latest record of an id wins, so expiring one is writing it again with ``ends_at`` = now.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from servewatch.schemas.version import SCHEMA_VERSION

#: Operators, Alertmanager's: equal, not equal, regex match, regex no match (full match).
MatchOp = Literal["=", "!=", "=~", "!~"]


_MATCHER_TEXT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*(.*)$")


class Matcher(BaseModel):
    """One label condition, e.g. ``model="llama-70b"`` or ``severity=~"warning|critical"``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    op: MatchOp = "="
    value: str

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, data: Any) -> Any:
        """Alertmanager's string form too: ``model=~"llama.*"`` (quotes optional)."""
        if not isinstance(data, str):
            return data
        found = _MATCHER_TEXT.match(data.strip())
        if not found:
            raise ValueError(f"matcher {data!r}: write NAME=VALUE, NAME!=VALUE, NAME=~REGEX or NAME!~REGEX")
        name, op, value = found.groups()
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        return {"name": name, "op": op, "value": value}

    @model_validator(mode="after")
    def _regex_compiles(self) -> Matcher:
        if self.op in ("=~", "!~"):
            try:
                re.compile(self.value)
            except re.error as exc:
                raise ValueError(
                    f"matcher {self.name}{self.op}{self.value!r}: not a regular expression ({exc})"
                ) from None
        return self

    def __str__(self) -> str:
        return f'{self.name}{self.op}"{self.value}"'


class Recurrence(BaseModel):
    """A weekly maintenance window: these weekdays, from ``start`` to ``end`` (UTC, ``HH:MM``).

    ``end`` before ``start`` spans midnight (``22:00``-``02:00``); the span belongs to the day
    it starts on.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    weekdays: list[Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]] = Field(
        default_factory=lambda: ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]  # type: ignore[arg-type]
    )
    start: str = Field(pattern=r"^([01]\d|2[0-3]):[0-5]\d$")
    end: str = Field(pattern=r"^([01]\d|2[0-3]):[0-5]\d$")


#: The end of a recurring silence given none (9999-12-31T23:59:59Z): it recurs until expired.
UNTIL_EXPIRED = 253_402_300_799.0


class Silence(BaseModel):
    """Label matchers and a time span (or a weekly window) during which matching notifications are muted."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    id: str = Field(min_length=1)
    matchers: list[Matcher] = Field(min_length=1, description="Every one must hold for the silence to apply.")
    starts_at: float = Field(description="Unix seconds.")
    ends_at: float = Field(description="Unix seconds; expiring a silence sets it to now.")
    recurrence: Recurrence | None = Field(default=None, description="Set for a recurring maintenance window.")
    created_by: str = ""
    comment: str = ""

    @field_validator("matchers")
    @classmethod
    def _names_unique_per_op(cls, matchers: list[Matcher]) -> list[Matcher]:
        seen = {(m.name, m.op, m.value) for m in matchers}
        if len(seen) != len(matchers):
            raise ValueError("a silence lists the same matcher twice")
        return matchers

    @model_validator(mode="after")
    def _ends_after_start(self) -> Silence:
        if self.ends_at < self.starts_at:
            raise ValueError("a silence must end after it starts")
        return self
