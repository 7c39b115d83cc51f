"""Where a message came from: what dead letters name and replays de-duplicate by."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MessageOrigin:
    """A message's topic, partition and offset, each unknown (None) where a reader has none."""

    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
