"""The worker: settings -> Faust app, its topics, agents and timers. Thin wiring; the work is
in the stage classes, each testable without a broker:

- ``RequestAggregation`` (requests topic, read by a Faust agent, or with
  ``SERVEWATCH_BATCH_READER`` in batches by a ``BatchReader`` in a consumer group of its
  own, ``<app id>-requests``: the agent's cost per message caps one-record messages at a
  few thousand a second): decode, validate, dead-letter the bad, fold records into the
  worker's window tables (shared by its partitions), send closed windows as column bundles
  to the partials partition of each segment (always the same one), followed by watermarks.
- ``Judging`` (partials and scrapes topics): merge partials per segment window, judge each
  window once, and each engine's interval on its capacity signals; store the detectors'
  state in a changelog-backed table (``DetectorStateStore``); complete the events (engines,
  changes, evidence read back from the requests topic) and send them to the incidents topic,
  keyed by model (``EventPublisher``).
- ``IncidentGrouping`` (incidents topic): put each incident in its group (one model, one
  likely cause; ``models.detect.grouping``) and publish it and the group's own records.
- ``followers``: on-call's feedback and change markers, read whole by every worker.
Timers advance quiet partitions' event time and release windows that waited long enough.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import faust

from servewatch.pipeline import tuning
from servewatch.pipeline.kafka import BrokerProbe, KafkaAuth, read_topic
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.messages.partitioning import partials_partition
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.streams.batch_reader import Ack, BatchReader, Messages, group_admin, group_consumer
from servewatch.pipeline.streams.faust_app import faust_app
from servewatch.pipeline.streams.partition_watchdog import add_partition_watchdog
from servewatch.pipeline.topics import DETECTOR_STATE_TABLE, Topics, declare_topics, requests_group
from servewatch.pipeline.worker import metrics
from servewatch.pipeline.worker.aggregation import RequestAggregation
from servewatch.pipeline.worker.broker_watch import BrokerWatch
from servewatch.pipeline.worker.engine_stage import JudgeEngines
from servewatch.pipeline.worker.evidence import KafkaMessageReader
from servewatch.pipeline.worker.followers import follow, take_change_markers, take_feedback
from servewatch.pipeline.worker.grouping_stage import IncidentGrouping
from servewatch.pipeline.worker.judging import Judging
from servewatch.pipeline.worker.outbox import FaustOutbox
from servewatch.pipeline.worker.publishing import EventPublisher
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.pipeline.worker.state_store import DetectorStateStore

logger = logging.getLogger(__name__)


@dataclass
class Worker:
    """The worker's stages and the clients they share, as ``create_app`` wires them."""

    aggregation: RequestAggregation
    judging: Judging
    grouping: IncidentGrouping
    publisher: EventPublisher
    evidence_reader: KafkaMessageReader
    probe: BrokerProbe
    broker: BrokerWatch  # whether silence is idleness: asked through ``probe``, told by messages
    requests_reader: BatchReader | None  # None: the requests topic is read by a Faust agent


def origin_of(event: Any) -> MessageOrigin:
    message = event.message
    return MessageOrigin(topic=message.topic, partition=message.partition, offset=message.offset)


def build_worker(app: faust.App, settings: Settings, topics: Topics) -> Worker:
    assert settings.kafka.bootstrap is not None
    auth = KafkaAuth.from_settings(settings)
    outbox = FaustOutbox(topics)
    partitions = settings.kafka.topic_partitions
    stage_one, engines = StageOne(settings), JudgeEngines(settings)
    stage_two = StageTwo(settings, via_of=functools.partial(partials_partition, partitions=partitions))
    metrics.watch_open_windows(stage_one, stage_two)  # the progress line counts what they hold
    # Detector state survives restarts and rebalances in a changelog-backed table keyed by
    # segment. ``use_partitioner``: the producer places each key, by the same partitioner as
    # ``partition_of``, so state and partials of a segment share a partition number, and
    # writes may come from timers (no current event) as well as the agent. Keys and values as
    # bytes: the key hashed by the producer is exactly the segment key's bytes.
    table = app.Table(DETECTOR_STATE_TABLE, default=None, key_type=bytes, value_type=bytes,
                      partitions=partitions, use_partitioner=True)  # fmt: skip
    store = DetectorStateStore(table, partitions)
    reader = KafkaMessageReader(settings.kafka.bootstrap, topics.requests.get_topic_name(), auth=auth)
    publisher = EventPublisher(
        outbox, engines, reader.read, settings.evidence_budget(), settings.segmenter().key_of_row,
        settings.windows.window_s, settings.changes.change_horizon_windows,
    )  # fmt: skip
    aggregation = RequestAggregation(stage_one, outbox, publisher, partitions)
    requests, group = topics.requests.get_topic_name(), requests_group(settings.kafka.app_id)

    probe = BrokerProbe(settings.kafka.bootstrap, auth)

    def restart_waits() -> None:
        stage_one.hold_idle()
        stage_two.restart_waits()

    broker = BrokerWatch(probe.answers, restart_waits)

    async def aggregate(partition: int, messages: Messages, ack_of: Callable[[int], Ack]) -> None:
        broker.heard()
        await aggregation.on_batch(requests, partition, messages, ack_of)

    return Worker(
        aggregation=aggregation,
        judging=Judging(stage_two, engines, store, publisher),
        grouping=IncidentGrouping(outbox, publisher),
        publisher=publisher,
        evidence_reader=reader,
        probe=probe,
        broker=broker,
        requests_reader=BatchReader(
            lambda: group_consumer(settings, group), group, requests, aggregate,
            aggregation.hand_over, aggregation.take_over, inherit_from=settings.kafka.app_id,
            admin=lambda: group_admin(settings),
        ) if settings.kafka.batch_reader else None,
    )  # fmt: skip


