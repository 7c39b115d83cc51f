"""The shipper: lines and positions, the tail -F follower, batching and delivery, HTTP, and Kafka end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from servewatch.pipeline import topics
from servewatch.pipeline.cli.main import main
from servewatch.pipeline.ingest.ship.adapters import adapter_for
from servewatch.pipeline.ingest.ship.file_follower import FileFollower, StateFile
from servewatch.pipeline.ingest.ship.http_endpoint import HttpSource, parse_listen
from servewatch.pipeline.ingest.ship.shipper import ShipConfig, Shipper
from servewatch.pipeline.ingest.ship.sources import ChunkResult, LineSplitter, StreamSource, Unit
from servewatch.pipeline.kafka import read_topic
from servewatch.pipeline.messages.decode import decode_message
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.request_log import RequestLog
from tests.conftest import Broker, own_broker

#: A broker of its own: these tests read whole topics from the beginning.
broker = own_broker


ROOT = Path(__file__).resolve().parents[1]
POLL = 0.02


def record(n: int, prefix: str = "req") -> dict[str, Any]:
    return {"request_id": f"{prefix}-{n}", "timestamp": 1767225600.0 + n / 100, "model": "m", "prompt_tokens": 100 + n,
            "completion_tokens": 10, "e2e_s": 0.5, "finish_reason": "stop", "route": "chat"}  # fmt: skip


def line(n: int, prefix: str = "req") -> bytes:
    return orjson.dumps(record(n, prefix)) + b"\n"


def append(path: Path, *lines: bytes | str) -> None:
    with path.open("ab") as handle:
        for text in lines:
            handle.write(text if isinstance(text, bytes) else f"{text}\n".encode())


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(POLL)


# -- lines ----------------------------------------------------------------------------------


def test_lines_keep_their_byte_offsets_and_numbers_across_reads() -> None:
    splitter = LineSplitter()
    first = splitter.feed(b'{"a": 1}\n\n  \r\n{"b"')
    second = splitter.feed(b": 2}\r\nlast")
    assert [(u.raw, u.offset, u.index) for u in first] == [(b'{"a": 1}', 0, 1)]
    assert [(u.raw, u.offset, u.index) for u in second] == [(b'{"b": 2}\r', 14, 4)]
    assert splitter.consumed == 24 and splitter.buffered == 4
    [tail] = splitter.flush()
    assert (tail.raw, tail.offset, tail.index, splitter.consumed) == (b"last", 24, 5, 28)


def test_an_oversized_line_is_cut_and_rejected_without_being_buffered() -> None:
    splitter = LineSplitter(max_line_bytes=10)
    units = splitter.feed(b"ok\n" + b"x" * 25)
    units += splitter.feed(b"y" * 30)
    units += splitter.feed(b"z\nfine\n" + b"w" * 12 + b"\nend\n")
    assert [((u.raw or b"")[:3], u.offset, u.index, u.rejection and u.rejection[0]) for u in units] == [
        (b"ok", 0, 1, None), (b"xxx", 3, 2, "too_large"), (b"fin", 60, 3, None), (b"www", 65, 4, "too_large"),
        (b"end", 78, 5, None),
    ]  # fmt: skip
    assert splitter.buffered == 0 and splitter.consumed == 82


# -- the follower ---------------------------------------------------------------------------


class Follow:
    """A follower running in the background; chunks are 'published' at once."""

    def __init__(self, follower: FileFollower) -> None:
        self.follower, self.stop = follower, asyncio.Event()
        self.units: list[Unit] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for chunk in self.follower.chunks(self.stop):
            self.units.extend(chunk.units)
            if chunk.on_published is not None:
                chunk.on_published(ChunkResult())
        await self.follower.close()

    @property
    def lines(self) -> list[str]:
        return [u.raw.decode() for u in self.units if u.raw is not None]

    async def reach(self, n: int) -> None:
        await eventually(lambda: len(self.units) >= n or self.task.done())
        assert len(self.units) == n, self.lines

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 5)


def follower(path: Path, state: Path | None = None, **options: Any) -> FileFollower:
    return FileFollower(str(path), StateFile(state) if state else None, poll_s=POLL, **options)


async def test_following_survives_rotation_and_truncation(tmp_path: Path) -> None:
    log, state = tmp_path / "app.log", tmp_path / "state.json"
    append(log, "a1", "a2")
    run = Follow(follower(log, state))
    await run.reach(2)
    append(log, "a3", b"a")  # a line written halfway
    await run.reach(3)
    append(log, "4")
    await run.reach(4)
    log.rename(tmp_path / "app.log.1")  # logrotate: rename, the writer finishes in the old file, a new one
    append(tmp_path / "app.log.1", "a5")
    append(log, "b1")
    await run.reach(6)
    append(log, "b2", "b3")
    await run.reach(8)
    with log.open("r+b") as handle:  # copytruncate: emptied in place, then written again
        handle.truncate(0)
    append(log, "c1")
    await run.reach(9)
    await run.finish()
    assert run.lines == ["a1", "a2", "a3", "a4", "a5", "b1", "b2", "b3", "c1"]
    assert [u.index for u in run.units] == [1, 2, 3, 4, 5, 1, 2, 3, 1]
    saved = orjson.loads(state.read_bytes())
    assert (saved["inode"], saved["offset"], saved["line"]) == (os.stat(log).st_ino, 3, 1)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []  # written by rename only


async def test_a_restart_resumes_at_the_saved_position(tmp_path: Path) -> None:
    log, state = tmp_path / "app.log", tmp_path / "state.json"
    append(log, "a1", "a2")
    first = Follow(follower(log, state))
    await first.reach(2)
    await first.finish()
    append(log, "a3")
    second = Follow(follower(log, state))
    await second.reach(1)
    await second.finish()
    assert (second.lines, second.units[0].index, second.units[0].offset) == (["a3"], 3, 6)


async def test_a_file_rotated_while_stopped_is_finished_from_its_old_inode(tmp_path: Path) -> None:
    log, state = tmp_path / "app.log", tmp_path / "state.json"
    append(log, "a1")
    first = Follow(follower(log, state))
    await first.reach(1)
    await first.finish()
    append(log, "a2")  # written while the shipper was down, then rotated away
    log.rename(tmp_path / "app.log.1")
    append(log, "b1")
    second = Follow(follower(log, state))
    await second.reach(2)
    await second.finish()
    assert second.lines == ["a2", "b1"] and [u.index for u in second.units] == [2, 1]
    assert orjson.loads(state.read_bytes())["inode"] == os.stat(log).st_ino


async def test_truncated_while_stopped_and_unusable_state_start_from_the_beginning(tmp_path: Path) -> None:
    log, state = tmp_path / "app.log", tmp_path / "state.json"
    append(log, "a1", "a2")
    first = Follow(follower(log, state))
    await first.reach(2)
    await first.finish()
    log.write_bytes(b"b1\n")  # same inode, shorter than the saved offset
    second = Follow(follower(log, state))
    await second.reach(1)
    await second.finish()
    assert second.lines == ["b1"]
    state.write_bytes(b'{"path": 3')
    third = Follow(follower(log, state, follow=False))
    await third.reach(1)
    await asyncio.wait_for(third.task, 5)  # not following: ends at the end of the file
    foreign = tmp_path / "other.json"
    foreign.write_bytes(orjson.dumps({"path": "/elsewhere.log", "inode": 1, "offset": 2, "line": 1}))
    fourth = Follow(follower(log, foreign, follow=False))
    await fourth.reach(1)


async def test_starting_at_the_end_and_a_last_line_without_newline(tmp_path: Path) -> None:
    log = tmp_path / "app.log"
    append(log, "old1", "old2")
    run = Follow(follower(log, start="end"))
    await asyncio.sleep(3 * POLL)
    append(log, "new")
    await run.reach(1)
    await run.finish()
    assert run.lines == ["new"] and run.units[0].index == 3
    log.write_bytes(b"x\nunfinished")
    backfill = Follow(follower(log, follow=False))
    await asyncio.wait_for(backfill.task, 5)
    assert backfill.lines == ["x", "unfinished"]


async def test_a_missing_file_is_waited_for_when_following_and_an_error_otherwise(tmp_path: Path) -> None:
    log = tmp_path / "later.log"
    run = Follow(follower(log))
    await asyncio.sleep(3 * POLL)
    append(log, "hello")
    await run.reach(1)
    await run.finish()
    with pytest.raises(FileNotFoundError):
        async for _ in follower(tmp_path / "never.log", follow=False).chunks(asyncio.Event()):
            pass


def test_the_default_state_path_is_per_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    a, b = StateFile.default_path("/var/log/a/app.log"), StateFile.default_path("/var/log/b/app.log")
    assert a.parent == tmp_path / "servewatch" and a.name.startswith("ship-app.log-") and a != b
    assert StateFile.default_path("x.log", str(tmp_path / "s")).parent == tmp_path / "s"


# -- the shipper with a stand-in producer ---------------------------------------------------


class Producer:
    """aiokafka's send(): a future per message. Can fail sends, hold acks, refuse large messages."""

    def __init__(self, fail: int = 0, max_bytes: int | None = None, hold: bool = False) -> None:
        self.fail, self.max_bytes, self.hold = fail, max_bytes, hold
        self.messages: list[tuple[str, bytes]] = []
        self.held: list[asyncio.Future[Any]] = []

    async def send(self, topic: str, value: bytes | None = None, key: bytes | None = None) -> asyncio.Future[Any]:
        assert value is not None
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if self.fail:
            self.fail -= 1
            raise KafkaConnectionError("broker down")
        if self.max_bytes is not None and len(value) > self.max_bytes:
            future.set_exception(MessageSizeTooLargeError())
            return future
        self.messages.append((topic, value))
        if self.hold:
            self.held.append(future)
        else:
            future.set_result(None)
        return future

    def records(self) -> list[dict[str, Any]]:
        return [r for topic, value in self.messages if topic == topics.REQUESTS for r in orjson.loads(value)]

    def letters(self) -> list[DeadLetter]:
        return [DeadLetter.model_validate_json(v) for t, v in self.messages if t == topics.DEADLETTER]


