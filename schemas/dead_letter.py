"""``DeadLetter``: an input record servewatch could not accept, kept with its reason."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.version import SCHEMA_VERSION


class DeadLetter(BaseModel):
    """A rejected input: its bytes, why it was refused, and where it came from."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    reason: str = Field(description="Short machine-readable cause, e.g. 'invalid_json', 'validation'.")
    error: str = Field(description="The parser's or validator's message.")
    raw: str = Field(description="The rejected bytes as text (invalid UTF-8 replaced), cut to 64 KiB.")
    raw_truncated: bool = False
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None
    record_index: int | None = Field(default=None, description="Position inside a batched message.")
    received_at: float = Field(description="Unix seconds when servewatch rejected it.")
