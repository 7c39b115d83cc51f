"""``RequestLog``: one served LLM request, as the detector reads it.

Strict where a wrong value would corrupt a statistic (token counts, timings, timestamps),
lenient where engines disagree (unknown finish reasons are kept as ``other``, extra fields
are ignored). Every bound below is a reason a record goes to the dead-letter topic.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from servewatch.schemas.version import SCHEMA_VERSION

# Bounds that reject absurd values rather than let one record skew a window.
MAX_TOKENS_PER_REQUEST = 10_000_000
MAX_SECONDS = 86_400.0  # a request that ran for more than a day is a logging bug
MAX_TEXT_CHARS = 1_000_000
MIN_TIMESTAMP = 946_684_800.0  # 2000-01-01: earlier means ms/us units or a zero default
MAX_TIMESTAMP = 4_102_444_800.0  # 2100-01-01

# strict: a boolean or a numeric string is a producer bug, not a count of 1.
TokenCount = Annotated[int, Field(ge=0, le=MAX_TOKENS_PER_REQUEST, strict=True)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_SECONDS, allow_inf_nan=False, strict=True)]
ShortLabel = Annotated[str, Field(min_length=1, max_length=256)]
StatusCode = Annotated[int, Field(ge=100, le=599)]
ErrorText = Annotated[str, Field(max_length=4096)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class FinishReason(StrEnum):
    """Why generation stopped. Values engines use, plus ``other`` for anything else."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TOOL_CALLS = "tool_calls"
    REPETITION = "repetition"
    OTHER = "other"


class Engine(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


#: TTFT may exceed the end-to-end time by clock rounding, no more.
TTFT_SLACK_S = 1e-3


def cached_exceeds_prompt(cached_tokens: Any, prompt_tokens: Any) -> Any:
    """The first cross-field rule, broken: more cached prompt tokens than prompt tokens. Every
    form of a request log checks it with this: numbers (``RequestLog``, one ``FastRow``) and
    numpy columns (a batch of rows, NaN where absent, which breaks no rule)."""
    return cached_tokens > prompt_tokens


def ttft_exceeds_e2e(ttft_s: Any, e2e_s: Any) -> Any:
    """The second cross-field rule, broken: a first token after the response ended."""
    return ttft_s > e2e_s + TTFT_SLACK_S


class RequestLog(BaseModel):
    """One finished request. ``timestamp`` is when it finished, in unix seconds (UTC)."""

    # Strings are kept as sent (no stripping): a request id must match the user's own logs.
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: int = SCHEMA_VERSION
    request_id: ShortLabel
    timestamp: float = Field(description="When the request finished: unix seconds or ISO-8601.")
    model: ShortLabel
    prompt_tokens: TokenCount
    completion_tokens: TokenCount
    e2e_s: Seconds
    finish_reason: FinishReason

    ttft_s: Seconds | None = None
    queue_s: Seconds | None = None
    prefill_s: Seconds | None = None
    decode_s: Seconds | None = None
    cached_tokens: TokenCount | None = None
    reasoning_tokens: TokenCount | None = None
    max_tokens: TokenCount | None = None
    status_code: StatusCode | None = None
    error: ErrorText | None = None
    route: ShortLabel | None = None
    tenant: ShortLabel | None = None
    instance: ShortLabel | None = None
    engine: Engine | None = None
    engine_version: ShortLabel | None = None
    prefix_hash: ShortLabel | None = None
    content: Text | None = None
    reasoning_content: Text | None = None

    @field_validator("timestamp", mode="before")
    @classmethod
    def _parse_timestamp(cls, value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError("timestamp must be unix seconds or ISO-8601, not a boolean")
        try:
            if isinstance(value, str):
                try:
                    seconds = float(value)
                except ValueError:
                    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
                    if parsed.tzinfo is None:  # no zone given: UTC, never the worker's local time
                        parsed = parsed.replace(tzinfo=UTC)
                    seconds = parsed.timestamp()
            elif isinstance(value, int | float):
                seconds = float(value)
            else:
                raise ValueError("timestamp must be unix seconds or ISO-8601")
        except OverflowError:
            raise ValueError(f"timestamp {str(value)[:40]} is out of range") from None
        if not math.isfinite(seconds) or not MIN_TIMESTAMP <= seconds <= MAX_TIMESTAMP:
            raise ValueError(
                f"timestamp {value!r} is outside 2000..2100 in unix seconds (milliseconds sent as seconds?)"
            )
        return seconds

    @field_validator("finish_reason", mode="before")
    @classmethod
    def _unknown_reason_is_other(cls, value: Any) -> Any:
        if isinstance(value, str):
            lowered = value.strip().lower()
            return lowered if lowered in FinishReason._value2member_map_ else FinishReason.OTHER
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RequestLog:
        if self.cached_tokens is not None and cached_exceeds_prompt(self.cached_tokens, self.prompt_tokens):
            raise ValueError("cached_tokens exceeds prompt_tokens")
        if self.ttft_s is not None and ttft_exceeds_e2e(self.ttft_s, self.e2e_s):
            raise ValueError("ttft_s exceeds e2e_s")
        return self

    def to_row(self) -> dict[str, Any]:
        """This record as the plain dict the hot path's row (``FastRow``) is built from."""
        row = self.model_dump(exclude={"schema_version"}, exclude_none=True)
        row["finish_reason"] = self.finish_reason.value
        if self.engine is not None:
            row["engine"] = self.engine.value
        return row

    @property
    def uncached_prompt_tokens(self) -> int:
        return self.prompt_tokens - (self.cached_tokens or 0)

    @property
    def is_error(self) -> bool:
        return self.finish_reason in (FinishReason.ERROR, FinishReason.ABORT) or (
            self.status_code is not None and self.status_code >= 500
        )