def fast(**changes: Any) -> ShipConfig:
    """Short lingers and retries: tests wait for nothing."""
    return ShipConfig(**{"linger_s": 0.05, "retry_initial_s": 0.01, "drain_timeout_s": 2.0, **changes})


FAST = fast()


async def ship(source: Any, producer: Producer, config: ShipConfig = FAST, fmt: str = "auto") -> Any:
    shipper = Shipper(source, adapter_for(fmt), producer, config)
    return await asyncio.wait_for(shipper.run(asyncio.Event()), 10)


class PartitionedProducer(Producer):
    """A producer that knows the requests topic's partitions, and notes which each message took."""

    def __init__(self) -> None:
        super().__init__()
        self.partitions: list[int | None] = []

    async def partitions_for(self, topic: str) -> set[int]:
        return {0, 1, 2, 3}

    async def send(  # type: ignore[override]
        self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int | None = None
    ) -> asyncio.Future[Any]:
        self.partitions.append(partition)
        return await super().send(topic, value, key)


async def test_request_batches_take_the_partitions_in_turn_so_every_watermark_moves(tmp_path: Path) -> None:
    """A backfill spread at random can leave a partition behind; the worker's watermark is
    its slowest partition's, so its windows would wait for the wall clock."""
    log = tmp_path / "requests.jsonl"
    append(log, *(line(n) for n in range(1000)), b"not json\n")
    producer = PartitionedProducer()
    await ship(follower(log, follow=False), producer, fast(batch_records=100))
    taken = [
        p for (topic, _), p in zip(producer.messages, producer.partitions, strict=True) if topic == topics.REQUESTS
    ]
    assert taken == [1, 2, 3, 0] * 2 + [1, 2]
    assert [p for (topic, _), p in zip(producer.messages, producer.partitions, strict=True)
            if topic == topics.DEADLETTER] == [None]  # fmt: skip


