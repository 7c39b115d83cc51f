"""``servewatch replay``: the worker's stream logic over a file, in event time, with no broker.

The same ``StageOne`` -> ``StageTwo`` code the Faust agents run, fed line by line. Windows
are released the moment stage 1's watermark passes them (there is only one source, so
there is nothing to wait for), which makes a replay deterministic: the same file gives the
same events, byte for byte.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from pipeline.decode import Source
from pipeline.settings import Settings
from pipeline.stages import StageOne, StageTwo
from schemas.anomaly import AnomalyEvent
from schemas.dead_letter import DeadLetter

logger = logging.getLogger(__name__)


@dataclass
class ReplayStats:
    messages: int = 0
    records: int = 0
    dead_letters: int = 0
    events: int = 0
    windows: int = 0
    dead_letter_samples: list[DeadLetter] = field(default_factory=list)


class Replay:
    """Feed messages (one JSON record, array or NDJSON chunk each); collect anomaly events."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.stage_one = StageOne(self.settings)
        self.stage_two = StageTwo(self.settings)
        self.stats = ReplayStats()

    def feed(self, raw: bytes, offset: int | None = None) -> list[AnomalyEvent]:
        letters, partials = self.stage_one.process(raw, Source(topic="file", partition=0, offset=offset), now=0.0)
        self.stats.messages += 1
        self.stats.dead_letters += len(letters)
        if letters and len(self.stats.dead_letter_samples) < 20:
            self.stats.dead_letter_samples.extend(letters[: 20 - len(self.stats.dead_letter_samples)])
        return self._judge(partials, final=False)

    def finish(self) -> list[AnomalyEvent]:
        return self._judge(self.stage_one.flush_all(), final=True)

    def _judge(self, partials: list, final: bool) -> list[AnomalyEvent]:
        if not partials and not final:
            return []
        for partial in partials:
            self.stats.records += partial.requests
            self.stage_two.add(partial, now=0.0)
        events = self.stage_two.release_all()
        self.stats.windows = self.stage_two.bank.windows_judged
        self.stats.events += len(events)
        return events

    def run(
        self, messages: Iterable[bytes], progress: Callable[[ReplayStats], None] | None = None
    ) -> Iterator[AnomalyEvent]:
        for offset, raw in enumerate(messages):
            yield from self.feed(raw, offset)
            if progress is not None and offset % 100 == 0:
                progress(self.stats)
        yield from self.finish()
