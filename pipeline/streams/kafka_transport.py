"""Faust's Kafka transport with an idempotent producer, for Apache Kafka and compatible brokers.

Faust asks aiokafka for an idempotent producer only inside a transaction. Without one, a
produce request that reached the broker but whose answer was lost (a leader change, a
connection reset under load) is sent again and written twice: the worker's partials, its
incident events and its tables' changelog records all go through this producer. With
``enable_idempotence`` the broker drops the retry by its producer id and sequence number,
so a retried batch is written once, in order. Tansu refuses the ``InitProducerId`` request
idempotence needs, so its profile keeps the plain producer (``tansu_transport``). Both
build a consumer whose seeks run on the client's own thread (``thread_consumer``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import faust.transport.drivers
from faust.transport.drivers import aiokafka as driver

from servewatch.pipeline.streams import thread_consumer

SCHEME = "kafka-idempotent"


class _Producer(driver.Producer):
    def _settings_extra(self) -> Mapping[str, Any]:
        # Idempotence needs every in-sync replica's acknowledgement (acks=all).
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


class Transport(driver.Transport):
    Consumer = thread_consumer.Consumer
    Producer = _Producer


def register() -> str:
    """Make ``kafka-idempotent://host:port`` broker URLs use this transport; returns the scheme."""
    faust.transport.drivers.TRANSPORTS.aliases[SCHEME] = f"{__name__}:Transport"
    return SCHEME
