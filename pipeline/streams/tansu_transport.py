"""Faust's Kafka transport, tuned for the embedded Tansu broker: short fetch long-polls.

A fetch that spans several partitions is answered by Tansu only when its wait runs out,
even if records arrive meanwhile (Apache Kafka answers as soon as any partition has data).
Faust hard-codes a 1.5 s wait for its worker consumer, so on Tansu every hop through a
topic cost 0.75 s on average: measured, a window's partials waited that long to reach
stage 2, a third of the detection latency. With 100 ms the hop costs ~10 ms more than on
Kafka, and an idle worker sends ten small fetches a second. Used only with
``broker_profile=tansu``; Kafka keeps Faust's own transport.
"""

from __future__ import annotations

from typing import Any

import faust.transport.drivers
from faust.transport.drivers import aiokafka as driver

from servewatch.pipeline.streams import thread_consumer

SCHEME = "tansu"
FETCH_MAX_WAIT_MS = 100


class _ConsumerThread(driver.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # aiokafka reads this when the consumer starts; Faust offers no setting for it.
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class _Consumer(thread_consumer.Consumer):
    def _new_consumer_thread(self) -> driver.AIOKafkaConsumerThread:
        return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(driver.Transport):
    Consumer = _Consumer


def register() -> str:
    """Make ``tansu://host:port`` broker URLs use this transport; returns the scheme."""
    faust.transport.drivers.TRANSPORTS.aliases[SCHEME] = f"{__name__}:Transport"
    return SCHEME
