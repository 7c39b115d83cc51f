"""A followed JSONL file for ``servewatch ship``: ``tail -F`` with a saved position.

``FileFollower`` reads like ``tail -F``: it survives rotation (the path names a new inode:
the old file is read to its end first) and truncation (the file shrank below the position:
read again from the start), and resumes from its ``StateFile`` (path, inode, byte offset,
line number; replaced atomically). Rotated while the shipper was down, the old file is found
by its inode next to the new one (``app.log.1``), read from the saved offset, then the new
file from its start. Limits, as for ``tail -F``: a file truncated and refilled past the
position between two polls looks unchanged; a rotated file compressed before the shipper
came back cannot be found by its inode.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import orjson

from servewatch.pipeline.ingest.ship.sources import READ_BYTES, Chunk, LineSplitter, Unit, wait_or_stop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FilePosition:
    """How far a followed file is shipped: ``offset`` bytes (``line`` lines) of inode ``inode``."""

    path: str
    inode: int
    offset: int
    line: int


class StateFile:
    """A follower's position on disk: small JSON, replaced atomically (write, fsync, rename).

    ``request`` (called after each published batch) hands the write to a thread, so the
    shipper never waits on the disk; positions that arrive while one is written coalesce
    into the next write, the newest winning. ``flush`` waits for the last one. Unreadable
    or foreign state is reported and ignored, never fatal: the follower then starts as if
    it had none.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._saved: FilePosition | None = None
        self._wanted: FilePosition | None = None
        self._writer: asyncio.Task[None] | None = None

    @staticmethod
    def default_path(followed: str, state_dir: str | None = None) -> Path:
        """``<state dir>/ship-<name>-<hash of the absolute path>.json``; the state dir defaults
        to ``$XDG_STATE_HOME/servewatch`` (``~/.local/state/servewatch``)."""
        if state_dir:
            base = Path(state_dir)
        else:
            base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "servewatch"
        absolute = os.path.abspath(followed)
        digest = hashlib.sha256(absolute.encode("utf-8", "surrogateescape")).hexdigest()[:8]
        return base / f"ship-{Path(absolute).name}-{digest}.json"

    def load(self) -> FilePosition | None:
        try:
            data = orjson.loads(self.path.read_bytes())
            position = FilePosition(str(data["path"]), int(data["inode"]), int(data["offset"]), int(data["line"]))
        except FileNotFoundError:
            return None
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            logger.warning("ignoring unreadable ship state %s: %s", self.path, exc)
            return None
        if position.offset < 0 or position.line < 0:
            logger.warning("ignoring ship state %s with a negative position", self.path)
            return None
        self._saved = position
        return position

    def save(self, position: FilePosition) -> None:
        """Write ``position`` now (blocking)."""
        if position == self._saved:
            return
        data = orjson.dumps({"path": position.path, "inode": position.inode, "offset": position.offset,
                             "line": position.line, "saved_at": time.time()})  # fmt: skip
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)
        self._saved = position

    def request(self, position: FilePosition) -> None:
        """Save ``position`` soon, off the event loop (needs a running loop)."""
        self._wanted = position
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        while self._wanted is not None and self._wanted != self._saved:
            try:
                await asyncio.to_thread(self.save, self._wanted)
            except OSError as exc:  # a full disk costs a re-send after a restart, not the shipper
                logger.error("could not save the ship state %s: %s", self.path, exc)
                return

    async def flush(self) -> None:
        """Wait until the newest requested position is on disk."""
        if self._writer is not None:
            await self._writer
        if self._wanted is not None and self._wanted != self._saved:
            await self._write()


@dataclass
class _Reading:
    """One open file being read, with its inode and line splitter."""

    handle: BinaryIO
    inode: int
    splitter: LineSplitter
    draining: bool = False  # the path names another file now: read this one to its end, then switch
    quiet_polls: int = 0

    @property
    def read_position(self) -> int:
        return self.splitter.consumed + self.splitter.buffered


def _find_inode(directory: Path, inode: int) -> Path | None:
    """A file in ``directory`` with this inode: where a rotated file went (``app.log.1``)."""
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_file(follow_symlinks=False) and entry.inode() == inode:
                        return Path(entry.path)
    except OSError:
        return None
    return None