async def test_a_file_is_shipped_in_batches_and_every_bad_line_dead_lettered_with_its_position(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    append(log, *(line(n) for n in range(600)))
    bad = [b"not json\n", b'{"request_id": "x"}\n', b"[1, 2]\n", b"\n"]
    offsets = [log.stat().st_size]
    for text in bad[:-1]:
        append(log, text)
        offsets.append(log.stat().st_size)
    append(log, bad[-1], *(line(n) for n in range(600, 1100)))
    producer = Producer()
    stats = await ship(follower(log, follow=False), producer)
    assert (stats.read, stats.sent, stats.rejected, stats.pending) == (1103, 1100, 3, 0)
    sizes = [len(orjson.loads(v)) for t, v in producer.messages if t == topics.REQUESTS]
    assert sizes == [500, 500, 100]
    for topic, value in producer.messages:  # what the worker makes of them: all accepted, on its fast path
        if topic == topics.REQUESTS:
            decoded = decode_message(value)
            assert decoded.batch is not None and not decoded.dead_letters
    assert [r["request_id"] for r in producer.records()] == [f"req-{n}" for n in range(1100)]
    letters = producer.letters()
    expected = [("invalid_json", offsets[0], 601), ("validation", offsets[1], 602), ("not_an_object", offsets[2], 603)]
    assert [(d.reason, d.source_offset, d.record_index) for d in letters] == expected
    assert letters[0].raw == "not json" and letters[0].source_topic == f"file:{log}"
    assert {letter.reason for letter in stats.samples} == {"invalid_json", "validation", "not_an_object"}


async def test_messages_stay_under_the_byte_limit_and_larger_records_are_rejected(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    padded = [orjson.dumps({**record(n), "content": "x" * 300}) + b"\n" for n in range(40)]
    append(log, *padded, orjson.dumps({**record(99), "content": "y" * 5000}) + b"\n")
    producer = Producer()
    stats = await ship(follower(log, follow=False), producer, fast(batch_bytes=4096))
    sizes = [len(v) for t, v in producer.messages if t == topics.REQUESTS]
    assert max(sizes) <= 4096 and sum(len(orjson.loads(v)) for t, v in producer.messages if t == topics.REQUESTS) == 40
    [letter] = producer.letters()
    assert letter.reason == "too_large" and letter.record_index == 41 and stats.pending == 0


async def test_a_broker_that_refuses_large_messages_gets_halves_then_a_dead_letter(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    append(log, *(line(n) for n in range(8)), orjson.dumps({**record(8), "content": "z" * 3000}) + b"\n")
    producer = Producer(max_bytes=2500)
    stats = await ship(follower(log, follow=False), producer)
    assert sorted(r["request_id"] for r in producer.records()) == [f"req-{n}" for n in range(8)]
    [letter] = producer.letters()
    assert (letter.reason, letter.record_index, stats.sent, stats.rejected) == ("too_large", 9, 8, 1)


async def test_failed_sends_are_retried_and_nothing_is_lost(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    append(log, *(line(n) for n in range(1200)))
    producer = Producer(fail=3)
    stats = await ship(follower(log, follow=False), producer, fast(batch_records=100))
    assert stats.sent == 1200 and len(producer.records()) == 1200


async def test_the_position_is_saved_only_once_kafka_has_the_batch(tmp_path: Path) -> None:
    log, state = tmp_path / "requests.jsonl", tmp_path / "state.json"
    append(log, line(0), line(1))
    producer = Producer(hold=True)
    stop = asyncio.Event()
    shipper = Shipper(follower(log, state), adapter_for("native"), producer, ShipConfig(linger_s=0.01))
    task = asyncio.create_task(shipper.run(stop))
    await eventually(lambda: len(producer.held) == 1)
    await asyncio.sleep(5 * POLL)
    assert not state.exists() and shipper.stats.sent == 0  # sent, not yet acknowledged
    producer.held[0].set_result(None)
    await eventually(lambda: state.exists())
    assert orjson.loads(state.read_bytes())["offset"] == log.stat().st_size
    stop.set()
    stats = await asyncio.wait_for(task, 5)
    assert (stats.read, stats.sent) == (2, 2)


async def test_a_stop_flushes_what_was_read_at_once(tmp_path: Path) -> None:
    log, state = tmp_path / "requests.jsonl", tmp_path / "state.json"
    append(log, *(line(n) for n in range(7)))
    producer = Producer()
    stop = asyncio.Event()
    shipper = Shipper(follower(log, state), adapter_for("native"), producer, ShipConfig(linger_s=60))
    task = asyncio.create_task(shipper.run(stop))
    await eventually(lambda: shipper.stats.read == 7)
    assert producer.messages == []  # lingering for more
    stop.set()
    stats = await asyncio.wait_for(task, 5)  # long before the linger
    assert (stats.read, stats.sent, stats.pending) == (7, 7, 0)
    assert orjson.loads(state.read_bytes())["offset"] == log.stat().st_size


async def test_when_kafka_stays_down_after_a_stop_the_position_stays_before_the_records(tmp_path: Path) -> None:
    log, state = tmp_path / "requests.jsonl", tmp_path / "state.json"
    append(log, *(line(n) for n in range(5)))
    producer = Producer(fail=10**6)
    stop = asyncio.Event()
    config = fast(linger_s=0.01, retry_max_s=0.05, drain_timeout_s=0.3)
    shipper = Shipper(follower(log, state), adapter_for("native"), producer, config)
    task = asyncio.create_task(shipper.run(stop))
    await eventually(lambda: shipper.stats.read == 5)
    stop.set()
    stats = await asyncio.wait_for(task, 5)
    assert (stats.read, stats.sent, stats.pending) == (5, 0, 5) and not state.exists()


async def test_an_adapter_bug_costs_its_line_only(tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    append(log, line(0), line(1), line(2))

    def flaky(value: Any) -> Any:
        if value["request_id"] == "req-1":
            raise KeyError("bug")
        return adapter_for("native")(value)

    producer = Producer()
    stats = await asyncio.wait_for(Shipper(follower(log, follow=False), flaky, producer, FAST).run(asyncio.Event()), 5)
    assert stats.sent == 2 and [d.reason for d in producer.letters()] == ["internal_error"]


async def test_stdin_is_shipped_to_its_end() -> None:
    read_fd, write_fd = os.pipe()
    with os.fdopen(read_fd, "rb") as reader:
        os.write(write_fd, line(0) + line(1) + b"broken\n" + line(2)[:-1])  # no newline at the end
        os.close(write_fd)
        producer = Producer()
        stats = await ship(StreamSource(reader.read1), producer)
    assert (stats.read, stats.sent, stats.rejected) == (4, 3, 1)
    [letter] = producer.letters()
    assert (letter.source_topic, letter.record_index, letter.source_offset) == ("stdin", 3, len(line(0) + line(1)))


def test_listen_addresses() -> None:
    assert parse_listen("8080") == ("127.0.0.1", 8080)
    assert parse_listen("0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    for bad in ("host:port", "70000"):
        with pytest.raises(ValueError):
            parse_listen(bad)


# -- HTTP -----------------------------------------------------------------------------------


async def test_the_http_endpoint_answers_once_its_records_are_in_kafka() -> None:
    source = HttpSource("127.0.0.1", 0)
    await source.start()
    producer = Producer()
    stop = asyncio.Event()
    shipper = Shipper(source, adapter_for("auto"), producer, ShipConfig(linger_s=0.02))
    task = asyncio.create_task(shipper.run(stop))
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            one = await client.post(source.url, content=orjson.dumps(record(1)))
            many = await client.post(source.url, json=[record(2), {"request_id": "bad"}, record(3)])
            broken = await client.post(source.url, content=b'{"request_id": ')
            none = await client.post(source.url, json=[{"model": "m"}])
            empty = await client.post(source.url, json=[])
            health = await client.get(source.url.replace("/v1/requests", "/healthz"))
    finally:
        stop.set()
        stats = await asyncio.wait_for(task, 5)
    assert (one.status_code, one.json()) == (200, {"accepted": 1, "rejected": 0, "errors": []})
    assert many.status_code == 200 and many.json()["accepted"] == 2
    assert [(e["index"], e["reason"]) for e in many.json()["errors"]] == [(1, "validation")]
    assert broken.status_code == 400 and broken.json()["errors"][0]["reason"] == "invalid_json"
    assert none.status_code == 422 and empty.json()["accepted"] == 0 and health.json() == {"status": "ok"}
    assert [r["request_id"] for r in producer.records()] == ["req-1", "req-2", "req-3"]
    assert [(d.reason, d.source_topic, d.record_index) for d in producer.letters()] == [
        ("validation", "http", 1), ("invalid_json", "http", None), ("validation", "http", 0)]  # fmt: skip
    assert (stats.read, stats.sent, stats.rejected) == (6, 3, 3)
    with pytest.raises(httpx.ConnectError):  # closed with the shipper
        async with httpx.AsyncClient(timeout=2) as client:
            await client.post(source.url, json=record(4))


async def test_posts_arriving_while_stopping_are_refused_and_those_in_hand_answered() -> None:
    source = HttpSource("127.0.0.1", 0)
    await source.start()
    producer = Producer(hold=True)
    stop = asyncio.Event()
    task = asyncio.create_task(Shipper(source, adapter_for("native"), producer, ShipConfig(linger_s=0.01)).run(stop))
    async with httpx.AsyncClient(timeout=5) as client:
        pending = asyncio.create_task(client.post(source.url, json=record(1)))
        await eventually(lambda: len(producer.held) == 1)
        stop.set()
        await eventually(lambda: source.closing)
        late = await client.post(source.url, json=record(2))
        producer.held[0].set_result(None)
        answered = await pending
    await asyncio.wait_for(task, 5)
    assert late.status_code == 503 and answered.json()["accepted"] == 1


# -- Kafka end to end -----------------------------------------------------------------------


async def collect(bootstrap: str, topic: str, keep: Callable[[bytes], list[Any]], count: int) -> list[Any]:
    """Items ``keep`` finds in ``topic``'s messages until there are ``count`` (other tests share the topic)."""
    found: list[Any] = []

    async def scan() -> None:
        async for value in read_topic(bootstrap, topic):
            found.extend(keep(value))
            if len(found) >= count:
                return

    await asyncio.wait_for(scan(), 30)
    return found


@pytest.mark.integration
def test_ship_command_publishes_a_file_and_its_dead_letters_and_resumes(tmp_path: Path, broker: Broker) -> None:
    run = uuid.uuid4().hex[:8]
    log, state = tmp_path / f"{run}.jsonl", tmp_path / "state.json"
    append(log, *(line(n, run) for n in range(1200)), b"{broken\n", *(line(n, run) for n in range(1200, 1300)))
    args = ["ship", "--in", str(log), "--no-follow", "--state", str(state), "--broker", broker.bootstrap]
    assert main(args) == 0

    def mine(value: bytes) -> list[Any]:
        items = orjson.loads(value)
        return [(r["request_id"], len(items)) for r in items if r["request_id"].startswith(run)]

    shipped = asyncio.run(collect(broker.bootstrap, topics.REQUESTS, mine, 1300))
    assert sorted(int(rid.split("-")[1]) for rid, _ in shipped) == list(range(1300))
    assert max(size for _, size in shipped) == 500
    RequestLog.model_validate(record(0, run))

    def letters(value: bytes) -> list[DeadLetter]:
        letter = DeadLetter.model_validate_json(value)
        return [letter] if letter.source_topic == f"file:{log}" else []

    [letter] = asyncio.run(collect(broker.bootstrap, topics.DEADLETTER, letters, 1))
    assert (letter.reason, letter.record_index, letter.raw) == ("invalid_json", 1201, "{broken")
    assert letter.source_offset == sum(len(line(n, run)) for n in range(1200))
    append(log, line(1300, run))
    assert main(args) == 0  # resumes: only the new line
    again = asyncio.run(collect(broker.bootstrap, topics.REQUESTS, mine, 1301))
    assert sorted(int(rid.split("-")[1]) for rid, _ in again) == list(range(1301))


@pytest.mark.integration
def test_sigterm_ships_what_was_read_and_reports_the_counts(tmp_path: Path, broker: Broker) -> None:
    run = uuid.uuid4().hex[:8]
    log, state, err = tmp_path / f"{run}.jsonl", tmp_path / "state.json", tmp_path / "stderr.txt"
    append(log, *(line(n, run) for n in range(50)), b"oops\n")
    env = {**os.environ, "SERVEWATCH_SHIP_POLL_S": "0.05", "SERVEWATCH_PROGRESS": "always"}
    cmd = [sys.executable, "-m", "servewatch", "ship", "--in", str(log), "--state", str(state),
           "--linger", "60s", "--broker", broker.bootstrap]  # fmt: skip
    with err.open("wb") as stderr:
        process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=stderr)
        try:
            deadline = time.monotonic() + 30
            while "read 51," not in err.read_text():  # progress, once a second: all lines read, held by the linger
                assert process.poll() is None and time.monotonic() < deadline, err.read_text()
                time.sleep(0.1)
            assert not state.exists()  # nothing published yet
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=20) == 0
        finally:
            if process.poll() is None:
                process.kill()
    out = err.read_text()
    assert "SIGTERM" in out and "ship: read 51, sent 50, rejected 1, pending 0" in out, out
    assert orjson.loads(state.read_bytes())["offset"] == log.stat().st_size

    def mine(value: bytes) -> list[str]:
        return [r["request_id"] for r in orjson.loads(value) if r["request_id"].startswith(run)]

    assert len(asyncio.run(collect(broker.bootstrap, topics.REQUESTS, mine, 50))) == 50


@pytest.mark.integration
def test_the_shipper_benchmark_runs() -> None:
    done = subprocess.run([sys.executable, "-m", "bench.shipper", "--records", "3000", "--repeat", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "servewatch ship" in done.stdout and "raw producer" in done.stdout and "ratio" in done.stdout


def test_cli_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ship", "--in", str(tmp_path / "none.jsonl"), "--no-follow"]) == 2
    bad_mapping = tmp_path / "mapping.json"
    bad_mapping.write_text('{"model": "a"}')
    assert main(["ship", "--in", "-", "--mapping", str(bad_mapping)]) == 2
    assert main(["ship", "--in", "-", "--default", "colour=red"]) == 2
    assert main(["ship", "--listen", "nowhere:port"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "lacks required fields" in err and "not a label" in err
