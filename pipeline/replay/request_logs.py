"""``servewatch replay``: the worker's stream logic over a file, in event time, with no broker.

The same ``StageOne`` -> ``StageTwo`` code the Faust agents run, fed chunk by chunk (a
chunk plays the part of a Kafka message; its number is the offset). Windows are released
the moment stage 1's watermark passes them (there is only one source, so there is nothing
to wait for), which makes a replay deterministic: the same file gives the same events,
byte for byte. Evidence is read back from the file (``JsonlChunks.reread``), or, for a
stream that cannot be re-read, from the chunks still spanned by open windows.
"""

from __future__ import annotations

import itertools
import logging
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from servewatch.models.windows.segment_keys import is_replica_key
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker.evidence import fill, wanted
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter

logger = logging.getLogger(__name__)

#: Lines per message when replaying a JSONL file: the worker's batched fast path, same code.
REPLAY_CHUNK_LINES = 1000

#: Judged windows whose messages a replay of a stream it cannot re-read (stdin) keeps, for
#: the baseline samples of the events that follow them.
BASELINE_WINDOWS_KEPT = 3


@dataclass
class ReplayStats:
    messages: int = 0
    records: int = 0
    dead_letters: int = 0
    events: int = 0
    windows: int = 0
    dead_letter_samples: list[DeadLetter] = field(default_factory=list)


class Replay:
    """Feed messages (one JSON record, array or NDJSON chunk each); collect anomaly events.

    ``reread(offset)`` gives a fed message back, for evidence; without it, the replay keeps
    the messages that windows still open may point at (a window's worth of input).
    """

    def __init__(self, settings: Settings | None = None, reread: Callable[[int], bytes | None] | None = None) -> None:
        self.settings = settings or Settings()
        self.stage_one = StageOne(self.settings)
        self.stage_two = StageTwo(self.settings)
        self._budget = self.settings.evidence_budget()
        self._segment_of = self.settings.segmenter().key_of_row  # rate events' evidence scans
        self.stats = ReplayStats()
        self._reread = reread
        self._kept: dict[int, bytes] = {}

    def feed(self, raw: bytes, offset: int) -> list[AnomalyEvent]:
        if self._reread is None:
            self._kept[offset] = raw
        letters, partials = self.stage_one.process(
            raw, MessageOrigin(topic="file", partition=0, offset=offset), now=0.0
        )
        self.stats.messages += 1
        self.stats.dead_letters += len(letters)
        if letters and len(self.stats.dead_letter_samples) < 20:
            self.stats.dead_letter_samples.extend(letters[: 20 - len(self.stats.dead_letter_samples)])
        events = self._judge(partials, final=False)
        self._forget_unreferenced()
        return events

    def finish(self) -> list[AnomalyEvent]:
        events = self._judge(self.stage_one.flush_all(), final=True)
        self._kept.clear()
        return events

    def _judge(self, partials: list, final: bool) -> list[AnomalyEvent]:
        if not partials and not final:
            return []
        for partial in partials:
            if not is_replica_key(partial.key):  # a replica row holds its segment's records again
                self.stats.records += partial.requests
            self.stage_two.add(partial, now=0.0)
        events = self.stage_two.release_all(final)
        del self.stage_two.late_letters[20:]  # a replay counts late records; a few letters say where
        self.stats.windows = self.stage_two.bank.windows_judged
        self.stats.events += len(events)
        keys = wanted(events)
        if keys:
            messages = {key: self._message(key[1]) for key in keys}
            events = fill(events, messages, self._budget, self._segment_of)
        return events

    def _message(self, offset: int) -> bytes | None:
        return self._reread(offset) if self._reread is not None else self._kept.get(offset)

    def _forget_unreferenced(self) -> None:
        """Drop kept messages older than every open window, unfolded message and the last
        ``BASELINE_WINDOWS_KEPT`` judged windows: no evidence, a baseline sample's included,
        can point at them (an older baseline window then goes without its sample)."""
        if not self._kept:
            return
        held = [w.offsets.get(0, (0, 0))[0] for w in self.stage_one.windower.open.values()]
        held.extend(self.stage_one.oldest_pending_offset.values())  # decoded, not folded yet
        recent = self.stage_two.recent
        for start in recent.starts()[-BASELINE_WINDOWS_KEPT:]:
            held.extend(first for partition, first, _ in recent.of(start) or () if partition == 0)
        oldest = min(held, default=None)
        for offset in [o for o in self._kept if oldest is None or o < oldest]:
            del self._kept[offset]

    def run(
        self, messages: Iterable[bytes], progress: Callable[[ReplayStats], None] | None = None
    ) -> Iterator[AnomalyEvent]:
        for offset, raw in enumerate(messages):
            yield from self.feed(raw, offset)
            if progress is not None and offset % 100 == 0:
                progress(self.stats)
        yield from self.finish()


class JsonlChunks:
    """A JSONL file (or ``-`` for stdin) as NDJSON chunks of ``lines`` lines, re-readable by number.

    Iterating yields the chunks in order and notes where each starts; ``reread(n)`` reads
    chunk ``n`` again from there (``None`` for stdin, which cannot be re-read). Blank lines
    are kept, so positions map back to line numbers.
    """

    def __init__(self, path: str, lines: int = 1000) -> None:
        self.path, self.lines = path, lines
        self._starts = array("q")  # byte position of each chunk read so far

    @property
    def rereadable(self) -> bool:
        return self.path != "-"

    def __iter__(self) -> Iterator[bytes]:
        stream: BinaryIO = sys.stdin.buffer if self.path == "-" else open(self.path, "rb")  # noqa: SIM115
        try:
            position = 0
            while chunk := list(itertools.islice(stream, self.lines)):
                self._starts.append(position)
                raw = b"".join(chunk)
                position += len(raw)
                yield raw
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()

    def reread(self, number: int) -> bytes | None:
        if not self.rereadable or not 0 <= number < len(self._starts):
            return None
        with open(self.path, "rb") as stream:
            stream.seek(self._starts[number])
            return b"".join(itertools.islice(stream, self.lines))
