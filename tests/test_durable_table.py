"""``DurableWrites``: a write lands in its key's partition whatever event is current, and
``delivered`` waits for every changelog record, in order."""

from __future__ import annotations

import asyncio

import pytest
from faust.streams import current_event

from servewatch.pipeline.streams.durable_table import DurableWrites


class PartitionedStore(dict[bytes, bytes]):
    """As Faust's RocksDB store does: the partition of a write is the current event's."""

    def __init__(self) -> None:
        super().__init__()
        self.partition_of: dict[bytes, int] = {}

    def __setitem__(self, key: bytes, value: bytes) -> None:
        event = current_event()
        assert event is not None  # Faust's own assertion: a timer's write failed on it
        self.partition_of[key] = event.message.partition
        super().__setitem__(key, value)


class Table:
    def __init__(self) -> None:
        self.data = PartitionedStore()
        self.sent: list[tuple[int | None, bytes, bytes]] = []
        self.futures: list[asyncio.Future[None]] = []

    def partition_for_key(self, key: bytes) -> int | None:
        return None  # ``use_partitioner``: the producer places the record

    def send_changelog(self, partition: int | None, key: bytes, value: bytes) -> asyncio.Future[None]:
        self.sent.append((partition, key, value))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return future


async def test_a_write_from_a_timer_lands_in_its_keys_partition_and_is_awaited() -> None:
    table, failures = Table(), []
    writes = DurableWrites(table, on_failure=failures.append)
    writes.put(b"a", b"1", partition=3)  # no current event, as in a timer
    writes.put(b"b", b"2", partition=1)
    assert table.data == {b"a": b"1", b"b": b"2"} and table.data.partition_of == {b"a": 3, b"b": 1}
    assert [key for _, key, _ in table.sent] == [b"a", b"b"]
    assert current_event() is None  # the stand-in is gone again

    waiting = asyncio.create_task(writes.delivered())
    await asyncio.sleep(0)
    assert not waiting.done()  # the records are not on the broker yet
    table.futures[0].set_result(None)
    table.futures[1].set_exception(RuntimeError("broker refused"))
    await waiting
    assert [str(exc) for exc in failures] == ["broker refused"] and writes.unsent == []


async def test_without_a_failure_handler_a_refused_record_raises() -> None:
    table = Table()
    writes = DurableWrites(table)
    writes.put(b"a", b"1", partition=0)
    table.futures[0].set_exception(RuntimeError("refused"))
    with pytest.raises(RuntimeError, match="refused"):
        await writes.delivered()
