"""Faust's aiokafka consumer with every seek made on the client's own thread.

Faust runs its aiokafka client in a thread of its own (``AIOKafkaConsumerThread``) and
reaches it through ``call_thread``, except for ``Consumer.seek``: it calls the client's
``seek`` straight from the app's thread. That seek drops the partition's prefetched
records from the client's fetcher while the client's thread may be walking them in
``fetched_records``; the walk then raises ``KeyError`` on a partition it listed a moment
before, Faust's Fetcher service crashes, and the worker exits. The same seek also completes
a future of the client's event loop from another thread, which asyncio does not support.
Seen on Apache Kafka, on a worker taking over a killed peer's partitions: the
seek guard seeks partitions nobody had committed on (``seek_guard``), and the partition
watchdog rewinds stalled ones, both with ``Consumer.seek``.

Both transports (``kafka_transport``, ``tansu_transport``) build this consumer, so every
seek, Faust's and servewatch's, runs where the client's other calls run.
"""

from __future__ import annotations

from typing import Any, cast

from faust.transport.drivers import aiokafka as driver
from faust.types import TP


class Consumer(driver.Consumer):
    """``faust.transport.drivers.aiokafka.Consumer`` whose ``seek`` runs on the consumer thread."""

    async def _seek(self, partition: TP, offset: int) -> None:
        thread = cast(Any, self._thread)  # a mode QueueServiceThread: ``call_thread`` runs on its loop
        await thread.call_thread(thread.seek, partition, offset)
