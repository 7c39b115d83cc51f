"""The worker's stages without a broker: each is given an outbox that records what it sent
and a table in memory, and is driven as the Faust agents and timers drive it."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.models.detect.tolerance import Tolerances
from servewatch.models.explain.changes import ChangeBook
from servewatch.models.explain.evidence_sample import MessageKey
from servewatch.models.windows.wire import windows_from_wire
from servewatch.pipeline import topics
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker import followers
from servewatch.pipeline.worker.aggregation import RequestAggregation
from servewatch.pipeline.worker.engine_stage import JudgeEngines
from servewatch.pipeline.worker.followers import follow, take_change_markers, take_feedback
from servewatch.pipeline.worker.grouping_stage import IncidentGrouping
from servewatch.pipeline.worker.judging import Judging
from servewatch.pipeline.worker.publishing import EventPublisher
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.pipeline.worker.state_store import DetectorStateStore
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.incident_group import IncidentGroup, parse_anomaly_record


class Outbox:
    """Records each send; a delivery is done at once unless ``held`` (then on ``release``)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes | None, int | None]] = []
        self.held = False
        self.waiting: list[asyncio.Future[None]] = []

    async def send(self, topic: str, value: bytes, key: bytes | None = None, partition: int | None = None) -> Any:
        self.sent.append((topic, value, key, partition))
        delivery: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.held:
            self.waiting.append(delivery)
        else:
            delivery.set_result(None)
        return delivery

    def values(self, topic: str) -> list[bytes]:
        return [value for name, value, _, _ in self.sent if name == topic]


class Table(dict[bytes, bytes]):
    """A state table in memory, as ``DurableWrites`` writes one: every changelog record delivered
    at once, or refused while ``refusing``."""

    def __init__(self) -> None:
        super().__init__()
        self.refusing = False

    @property
    def data(self) -> Table:
        return self

    def partition_for_key(self, key: bytes) -> None:
        return None

    def send_changelog(self, partition: int | None, key: bytes, value: bytes) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.refusing:
            future.set_exception(RuntimeError("the broker refused"))
        else:
            future.set_result(None)
        return future


class Acked:
    """A message token as Faust's event is: acknowledged at most once."""

    def __init__(self, name: str) -> None:
        self.name, self.acks = name, 0

    def ack(self) -> None:
        self.acks += 1


async def no_messages(keys: set[MessageKey]) -> dict[MessageKey, bytes]:
    return {}


def stages(settings: Settings) -> tuple[Outbox, Table, RequestAggregation, Judging]:
    outbox, table = Outbox(), Table()
    engines = JudgeEngines(settings)
    publisher = EventPublisher(
        outbox, engines, no_messages, settings.evidence_budget(), settings.segmenter().key_of_row,
        settings.windows.window_s, settings.changes.change_horizon_windows,
    )  # fmt: skip
    store = DetectorStateStore(table, settings.kafka.topic_partitions)
    aggregation = RequestAggregation(StageOne(settings), outbox, publisher, settings.kafka.topic_partitions)
    return outbox, table, aggregation, Judging(StageTwo(settings), engines, store, publisher)


def cache_off_messages(seconds: float = 300) -> list[bytes]:
    workload = Workload((Phase("normal", seconds), Phase("cache_off", 120, prefix_caching=False)), seed=8)
    return [orjson.dumps(batch) for _, batch in workload.seconds() if batch]


async def test_requests_are_acknowledged_only_once_their_windows_are_on_the_broker() -> None:
    outbox, _, aggregation, _ = stages(Settings(topic_partitions=2))
    tokens = [Acked(f"m{n}") for n in range(40)]
    outbox.held = True
    for offset, (raw, token) in enumerate(zip(cache_off_messages(), tokens, strict=False)):
        waiting = asyncio.create_task(aggregation.on_message(raw, MessageOrigin("t", 0, offset), token))
        await asyncio.sleep(0)
        while not waiting.done():  # each step waits for its partials' deliveries
            assert all(token.acks == 0 for token in tokens[offset:])
            for delivery in outbox.waiting:
                if not delivery.done():
                    delivery.set_result(None)
            await asyncio.sleep(0)
    bundles = [orjson.loads(value) for value in outbox.values(topics.PARTIALS)]
    assert bundles and {partition for name, _, _, partition in outbox.sent if name == topics.PARTIALS} <= {0, 1}
    closed = [window for bundle in bundles for window in windows_from_wire(bundle["windows"])]
    acked = [token for token in tokens if token.acks]
    assert closed and acked and all(token.acks == 1 for token in acked)
    assert acked == tokens[: len(acked)]  # in order: a commit never passes an open window's message


async def test_a_bad_message_is_dead_lettered_and_a_bug_costs_only_its_message(monkeypatch: pytest.MonkeyPatch) -> None:
    outbox, _, aggregation, _ = stages(Settings(topic_partitions=1))
    await aggregation.on_message(b"{not json", MessageOrigin("t", 0, 0), Acked("bad"))

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(aggregation.stage_one, "process", broken)
    await aggregation.on_message(b"[]", MessageOrigin("t", 0, 1), Acked("unlucky"))
    letters = [DeadLetter.model_validate_json(value) for value in outbox.values(topics.DEADLETTER)]
    assert [(letter.reason, letter.source_offset) for letter in letters] == [("invalid_json", 0), ("internal_error", 1)]
    assert "a bug" in letters[1].error