class FileFollower:
    """A JSONL file read like ``tail -F``, positions saved through ``StateFile`` after publishing.

    ``follow=False`` reads to the end and stops (a backfill). ``start`` applies only
    without a saved position: ``beginning`` ships the whole file, ``end`` only what is
    appended from now on.
    """

    def __init__(
        self,
        path: str,
        state: StateFile | None = None,
        *,
        follow: bool = True,
        start: Literal["beginning", "end"] = "beginning",
        poll_s: float = 0.25,
        read_bytes: int = READ_BYTES,
        max_line_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.path, self.state, self.follow, self.start = path, state, follow, start
        self.poll_s, self.read_bytes, self.max_line_bytes = poll_s, read_bytes, max_line_bytes
        self.label = f"file:{os.path.abspath(path)}"
        self._current: _Reading | None = None

    def _open(self, path: str | Path, offset: int = 0, line: int = 0) -> _Reading:
        handle = open(path, "rb", buffering=0)  # noqa: SIM115 - closed when the follower moves on
        inode = os.fstat(handle.fileno()).st_ino
        if offset:
            handle.seek(offset)
        return _Reading(handle, inode, LineSplitter(offset, line, self.max_line_bytes))

    def _count_lines(self, path: str, size: int) -> int:
        """Lines in the first ``size`` bytes: numbers stay true when starting at the end."""
        count = 0
        with open(path, "rb") as handle:
            while size > 0:
                data = handle.read(min(size, READ_BYTES))
                if not data:
                    break
                count, size = count + data.count(b"\n"), size - len(data)
        return count

    def _resume(self) -> tuple[_Reading, bool]:
        """The file to read first and whether it is an old, rotated one to drain."""
        saved = self.state.load() if self.state is not None else None
        if saved is not None and saved.path != os.path.abspath(self.path):
            logger.warning("ship state %s is for %s, not %s: ignored", self.state and self.state.path,
                           saved.path, self.path)  # fmt: skip
            saved = None
        stat = os.stat(self.path)
        if saved is not None:
            if saved.inode == stat.st_ino:
                if stat.st_size >= saved.offset:
                    logger.info("resuming %s at byte %d (line %d)", self.path, saved.offset, saved.line)
                    return self._open(self.path, saved.offset, saved.line), False
                logger.warning("%s shrank below the saved position (truncated): reading from its start", self.path)
                return self._open(self.path), False
            rotated = _find_inode(Path(self.path).resolve().parent, saved.inode)
            if rotated is not None and rotated.stat().st_size >= saved.offset:
                logger.info("%s was rotated while stopped: finishing %s from byte %d first", self.path, rotated,
                            saved.offset)  # fmt: skip
                return self._open(rotated, saved.offset, saved.line), True
            logger.warning("%s was rotated while stopped and the old file (inode %d) is gone: lines after byte %d "
                           "of it are lost; reading the new file from its start", self.path, saved.inode,
                           saved.offset)  # fmt: skip
            return self._open(self.path), False
        if self.start == "end":
            return self._open(self.path, stat.st_size, self._count_lines(self.path, stat.st_size)), False
        return self._open(self.path), False

    def _chunk(self, reading: _Reading, units: list[Unit]) -> Chunk:
        position = FilePosition(os.path.abspath(self.path), reading.inode, reading.splitter.consumed,
                                reading.splitter.line)  # fmt: skip
        state = self.state
        if state is None:
            return Chunk(units)
        return Chunk(units, on_published=lambda _result: state.request(position))

    def _changed(self, reading: _Reading) -> Literal["rotated", "truncated"] | None:
        try:
            if os.stat(self.path).st_ino != reading.inode:
                return "rotated"  # only once the new file exists: until then the old one may still grow
        except FileNotFoundError:
            return None
        if os.fstat(reading.handle.fileno()).st_size < reading.read_position:
            return "truncated"
        return None

    async def _wait_for_file(self, stop: asyncio.Event) -> bool:
        warned = False
        while not os.path.exists(self.path):
            if not self.follow:
                raise FileNotFoundError(self.path)
            if not warned:
                logger.warning("waiting for %s to appear", self.path)
                warned = True
            await wait_or_stop(stop, self.poll_s)
            if stop.is_set():
                return False
        return True

    async def chunks(self, stop: asyncio.Event) -> AsyncGenerator[Chunk, None]:
        if not await self._wait_for_file(stop):
            return
        reading, reading_rotated = self._resume()
        reading.draining = reading_rotated
        self._current = reading
        while not stop.is_set():
            data = reading.handle.read(self.read_bytes)
            if data:
                reading.quiet_polls = 0
                units = reading.splitter.feed(data)
                if units:
                    yield self._chunk(reading, units)
                continue
            if reading.draining:  # the old file after a rotation: once it stays quiet, switch
                if reading.quiet_polls < 1:
                    reading.quiet_polls += 1
                    await wait_or_stop(stop, self.poll_s)
                    continue
                tail = reading.splitter.flush()
                yield self._chunk(reading, tail)
                reading.handle.close()
                if not await self._wait_for_file(stop):
                    return
                reading = self._current = self._open(self.path)
                logger.info("following the new %s (inode %d)", self.path, reading.inode)
                continue
            if not self.follow:
                tail = reading.splitter.flush()
                if tail:
                    yield self._chunk(reading, tail)
                return
            change = self._changed(reading)
            if change == "rotated":
                logger.info("%s was rotated: reading the old file to its end", self.path)
                reading.draining = True
            elif change == "truncated":
                logger.warning("%s was truncated: reading from its start", self.path)
                tail = reading.splitter.flush()  # a line cut short by the truncation: shipped as read
                if tail:
                    yield self._chunk(reading, tail)
                reading.handle.seek(0)
                reading.splitter = LineSplitter(0, 0, self.max_line_bytes)
            else:
                await wait_or_stop(stop, self.poll_s)

    async def close(self) -> None:
        if self._current is not None:
            self._current.handle.close()
            self._current = None
        if self.state is not None:
            await self.state.flush()


# -- streams --------------------------------------------------------------------------------