def add_agents(app: faust.App, topics: Topics, worker: Worker) -> None:
    # noack on requests and partials: a message is acknowledged (its offset committed) only
    # once what it fed was sent on and, for partials, judged and stored (see the stages).
    if worker.requests_reader is not None:

        @app.task
        async def aggregate_request_batches() -> None:
            assert worker.requests_reader is not None
            try:
                await worker.requests_reader.run()
            except Exception:
                # A step failed past its own error handling (its partials not on the broker,
                # the broker gone for longer than the producer retries): its messages are not
                # acknowledged, and a new process replays them from the commits, where this one
                # would count them as read already. SIGTERM: a clean stop that commits what was sent.
                logger.exception("reading the requests topic failed; stopping the worker so that a restart replays it")
                os.kill(os.getpid(), signal.SIGTERM)

    else:

        @app.agent(topics.requests)
        async def aggregate_request_batches(stream: faust.StreamT) -> None:
            async for event in cast(faust.Stream, stream).noack().events():
                worker.broker.heard()
                await worker.aggregation.on_message(event.value, origin_of(event), event)

    @app.agent(topics.partials)
    async def detect_anomalies(stream: faust.StreamT) -> None:
        async for event in cast(faust.Stream, stream).noack().events():
            worker.broker.heard()
            await worker.judging.on_partials(event.value, event.message.partition, event)

    @app.agent(topics.scrapes)
    async def judge_engine_intervals(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await worker.judging.on_scrapes(event.value, origin_of(event))

    @app.agent(topics.incidents)
    async def group_incidents(stream: faust.StreamT) -> None:
        async for event in stream.events():
            await worker.grouping.on_incident(event.value or b"", origin_of(event))


def add_followers(app: faust.App, settings: Settings, topics: Topics, worker: Worker) -> None:
    assert settings.kafka.bootstrap is not None
    bootstrap, auth = settings.kafka.bootstrap, KafkaAuth.from_settings(settings)
    bank = worker.judging.stage_two.bank
    on_feedback = take_feedback(worker.grouping.grouper, bank.tolerances, lambda: bank.clock)
    on_marker = take_change_markers(worker.publisher.changes)

    @app.task
    async def follow_feedback() -> None:
        await follow(lambda: read_topic(bootstrap, topics.feedback.get_topic_name(), auth=auth), on_feedback,
                     "feedback record")  # fmt: skip

    @app.task
    async def follow_changes() -> None:
        await follow(lambda: read_topic(bootstrap, topics.changes.get_topic_name(), auth=auth), on_marker,
                     "change marker")  # fmt: skip


def add_timers(app: faust.App, settings: Settings, worker: Worker) -> None:
    @app.timer(0.5)
    async def flush_quiet_partitions() -> None:
        reader = worker.requests_reader
        await worker.aggregation.flush_idle(worker.broker.answers, None if reader is None else reader.unread)

    @app.timer(0.25)
    async def release_due_windows() -> None:
        await worker.judging.release_due()

    if settings.process.heap_trim_interval_s > 0:

        @app.timer(settings.process.heap_trim_interval_s)
        async def trim_heap() -> None:
            # Between windows, not per batch: it costs a few ms, the free space it returns
            # is what each window's buffers leave behind (see tuning.trim_heap).
            tuning.trim_heap()

    @app.timer(10.0)
    async def report_progress() -> None:
        stage_one, stage_two = worker.aggregation.stage_one, worker.judging.stage_two
        logger.info(
            "progress: %s; %d windows judged, %d segments, %d pending windows, lateness %.1f s",
            metrics.accounting_line(), stage_two.bank.windows_judged, len(stage_two.bank.detectors),
            len(stage_two.assembler.pending), stage_one.windower.allowed_lateness,
        )  # fmt: skip


def add_lifecycle(app: faust.App, topics: Topics, worker: Worker) -> None:
    @app.on_before_shutdown.connect
    async def stop_clients(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        if worker.requests_reader is not None:
            await worker.requests_reader.stop()  # commits what was sent on; the rest is replayed
        await worker.evidence_reader.stop()
        await worker.probe.close()

    @app.on_before_shutdown.connect
    async def store_every_state(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # States are stored every few windows (SERVEWATCH_STATE_EVERY_WINDOWS): a worker that
        # stops on purpose stores what it learned since, for whoever takes its segments, and
        # commits what that covers on the way out, if Faust still can.
        await worker.judging.store_every_state(" on shutdown")

    @app.on_partitions_revoked.connect
    async def hand_over_revoked(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        revoked = args[0] if args else kwargs.get("revoked", set())

        def of(topic: faust.TopicT) -> set[int]:
            return {tp.partition for tp in revoked if tp.topic == topic.get_topic_name()}

        if worker.requests_reader is None:  # else its own group's rebalance hands them over
            await worker.aggregation.hand_over(of(topics.requests))
        await worker.judging.hand_over(of(topics.partials), of(topics.scrapes))


def create_app(settings: Settings) -> tuple[faust.App, Topics]:
    app = faust_app(settings)
    topics = declare_topics(app, settings.kafka.topic_partitions)
    worker = build_worker(app, settings, topics)
    # A partition that stops moving is reported and fetched again, the requests reader's too.
    reader = worker.requests_reader
    add_partition_watchdog(app, settings, None if reader is None else lambda: reader.consumer)
    add_agents(app, topics, worker)
    add_followers(app, settings, topics, worker)
    add_timers(app, settings, worker)
    add_lifecycle(app, topics, worker)
    return app, topics
