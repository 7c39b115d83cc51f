"""Where ``servewatch ship`` reads request logs: units, chunks, line splitting, and stdin.

Every source yields ``Chunk``s: the lines (or posted items) it read, each a ``Unit`` with its
position, and a callback. The shipper calls ``chunk.on_published`` once everything in the
chunk, and in every chunk before it, is in Kafka; only then does the file follower save its
position and the HTTP endpoint answer its client. So a saved position never runs ahead of
what Kafka holds: a shipper killed at any moment re-sends at most what was in flight
(at-least-once) and skips nothing.

``FileFollower`` (``file_follower``) and ``HttpSource`` (``http_endpoint``) are the other
sources; this module holds what they share, and stdin (``StreamSource``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

logger = logging.getLogger(__name__)

#: ``Unit.value`` of a line not parsed yet (the shipper parses it).
UNPARSED: Final = object()
READ_BYTES: Final = 1 << 20
RAW_KEEP_BYTES: Final = 64 * 1024  # what a dead letter keeps of an oversized line


@dataclass(slots=True)
class Unit:
    """One line or posted item. ``offset`` and ``index`` go into its dead letter if rejected:
    for files and streams the byte offset of the line's start and its line number (from 1,
    as editors count); for HTTP no offset and the item's index in the posted array."""

    raw: bytes | None  # None: ``value`` came parsed (HTTP items), re-serialised if rejected
    value: Any = UNPARSED
    offset: int | None = None
    index: int | None = None
    rejection: tuple[str, str] | None = None  # (reason, error) decided by the source itself


@dataclass
class ChunkResult:
    """What became of a chunk's units, for whoever waits on it (the HTTP endpoint's answer)."""

    accepted: int = 0
    rejected: list[tuple[int | None, str, str]] = field(default_factory=list)  # (index, reason, error)


@dataclass
class Chunk:
    units: list[Unit]
    on_published: Callable[[ChunkResult], None] | None = None


class Source(Protocol):
    #: Names the input in dead letters (``DeadLetter.source_topic``): ``file:<path>``, ``stdin``, ``http``.
    label: str

    def chunks(self, stop: asyncio.Event) -> AsyncGenerator[Chunk, None]:
        """Chunks until the input ends or ``stop`` is set; what was read by then is yielded."""
        ...

    async def close(self) -> None: ...


class LineSplitter:
    """Bytes in, complete lines out, with their byte offsets and line numbers; bounded memory.

    Blank lines are counted (line numbers match the file) but not yielded. A line longer
    than ``max_line_bytes`` is not buffered: its first ``RAW_KEEP_BYTES`` become a unit
    rejected as ``too_large``, the rest is skipped up to its newline.
    """

    def __init__(self, offset: int = 0, line: int = 0, max_line_bytes: int = 8 * 1024 * 1024) -> None:
        self.consumed = offset  # offset just after the last complete line
        self.line = line  # complete lines so far
        self.max_line_bytes = max_line_bytes
        self._pending = b""
        self._skipped: int | None = None  # bytes of an oversized line so far, while skipping it

    @property
    def buffered(self) -> int:
        """Bytes read past ``consumed`` (an incomplete line)."""
        return len(self._pending) + (self._skipped or 0)

    def _oversized(self, head: bytes, length: int) -> Unit:
        self.line += 1
        unit = Unit(head[:RAW_KEEP_BYTES], offset=self.consumed, index=self.line,
                    rejection=("too_large", f"line of {length:,} bytes exceeds {self.max_line_bytes:,}"))  # fmt: skip
        self.consumed += length + 1
        return unit

    def feed(self, data: bytes) -> list[Unit]:
        units: list[Unit] = []
        if self._skipped is not None:
            newline = data.find(b"\n")
            if newline < 0:
                self._skipped += len(data)
                return units
            units.append(self._oversized(self._pending, self._skipped + newline))
            self._pending, self._skipped, data = b"", None, data[newline + 1 :]
        pieces = (self._pending + data).split(b"\n") if self._pending else data.split(b"\n")
        tail = pieces.pop()
        position, line, limit = self.consumed, self.line, self.max_line_bytes
        for piece in pieces:
            line += 1
            size = len(piece)
            if size > limit:
                self.consumed, self.line = position, line - 1
                units.append(self._oversized(piece, size))
            elif size and not piece.isspace():
                units.append(Unit(piece, offset=position, index=line))
            position += size + 1
        self.consumed, self.line = position, line
        if len(tail) > limit:
            self._pending, self._skipped = tail[:RAW_KEEP_BYTES], len(tail)
        else:
            self._pending = tail
        return units

    def flush(self) -> list[Unit]:
        """The incomplete last line as a line: at the end of a file that will not grow."""
        if self._skipped is not None:
            unit = self._oversized(self._pending, self._skipped)
            self.consumed -= 1  # no newline after it
            self._pending, self._skipped = b"", None
            return [unit]
        tail, self._pending = self._pending, b""
        if not tail:
            return []
        self.line += 1
        offset, self.consumed = self.consumed, self.consumed + len(tail)
        return [] if tail.isspace() else [Unit(tail, offset=offset, index=self.line)]


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or less once ``stop`` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


async def next_or_stop(queue: asyncio.Queue[Any], stop: asyncio.Event) -> Any:
    """The queue's next item, or None once ``stop`` is set first."""
    if not queue.empty():
        return queue.get_nowait()
    getter, stopper = asyncio.ensure_future(queue.get()), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        if not getter.done():
            getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else None


class StreamSource:
    """Lines from a byte stream until it ends (stdin). No state: a stream cannot be re-read.

    A daemon thread does the reading (``read`` is e.g. ``sys.stdin.buffer.read1``), so a
    stop never waits on a read that blocks; what it has read by then is still shipped,
    an incomplete last line included (rejected, most likely, but kept as a dead letter).
    """

    def __init__(
        self,
        read: Callable[[int], bytes],
        label: str = "stdin",
        read_bytes: int = READ_BYTES,
        max_line_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.read, self.label, self.read_bytes, self.max_line_bytes = read, label, read_bytes, max_line_bytes

    def _pump(self, queue: asyncio.Queue[bytes], loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                data = self.read(self.read_bytes)
            except (OSError, ValueError) as exc:
                logger.warning("%s could not be read: %s", self.label, exc)
                data = b""
            try:
                asyncio.run_coroutine_threadsafe(queue.put(data), loop).result()
            except Exception:  # the loop is gone: the shipper has finished
                return
            if not data:
                return

    async def chunks(self, stop: asyncio.Event) -> AsyncGenerator[Chunk, None]:
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=4)
        pump = threading.Thread(target=self._pump, args=(queue, asyncio.get_running_loop()), daemon=True,
                                name=f"servewatch-ship-{self.label}")  # fmt: skip
        pump.start()
        splitter = LineSplitter(0, 0, self.max_line_bytes)
        while True:
            data = await next_or_stop(queue, stop)
            if data is None:  # stopped: what the thread had read is shipped too
                while not queue.empty():
                    units = splitter.feed(queue.get_nowait())
                    if units:
                        yield Chunk(units)
            if not data:
                tail = splitter.flush()
                if tail:
                    yield Chunk(tail)
                return
            units = splitter.feed(data)
            if units:
                yield Chunk(units)

    async def close(self) -> None:
        pass


# -- HTTP -----------------------------------------------------------------------------------