async def test_partials_in_events_out_with_state_stored_before_they_are_acknowledged() -> None:
    settings = Settings(topic_partitions=1)
    outbox, table, aggregation, judging = stages(settings)
    for offset, raw in enumerate(cache_off_messages()):
        await aggregation.on_message(raw, MessageOrigin("t", 0, offset), Acked(f"m{offset}"))
    await aggregation.flush_idle(lambda: asyncio.sleep(0, result=True))
    tokens = []
    for raw in outbox.values(topics.PARTIALS):
        tokens.append(Acked("partials"))
        await judging.on_partials(raw, 0, tokens[-1])
    await judging.step(lambda: judging.stage_two.release_all(final=True))
    await judging.store_every_state("")  # the input is over: the last windows' states too
    incidents = [AnomalyEvent.model_validate_json(value) for value in outbox.values(topics.INCIDENTS)]
    assert any(event.pages and event.signal.value == "ttft" for event in incidents)
    assert table and all(orjson.loads(state) for state in table.values())  # every state stored is readable
    assert outbox.values(topics.SERIES)  # chart points go out too
    assert all(token.acks == 1 for token in tokens)


async def test_while_state_is_not_stored_nothing_judged_is_acknowledged() -> None:
    outbox, table, aggregation, judging = stages(Settings(topic_partitions=1))
    for offset, raw in enumerate(cache_off_messages(120)):
        await aggregation.on_message(raw, MessageOrigin("t", 0, offset), Acked(f"m{offset}"))
    table.refusing = True
    tokens = [Acked("partials") for _ in outbox.values(topics.PARTIALS)]
    acked_before_judging = 0
    for raw, token in zip(outbox.values(topics.PARTIALS), tokens, strict=True):
        await judging.on_partials(raw, 0, token)
        if not judging.stage_two.bank.windows_judged:  # messages of nothing judged yet (watermarks)
            acked_before_judging = sum(token.acks for token in tokens)
    assert judging.store.failed and judging.stage_two.bank.windows_judged
    assert sum(token.acks for token in tokens) == acked_before_judging < len(tokens)
    table.refusing = False
    await judging.store_every_state(" on shutdown")  # every state written again, then acknowledged
    assert not judging.store.failed and table
    assert sum(token.acks for token in tokens) > acked_before_judging


async def test_segments_dropped_as_idle_take_their_stored_state_with_them() -> None:
    outbox, table, aggregation, judging = stages(Settings(topic_partitions=1))
    for offset, raw in enumerate(cache_off_messages(120)):
        await aggregation.on_message(raw, MessageOrigin("t", 0, offset), Acked(f"m{offset}"))
    for raw in outbox.values(topics.PARTIALS):
        await judging.on_partials(raw, 0, Acked("partials"))
    await judging.step(lambda: judging.stage_two.release_all(final=True))
    await judging.store_every_state("")
    stored = set(table)
    bank = judging.stage_two.bank
    gone = next(iter(bank.detectors))
    bank.expired.append(gone)  # as the bank does for a segment silent for segment_idle_s
    await judging.store_every_state("")
    assert gone.encode() in stored and gone.encode() not in table and not bank.expired


async def test_incidents_are_grouped_and_unreadable_ones_dead_lettered() -> None:
    settings = Settings(topic_partitions=1)
    outbox, _, aggregation, judging = stages(settings)
    for offset, raw in enumerate(cache_off_messages()):
        await aggregation.on_message(raw, MessageOrigin("t", 0, offset), Acked(f"m{offset}"))
    for raw in outbox.values(topics.PARTIALS):
        await judging.on_partials(raw, 0, Acked("partials"))
    grouping = IncidentGrouping(outbox, judging.publisher)
    incidents = outbox.values(topics.INCIDENTS)
    await grouping.on_incident(b"{not json", MessageOrigin(topics.INCIDENTS, 0, 0))
    for offset, raw in enumerate(incidents):
        await grouping.on_incident(raw, MessageOrigin(topics.INCIDENTS, 0, offset + 1))
    records = [parse_anomaly_record(value) for value in outbox.values(topics.ANOMALIES)]
    events = [r for r in records if isinstance(r, AnomalyEvent)]
    groups = [r for r in records if isinstance(r, IncidentGroup)]
    assert len(events) == len(incidents) and all(event.group for event in events)
    assert groups and groups[0].cause == "prefix_cache_ineffective"
    keys = {key for name, _, key, _ in outbox.sent if name == topics.ANOMALIES}
    assert keys == {event.segment["model"].encode() for event in events}  # by model
    letters = [DeadLetter.model_validate_json(value) for value in outbox.values(topics.DEADLETTER)]
    assert [letter.reason for letter in letters] == ["invalid_incident"]


async def test_followers_read_again_after_a_failure_and_skip_what_they_cannot_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(followers, "RETRY_S", 0.0)
    changes, attempts = ChangeBook(), []
    marker = {"kind": "change_marker", "id": "c1", "at": 1000.0, "model": "m", "description": "prefix caching off"}

    async def read() -> Any:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("the broker is away")
        for raw in (b"{not json", b'{"kind": "change_report"}', orjson.dumps(marker)):
            yield raw
        await asyncio.Event().wait()  # then waits for more, as a reader of a live topic does

    task = asyncio.create_task(follow(read, take_change_markers(changes), "change marker"))
    for _ in range(1000):
        await asyncio.sleep(0)
        if changes.latest("m", 2000.0) is not None:
            break
    task.cancel()
    assert len(attempts) == 2 and changes.latest("m", 2000.0) is not None


def test_feedback_reaches_the_grouper_and_the_tolerances() -> None:
    grouper, tolerances = IncidentGrouper(), Tolerances()
    take = take_feedback(grouper, tolerances, lambda: 1000.0)
    take(
        orjson.dumps({"group": "g1", "model": "m", "verdict": "expected", "signals": ["ttft"], "by": "sre", "at": 990})
    )
    assert tolerances.until
    with pytest.raises(ValueError):
        take(b'{"group": "g1"}')
