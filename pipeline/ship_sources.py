"""Where ``servewatch ship`` reads request logs: a followed JSONL file, a stream (stdin), HTTP.

Every source yields ``Chunk``s: the lines (or posted items) it read, each a ``Unit`` with its
position, and a callback. The shipper calls ``chunk.on_published`` once everything in the
chunk, and in every chunk before it, is in Kafka; only then does the file follower save its
position and the HTTP endpoint answer its client. So a saved position never runs ahead of
what Kafka holds: a shipper killed at any moment re-sends at most what was in flight
(at-least-once) and skips nothing.

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
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final, Literal, Protocol

import orjson

if TYPE_CHECKING:  # aiohttp is imported only when HTTP is served
    from aiohttp import web

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


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


# -- files ----------------------------------------------------------------------------------


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
            await _wait(stop, self.poll_s)
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
                    await _wait(stop, self.poll_s)
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
                await _wait(stop, self.poll_s)

    async def close(self) -> None:
        if self._current is not None:
            self._current.handle.close()
            self._current = None
        if self.state is not None:
            await self.state.flush()


# -- streams --------------------------------------------------------------------------------


async def _next(queue: asyncio.Queue[Any], stop: asyncio.Event) -> Any:
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
            data = await _next(queue, stop)
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


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[::1]:PORT`` or a bare port (on 127.0.0.1: nothing beyond this machine
    unless asked for)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT or PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--listen {text!r}: port out of range")
    return host.strip("[]") or "127.0.0.1", number


class HttpSource:
    """``POST /v1/requests`` with one record or a JSON array of records; ``GET /healthz``.

    The answer waits until the body's records (and dead letters) are in Kafka:
    ``{"accepted": n, "rejected": m, "errors": [{"index", "reason", "error"}, ...]}``,
    200 when any record was accepted, 422 when none was, 400 for a body that is not JSON
    (dead-lettered as well), 503 while shutting down, 413 above ``max_body_bytes`` (not
    read, so not dead-lettered). aiohttp serves it (a Faust dependency, so nothing new).
    """

    label = "http"
    MAX_ERRORS: Final = 100

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_body_bytes: int = 8 * 1024 * 1024) -> None:
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue(maxsize=64)
        self._closing = False
        self._entering = 0  # handlers about to queue a chunk: the drain waits for them
        self._runner: web.AppRunner | None = None

    @property
    def closing(self) -> bool:
        """True once stopping: new posts are refused (503), those in hand still answered."""
        return self._closing

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1/requests"

    async def start(self) -> None:
        """Listen (a port of 0 becomes a free one, in ``port``)."""
        import socket

        from aiohttp import web

        if self._runner is not None:
            return
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/requests", self._post)
        app.router.add_get("/healthz", self._health)
        family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((self.host, self.port), family=family)
        self.port = int(sock.getsockname()[1])
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        self._runner = runner
        logger.info("accepting request logs at %s", self.url)

    async def _health(self, request: web.Request) -> web.Response:
        from aiohttp import web

        return web.json_response({"status": "closing" if self._closing else "ok"})

    async def _post(self, request: web.Request) -> web.Response:
        from aiohttp import web

        if self._closing:
            return web.json_response({"error": "shutting down"}, status=503)
        body = await request.read()
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            units, malformed = [Unit(body, rejection=("invalid_json", str(exc)))], True
        else:
            malformed = False
            if isinstance(value, list):
                units = [Unit(None, value=item, index=index) for index, item in enumerate(value)]
            else:
                units = [Unit(body, value=value)]
        if not units:
            return web.json_response({"accepted": 0, "rejected": 0, "errors": []})
        if self._closing:
            return web.json_response({"error": "shutting down"}, status=503)
        done: asyncio.Future[ChunkResult] = asyncio.get_running_loop().create_future()

        def published(result: ChunkResult) -> None:
            if not done.done():
                done.set_result(result)

        self._entering += 1
        try:
            await self._queue.put(Chunk(units, published))
        finally:
            self._entering -= 1
        result = await done
        errors = [{"index": index, "reason": reason, "error": error}
                  for index, reason, error in result.rejected[: self.MAX_ERRORS]]  # fmt: skip
        status = 400 if malformed else 200 if result.accepted else 422
        return web.json_response(
            {"accepted": result.accepted, "rejected": len(result.rejected), "errors": errors}, status=status
        )

    async def chunks(self, stop: asyncio.Event) -> AsyncGenerator[Chunk, None]:
        await self.start()
        while True:
            chunk = await _next(self._queue, stop)
            if chunk is None:
                break
            yield chunk
        self._closing = True  # new posts get 503; the ones already in are shipped and answered
        while self._entering or not self._queue.empty():
            yield await self._queue.get()

    async def close(self) -> None:
        self._closing = True
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
