"""The notifier on Faust: thin wiring of ``Notifier`` to topics, a table and timers.

``add_notifier(app, topics, settings, config)`` adds to an app (the worker's, or one of
its own under ``servewatch notify``):

- ``deliver_anomalies`` (anomaly topic, keyed by model): fold each record into its model's
  state (``Notifier.receive``); a record that does not parse is dead-lettered;
- the ``servewatch-notify-state`` table: each model's state, written after every change,
  on the same partition number as the model's anomaly records, so the notifier that owns
  a model's records also holds what its sinks were told (a changelog topic behind it);
- a timer that plans what is due once a second, once the table is recovered and the
  silences are read; one task per sink delivering its queue; the silences feed.
The app comes from ``faust_app``, whose consumer holds its flow while Faust seeks after a
rebalance (``pipeline.seek_guard``), so no anomaly record is skipped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import faust
import httpx
from pydantic import ValidationError

from servewatch.pipeline.kafka import KafkaAuth
from servewatch.pipeline.messages.dead_letters import dead_letter as letter_for
from servewatch.pipeline.messages.dead_letters import summarise_validation_error
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.messages.partitioning import partition_of
from servewatch.pipeline.notify.config import NotifyConfig
from servewatch.pipeline.notify.notifier import Notifier, Storage
from servewatch.pipeline.notify.silence_store import SilenceFeed
from servewatch.pipeline.notify.sinks.build import build_sink
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.streams.durable_table import DurableWrites
from servewatch.pipeline.streams.partition_watchdog import add_partition_watchdog
from servewatch.pipeline.topics import NOTIFY_STATE_TABLE, Topics
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.delivery import Delivery
from servewatch.schemas.incident_group import parse_anomaly_record

logger = logging.getLogger(__name__)

TICK_S = 1.0


def add_notifier(app: faust.App, topics: Topics, settings: Settings, config: NotifyConfig) -> Notifier:
    assert settings.kafka.bootstrap is not None
    partitions = settings.kafka.topic_partitions
    anomalies = topics.anomalies.get_topic_name()
    add_partition_watchdog(app, settings)  # once per app: the worker's carries it already when it delivers
    # Keys and values as bytes: the producer hashes the model's bytes exactly as it does the
    # anomaly records' keys, so ``use_partitioner`` puts a model's state on its records'
    # partition number, and writes may come from the timer and the sinks' tasks too.
    table = app.Table(NOTIFY_STATE_TABLE, default=None, key_type=bytes, value_type=bytes, partitions=partitions,
                      use_partitioner=True)  # fmt: skip

    # A state reported durable must be on the broker (``DurableWrites``); a failure reaches
    # the notifier through ``flush``.
    writes = DurableWrites(table)

    def save(model: str, raw: bytes) -> None:
        writes.put(model.encode(), raw, partition_of(model, partitions))

    def owns(model: str) -> bool:
        mine = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == anomalies}
        return partition_of(model, partitions) in mine

    storage = Storage(load=lambda model: table.get(model.encode()), save=save,
                      keys=lambda: [key.decode() for key in list(table.keys())], flush=writes.delivered)  # fmt: skip
    client = httpx.AsyncClient(headers={"User-Agent": "servewatch-notify"}, follow_redirects=False)

    # Both wait for the broker's acknowledgement (Faust's ``send`` only buffers): the notifier
    # drops a report from its stored state once this returns, and the anomaly agent's offset
    # must not be committed ahead of the dead letter of what it read.
    async def publish_delivery(delivery: Delivery) -> None:
        key, value = delivery.group.encode(), delivery.model_dump_json().encode()
        await (await topics.notifications.send(key=key, value=value))

    async def dead_letter(letter: DeadLetter) -> None:
        logger.warning("dead letter (%s): %s", letter.reason, letter.error)
        await (await topics.deadletter.send(key=None, value=letter.model_dump_json().encode()))

    notifier = Notifier(
        config, [build_sink(sink, config, client) for sink in config.enabled_sinks], storage,
        publish_delivery=publish_delivery, dead_letter=dead_letter, owns=owns,
    )  # fmt: skip
    feed = SilenceFeed(settings.kafka.bootstrap, notifier.silences, KafkaAuth.from_settings(settings))
    tasks: list[asyncio.Task[None]] = []

    @app.agent(topics.anomalies)
    async def deliver_anomalies(stream: faust.StreamT) -> None:
        async for event in stream.events():
            try:
                await notifier.receive(parse_anomaly_record(event.value))
            except ValidationError as exc:
                message = event.message
                source = MessageOrigin(topic=message.topic, partition=message.partition, offset=message.offset)
                await dead_letter(
                    letter_for("invalid_anomaly", summarise_validation_error(exc), event.value or b"", source)
                )

    @app.task
    async def start_sinks() -> None:
        runners = notifier.runners.items()
        tasks.extend(asyncio.create_task(runner.run(), name=f"sink:{name}") for name, runner in runners)
        tasks.append(asyncio.create_task(feed.run_forever(), name="silences"))
        logger.info("notifier: %d sinks (%s)", len(notifier.runners), ", ".join(notifier.runners) or "none")

    @app.timer(TICK_S)
    async def plan_notifications() -> None:
        # Nothing is planned from a half-recovered table (it would resend what was sent) or
        # before the silences are read (it would page what a silence mutes).
        if app.rebalancing or app.in_recovery or not feed.ready.is_set():
            return
        try:
            await notifier.tick()
        except Exception:
            logger.exception("notifier: planning failed; trying again next tick")

    @app.on_partitions_assigned.connect
    async def reread_states(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        notifier.forget()

    @app.on_before_shutdown.connect
    async def stop_sinks(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()

    return notifier
