"""The Faust app: settings -> app, topics and agents. Thin wiring; the logic is in
``stage_one`` and ``stage_two``.

Agents:
- ``aggregate_request_batches`` (requests topic): decode, validate, dead-letter the bad,
  fold records into the worker's window tables (shared by its partitions), send closed
  windows as column bundles to the partials partition of each segment (always the same
  one), followed by watermarks.
- ``detect_anomalies`` (partials topic): merge partials per segment window, judge each
  window once, store the detectors' state in a changelog-backed table, read the evidence
  of firing events back from the requests topic, send each incident event on to the
  incidents topic, keyed by model.
- ``group_incidents`` (incidents topic): put each incident in its group (one model, one
  likely cause; ``models.detect.grouping``) and publish it and the group's own records.
- ``judge_engine_intervals`` (scrapes topic): judge each engine's ``EngineInterval`` on
  its capacity signals (``engine_stage``), with state in the same table; publish.
Timers advance quiet partitions' event time and release windows that waited long enough.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import faust
import orjson

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.models.explain.changes import ChangeBook, mention_change
from servewatch.models.windows.window import WindowStats
from servewatch.pipeline import tuning
from servewatch.pipeline.durable_table import DurableWrites
from servewatch.pipeline.kafka import BrokerProbe, KafkaAuth, read_topic
from servewatch.pipeline.seek_guard import hold_flow_while_seeking
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.topics import DETECTOR_STATE_TABLE, Topics, declare_topics
from servewatch.pipeline.worker import kafka_transport, metrics, segment_metrics, tansu_transport
from servewatch.pipeline.worker.decode import Source, dead_letter, internal_error, read_incident_event, why_unreadable
from servewatch.pipeline.worker.engine_stage import JudgeEngines
from servewatch.pipeline.worker.evidence import KafkaMessageReader, resolve
from servewatch.pipeline.worker.partition_watchdog import add_partition_watchdog
from servewatch.pipeline.worker.stage_one import StageOne, partition_of
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.feedback import Feedback

logger = logging.getLogger(__name__)

# Consumer-group timing per broker kind. The session timeout bounds how long a crashed
# worker's partitions stay unread: Faust's default of 60 s meant a minute and a half
# blind after a kill -9. Kafka clients used 10 s for years (45 s since 3.0, for flaky
# networks); servewatch's steps never block the event loop, which sends the heartbeats,
# for more than milliseconds, so 10 s with a heartbeat every 2 s is safe on Kafka. Tansu
# also holds a JoinGroup for half the session timeout, so it gets 6 s.
_PROFILES: dict[str, dict[str, Any]] = {
    "kafka": {"broker_session_timeout": 10.0, "broker_heartbeat_interval": 2.0, "broker_rebalance_timeout": 20.0},
    "tansu": {"broker_session_timeout": 6.0, "broker_heartbeat_interval": 1.0, "broker_rebalance_timeout": 6.0},
}


def _scheme(profile: str) -> str:
    """Faust transport per broker kind: Tansu needs shorter fetch long-polls (``tansu_transport``),
    Kafka gets an idempotent producer (``kafka_transport``)."""
    return tansu_transport.register() if profile == "tansu" else kafka_transport.register()


def _faust_credentials(auth: KafkaAuth) -> faust.SASLCredentials | faust.SSLCredentials | None:
    """The same connection settings as every other client (``KafkaAuth``), as Faust takes them."""
    if auth.protocol.startswith("SASL_"):
        return faust.SASLCredentials(username=auth.username, password=auth.password, mechanism=auth.mechanism,
                                     ssl_context=auth.ssl_context())  # fmt: skip
    if auth.protocol == "SSL":
        return faust.SSLCredentials(auth.ssl_context())
    return None


def faust_app(settings: Settings, app_id: str | None = None) -> faust.App:
    """A Faust app on the configured broker with servewatch's settings and no agents yet.

    ``app_id`` names its consumer group and its tables' changelogs (default: the worker's).
    """
    if settings.bootstrap is None:
        raise ValueError("a Faust app needs a broker address; the CLI starts the embedded one when none is set")
    auth = KafkaAuth.from_settings(settings)
    app = faust.App(
        app_id or settings.app_id,
        broker=f"{_scheme(settings.broker_profile)}://{settings.bootstrap}",
        broker_credentials=_faust_credentials(auth),
        store=settings.store,
        # Tansu under-reports a changelog's end offset, which Faust's consistency check after
        # recovering a RocksDB table trusts; memory tables are rebuilt in full either way.
        recovery_consistency_check=not (settings.store.startswith("rocksdb") and settings.broker_profile == "tansu"),
        datadir=settings.data_dir or tempfile.mkdtemp(prefix="servewatch-faust-"),
        topic_partitions=settings.topic_partitions,
        # The tables' changelogs as the topics (``ensure_topics_of`` sets it from the cluster).
        topic_replication_factor=settings.topic_replication or 1,
        web_enabled=False,
        producer_linger=0.0,  # Tansu under-reports end offsets of multi-record batches
        # Messages still feeding open windows are unacknowledged by design; on shutdown they
        # are left for the next worker to replay rather than waited for.
        stream_wait_empty=False,
        producer_max_request_size=max(settings.max_message_bytes, 1_048_576) + 65_536,
        consumer_max_fetch_size=max(settings.max_message_bytes, 1_048_576) + 65_536,
        **_PROFILES[settings.broker_profile],
    )
    # Without it, records fetched while Faust resumes after a rebalance are skipped for good.
    hold_flow_while_seeking(cast(Any, app.consumer))
    return app


def create_app(settings: Settings) -> tuple[faust.App, Topics]:
    app = faust_app(settings)
    add_partition_watchdog(app, settings)  # a partition that stops moving is reported and fetched again
    assert settings.bootstrap is not None
    auth = KafkaAuth.from_settings(settings)
    topics = declare_topics(app, settings.topic_partitions)
    stage_one = StageOne(settings)
    stage_two = StageTwo(settings)
    stage_two.bank.series = []  # the worker publishes judged windows for charts (servewatch.series)
    metrics.watch_open_windows(stage_one, stage_two)  # the progress line counts what they hold
    engines = JudgeEngines(settings)
    engines.peers.series = []  # and the engines' ratios to their peers, for the replica table
    # Detector state survives restarts and rebalances in a changelog-backed table keyed by
    # segment. ``use_partitioner``: the producer places each key, by the same partitioner
    # as ``stage_one.partition_of``, so state and partials of a segment share a partition
    # number, and writes may come from timers (no current event) as well as the agent.
    # Keys and values as bytes (raw serializers): the key hashed by the producer is exactly
    # the segment key's bytes, as in ``partition_of``; values are ``SegmentDetectors.state()``
    # as JSON.
    state_table = app.Table(
        DETECTOR_STATE_TABLE, default=None, key_type=bytes, value_type=bytes, partitions=settings.topic_partitions,
        use_partitioner=True,
    )  # fmt: skip

    def restore(key: str) -> dict[str, Any] | None:
        stored = state_table.get(key.encode())
        return None if stored is None else cast(dict[str, Any], orjson.loads(stored))

    # Engines' detectors share the table: their keys (``instance|model``, as the scraper keys
    # its messages) never look like a segment's (``model=...|route=...``).
    stage_two.bank.restore = engines.bank.restore = engines.peers.restore = restore

    # A state write that failed: every state is written again at the next step, and until one
    # succeeds no partials message is acknowledged (the windows they fed are in no stored state).
    state_failed = [False]

    def state_not_delivered(exc: BaseException, occasion: str = "") -> None:  # a cache: counted, never fatal
        metrics.STATE_WRITE_FAILURES.inc()
        logger.warning("detector state not stored%s (%r): a restart would relearn those segments", occasion, exc)
        state_failed[0] = True

    state_writes = DurableWrites(state_table, on_failure=state_not_delivered)

    def save_states(every_one: bool = False, occasion: str = "") -> None:
        """Store what is due (``every_one``: every segment's and engine's latest). Never raises:
        state is a cache of what the models learned, never worth an event or the worker."""
        every_one, state_failed[0] = every_one or state_failed[0], False
        try:
            quiet = stage_two.quiet()
            for bank in (stage_two.bank, engines.bank):
                for key, state in bank.states_to_save(every_one, unsaved=quiet and bank is stage_two.bank):
                    state_writes.put(key.encode(), orjson.dumps(state), partition_of(key, partials_partitions))
            for key, state in engines.peers.states_to_save(every_one):
                state_writes.put(key.encode(), orjson.dumps(state), partition_of(key, partials_partitions))
                while bank.expired:  # segments idle for segment_idle_s: their state and gauges go too
                    key = bank.expired.pop()
                    state_table.pop(key.encode(), None)
                    segment_metrics.forget_segment(key)
        except Exception as exc:
            state_not_delivered(exc, occasion)

    partials_partitions = settings.topic_partitions

    async def send_partials(partials: list[WindowStats]) -> None:
        """Send, then wait until every bundle is on the broker: the requests messages they
        cover are acknowledged next, and Faust's flush before a commit can miss a record
        still on its way from its buffer to the client (``DurableWrites`` says more)."""
        sent = [
            await topics.partials.send(key=None, value=bundle, partition=partition)
            for partition, bundle in stage_one.bundles(partials, partials_partitions)
        ]
        for delivery in sent:
            await delivery

    evidence_budget = settings.evidence_budget()
    segment_key_of = settings.segmenter().key_of_row  # a scan's filter: never registers a segment
    evidence_reader = KafkaMessageReader(settings.bootstrap, topics.requests.get_topic_name(), auth=auth)

    changes = ChangeBook()

    async def publish(events: list[AnomalyEvent]) -> None:
        engines.explain(events)
        for event in events:  # the change a step follows is its first suspect
            mention_change(event, changes, settings.window_s, settings.change_horizon_windows)
        await resolve(events, evidence_reader.read, evidence_budget, segment_key_of)
        sent = []
        for event in events:
            # By model: every incident of a model reaches the one worker that groups them.
            model = event.segment.get("model", "other").encode()
            sent.append(await topics.incidents.send(key=model, value=event.model_dump_json().encode()))
        for delivery in sent:  # on the broker, not in the producer's buffer: see store_and_publish
            await delivery

    async def publish_series() -> None:
        """Judged windows as chart points (``SeriesPoint``), by segment, and as per-segment gauges;
        the engines' ratios to their peers as replica table rows."""
        points = [*(stage_two.bank.series or []), *(engines.peers.series or [])]
        if not points:
            return
        stage_two.bank.series, engines.peers.series = [], []
        segment_metrics.record_points(points)
        for point in points:
            await topics.series.send(key=point.key.encode(), value=point.model_dump_json().encode())

    grouper = IncidentGrouper()

    bootstrap = settings.bootstrap

    @app.task
    async def follow_feedback() -> None:
        """On-call's verdicts, read whole by every worker (no consumer group): the grouper
        carries them on the group's records, and an ``expected`` widens the group's signals'
        tolerance in its model (``models.detect.tolerance``) wherever they are judged."""
        while True:
            try:
                async for raw in read_topic(bootstrap, topics.feedback.get_topic_name(), auth=auth):
                    try:
                        feedback = Feedback.model_validate_json(raw)
                    except ValueError as exc:
                        logger.warning("skipped an unreadable feedback record: %s", exc)
                        continue
                    grouper.note_feedback(feedback)
                    stage_two.bank.tolerances.apply(feedback, now=stage_two.bank.clock)
                    logger.info("feedback on group %s: %s by %s", feedback.group, feedback.verdict, feedback.by)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("feedback reader failed (%s); reading again in 2 s", exc)
                await asyncio.sleep(2.0)

    @app.task
    async def follow_changes() -> None:
        """Change markers, read whole by every worker (no consumer group), so that an incident
        starting soon after one names it (``models.explain.changes``); reports are skipped."""
        while True:
            try:
                async for raw in read_topic(bootstrap, topics.changes.get_topic_name(), auth=auth):
                    try:
                        value = orjson.loads(raw)
                        if isinstance(value, dict) and value.get("kind") == "change_marker":
                            changes.add(ChangeMarker.model_validate(value))
                    except ValueError as exc:
                        logger.warning("skipped an unreadable change marker: %s", exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("change marker reader failed (%s); reading again in 2 s", exc)
                await asyncio.sleep(2.0)

    async def publish_dead_letter(letter: DeadLetter) -> None:
        logger.warning("dead letter (%s) at %s/%s: %s", letter.reason, letter.source_partition, letter.source_offset,
                       letter.error)  # fmt: skip
        await topics.deadletter.send(key=None, value=letter.model_dump_json().encode())

    @app.agent(topics.incidents)
    async def group_incidents(stream: faust.StreamT) -> None:
        """Each incident event onto the anomaly topic with its group, and the group's own
        record when the group moves (``models.detect.grouping``)."""
        async for record in stream.events():
            raw, message = record.value or b"", record.message
            try:
                event = read_incident_event(raw)
            except ValueError as exc:  # not an incident event this version can read: kept, counted
                source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
                letter = dead_letter("invalid_incident", why_unreadable(exc), raw, source)
                metrics.DEAD_LETTERS.labels(letter.reason).inc()  # stage one counts the requests' own
                await publish_dead_letter(letter)
                continue
            try:
                event, told = grouper.add(event)
            except Exception:
                logger.exception("failed to group an incident event; published as it came")
                told = []
            model = event.segment.get("model", "other").encode()  # by model: see topics.ANOMALIES
            # Each record on the broker before the next incident is read, so the incident's
            # offset is never committed ahead of what it published (a kill -9 loses no page).
            await (await topics.anomalies.send(key=model, value=event.model_dump_json().encode()))
            logger.info("anomaly %s %s %s: %s", event.status.value, event.signal.value, event.severity.value,
                        event.summary)  # fmt: skip
            for group in told:
                await (await topics.anomalies.send(key=model, value=group.model_dump_json().encode()))
                logger.info("incident group %s: %s", group.transition, group.title)

    async def send_partials_and_ack(partials: list[WindowStats]) -> None:
        await send_partials(partials)
        for event in stage_one.safe_to_ack():
            event.ack()

    @app.agent(topics.requests)
    async def aggregate_request_batches(stream: faust.StreamT) -> None:
        # noack: a message is acknowledged (and its offset committed) only once every window
        # it fed has been sent on to stage 2, so a crash replays what was still in memory.
        async for event in cast(faust.Stream, stream).noack().events():
            message = event.message
            source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
            try:
                letters, partials = stage_one.process(event.value, source, token=event)
            except Exception as exc:
                logger.exception("failed to process message %s/%s", source.partition, source.offset)
                letters, partials = [internal_error(event.value, source, exc)], []
                stage_one.acknowledge_in_order(source.partition or 0, event)
            for letter in letters:
                await publish_dead_letter(letter)
            await send_partials_and_ack(partials)

    # One judging step at a time, from judging to its state on the broker: the agents and the
    # timer interleave at every await, and a step's state taken while another step's events are
    # still on their way would be stored before them (see ``store_and_publish``).
    judging = asyncio.Lock()

    async def judge_and_publish(judge: Callable[[], list[AnomalyEvent]]) -> None:
        """Run one stage-2 step; a bug in judging costs that step, never the worker."""
        async with judging:
            try:
                events = judge()
            except Exception:
                logger.exception("stage 2 failed to judge windows")
                return
            await store_and_publish(events)
            acknowledge_judged()

    def acknowledge_judged() -> None:
        """Acknowledge the partials messages whose windows' events and states are on the broker
        (none while a state write has failed: those windows are in no stored state)."""
        if not state_failed[0]:
            for message in stage_two.judged_and_stored():
                message.ack()

    async def store_and_publish(events: list[AnomalyEvent]) -> None:
        # Events, then state, both on the broker before this returns and the partials that
        # fed them are acknowledged (``StageTwo.judged_and_stored``). A kill between the two
        # leaves the state from before the events, and the partials unacknowledged: the next
        # worker judges those windows again and publishes the same events (same fingerprints),
        # at least once. Stored first, a state that says "firing" would hide an event never sent.
        await publish(events)
        save_states()
        await state_writes.delivered()
        await publish_series()
        if stage_two.late_letters:  # records that came after their window was judged
            letters, stage_two.late_letters = stage_two.late_letters, []
            logger.warning("%d late-record letters dead-lettered (servewatch_late_records_total counts the records); "
                           "first: %s", len(letters), letters[0].error)  # fmt: skip
            for letter in letters:
                await topics.deadletter.send(key=None, value=letter.model_dump_json().encode())

    @app.agent(topics.partials)
    async def detect_anomalies(stream: faust.StreamT) -> None:
        # noack: a partials message is acknowledged (its offset committed) once every window it
        # fed was judged and the state covering them stored (``StageTwo.judged_and_stored``): a
        # worker killed while a window waits for other partitions' partials, or before a quiet
        # segment's state was stored, reads them again and judges those windows as it would have.
        async for event in cast(faust.Stream, stream).noack().events():
            via = event.message.partition
            await judge_and_publish(partial(stage_two.receive, event.value, via=via, token=event))

    @app.agent(topics.scrapes)
    async def judge_engine_intervals(stream: faust.StreamT) -> None:
        async for event in stream.events():
            message = event.message
            source = Source(topic=message.topic, partition=message.partition, offset=message.offset)
            async with judging:
                try:
                    events, letters = engines.receive(event.value, source)
                except Exception as exc:
                    logger.exception("failed to judge engine interval %s/%s", source.partition, source.offset)
                    events, letters = [], [internal_error(event.value, source, exc)]
                for letter in letters:
                    logger.warning("dead letter (%s) at scrapes %s/%s: %s", letter.reason, source.partition,
                                   source.offset, letter.error)  # fmt: skip
                    await topics.deadletter.send(key=None, value=letter.model_dump_json().encode())
                await store_and_publish(events)

    probe = BrokerProbe(settings.bootstrap, auth)
    broker_silent = [False]

    @app.timer(0.5)
    async def flush_quiet_partitions() -> None:
        if stage_one.quiet():
            answers = await probe.answers()
            if answers == broker_silent[0]:  # the broker's state changed: say so once
                broker_silent[0] = not answers
                if answers:
                    logger.warning("the broker answers again: quiet partitions are idle again")
                else:
                    logger.warning("the broker does not answer: quiet partitions are held, not taken as idle")
            if not answers:
                stage_one.hold_idle()
                return
        await send_partials_and_ack(stage_one.flush_idle())

    @app.timer(0.25)
    async def release_due_windows() -> None:
        await judge_and_publish(stage_two.release_due)

    if settings.heap_trim_interval_s > 0:

        @app.timer(settings.heap_trim_interval_s)
        async def trim_heap() -> None:
            # Between windows, not per batch: it costs a few ms, the free space it returns
            # is what each window's buffers leave behind (see tuning.trim_heap).
            tuning.trim_heap()

    @app.timer(10.0)
    async def report_progress() -> None:
        a = stage_two.assembler
        logger.info(
            "progress: %s; %d windows judged, %d segments, %d pending windows, lateness %.1f s",
            metrics.accounting_line(), stage_two.bank.windows_judged, len(stage_two.bank.detectors), len(a.pending),
            stage_one.windower.allowed_lateness,
        )  # fmt: skip

    @app.on_before_shutdown.connect
    async def stop_evidence_reader(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        await evidence_reader.stop()
        await probe.close()

    @app.on_before_shutdown.connect
    async def store_every_state(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        # States are stored every few windows (SERVEWATCH_STATE_EVERY_WINDOWS): a worker that
        # stops on purpose stores what it learned since, for whoever takes its segments.
        async with judging:  # not in the middle of a step whose events are on their way
            save_states(every_one=True, occasion=" on shutdown")
            await state_writes.delivered()
            acknowledge_judged()  # committed on the way out, if Faust still can

    @app.on_partitions_revoked.connect
    async def hand_over_revoked(sender: Any, /, *args: Any, signal: Any, **kwargs: Any) -> None:
        revoked = args[0] if args else kwargs.get("revoked", set())
        mine = {tp.partition for tp in revoked if tp.topic == topics.requests.get_topic_name()}
        if mine:
            await send_partials_and_ack(stage_one.drop_partitions(mine))
        judged_here = {tp.partition for tp in revoked if tp.topic == topics.partials.get_topic_name()}
        engines_here = {tp.partition for tp in revoked if tp.topic == topics.scrapes.get_topic_name()}
        if judged_here or engines_here:
            # Their state is in the table (stored every few windows; now every segment's
            # latest): whoever judges them next restores it, and so will this worker if they
            # come back, rather than keep a copy that the other worker has since moved past.
            async with judging:  # not in the middle of a step whose events are on their way
                save_states(every_one=True, occasion=" on revocation")
            for key in [k for k in stage_two.bank.detectors if partition_of(k, partials_partitions) in judged_here]:
                segment_metrics.forget_segment(key)  # whoever judges it now publishes its gauges
            stage_two.bank.forget(lambda key: partition_of(key, partials_partitions) in judged_here)
            stage_two.hand_over(judged_here)
            engines.bank.forget(lambda key: partition_of(key, partials_partitions) in engines_here)
            if engines_here:  # a model's engines may span partitions: each model is met again from the store
                engines.peers.forget()

    return app, topics
