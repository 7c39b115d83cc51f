"""Every seek of a Faust app's consumer runs on the consumer's own thread (``thread_consumer``).

aiokafka's client is not thread-safe: a seek from the app's thread while the client's thread
walks its prefetched records crashed Faust's Fetcher (``KeyError`` in ``fetched_records``).
"""

from __future__ import annotations

import threading
from typing import Any

import faust
import pytest
from faust.types import TP
from mode.threads import QueueServiceThread

from servewatch.pipeline.streams import kafka_transport, tansu_transport, thread_consumer


class RecordingThread(QueueServiceThread):
    """Stands in for ``AIOKafkaConsumerThread``: a real thread and loop, a client-less ``seek``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seeks: list[tuple[TP, int, int]] = []  # (partition, offset, thread id)

    def seek(self, partition: TP, offset: int) -> None:
        self.seeks.append((partition, offset, threading.get_ident()))


@pytest.mark.parametrize("register", [kafka_transport.register, tansu_transport.register])
async def test_a_seek_runs_on_the_consumer_thread_and_sets_the_read_offset(register: Any) -> None:
    app = faust.App("thread-consumer-test", broker=f"{register()}://127.0.0.1:9")
    consumer = app.consumer  # built lazily: no connection until it starts
    assert isinstance(consumer, thread_consumer.Consumer)
    thread = RecordingThread(loop=consumer.loop)
    consumer._thread = thread  # type: ignore[assignment]
    await thread.start()
    try:
        partition = TP("servewatch.incidents", 3)
        await consumer.seek(partition, 0)
        await consumer.seek(partition, 42)
    finally:
        await thread.stop()
    assert [(p, offset) for p, offset, _ in thread.seeks] == [(partition, 0), (partition, 42)]
    assert all(ident != threading.get_ident() for _, _, ident in thread.seeks), "a seek ran on the app's thread"
    assert consumer._read_offset[partition] == 42
