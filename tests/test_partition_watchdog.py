"""The partition watchdog (pipeline/streams/partition_watchdog.py).

Its logic on offsets and an injected clock; one check's counting, logging and recovery over
a consumer stand-in; and, on the embedded broker, a real aiokafka consumer whose fetch of
one partition is paused behind the watchdog's back, one whose committed offset is pinned
behind a record it lost, and a Faust app of servewatch's own with both. The clock the
watchdog reads is the test's: bounds pass by advancing it, never by waiting; deadlines
bound only a failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path

import faust
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import REGISTRY

from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.streams.faust_app import faust_app
from servewatch.pipeline.streams.partition_watchdog import (
    AIOKafkaWatched,
    FaustWatched,
    Offsets,
    PartitionWatchdog,
    Stall,
    add_partition_watchdog,
    check_partitions,
    commit_lag_bound,
)
from tests.conftest import Broker

HANG_S = 30.0  # a bound for hangs only: the broker answers in milliseconds or never


class Clock:
    """The watchdog's clock: time passes when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def stalled_total(topic: str, reason: str) -> float:
    return REGISTRY.get_sample_value("servewatch_partition_stalled_total", {"topic": topic, "reason": reason}) or 0.0


def new_topic(what: str) -> str:
    return f"watchdog-{what}-{uuid.uuid4().hex[:8]}"


# -- the logic ----------------------------------------------------------------------

T0 = ("t", 0)
T1 = ("t", 1)


def dog(
    clock: Clock, stall_after_s: float = 30.0, commit_lag_after_s: float = 300.0
) -> PartitionWatchdog[tuple[str, int]]:
    return PartitionWatchdog(stall_after_s, commit_lag_after_s, clock=clock)


def test_a_frozen_position_behind_a_moving_end_is_reported_once_after_the_bound() -> None:
    clock = Clock()
    watchdog = dog(clock)
    found = []
    for end in range(10, 20):  # a check every 5 s for 45 s; records keep coming, none is read
        found += watchdog.check({T0: Offsets(end=end, position=4, committed=4)})
        clock.advance(5)
    assert [(s.partition, s.reason, s.position, s.committed, s.again) for s in found] == [
        (T0, "no_progress", 4, 4, False)
    ]
    assert found[0].for_s == 30.0  # reported at the first check past the bound
    assert found[0].end == 16


def test_a_partition_that_catches_up_clears_and_a_later_stall_is_a_new_episode() -> None:
    clock = Clock()
    watchdog = dog(clock)
    watchdog.check({T0: Offsets(end=10, position=4)})
    clock.advance(29)
    watchdog.check({T0: Offsets(end=10, position=4)})
    clock.advance(2)
    watchdog.check({T0: Offsets(end=12, position=12)})  # caught up just in time: never reported
    clock.advance(1)
    assert watchdog.check({T0: Offsets(end=20, position=12)}) == []  # records again: the wait starts now
    clock.advance(29)
    assert watchdog.check({T0: Offsets(end=20, position=12)}) == []
    clock.advance(1)
    [stall] = watchdog.check({T0: Offsets(end=20, position=12)})
    assert (stall.reason, stall.position, stall.for_s, stall.again) == ("no_progress", 12, 30.0, False)


def test_a_position_that_moves_however_slowly_is_no_stall() -> None:
    clock = Clock()
    watchdog = dog(clock)
    for step in range(20):
        assert watchdog.check({T0: Offsets(end=1000, position=step)}) == []
        clock.advance(20)


def test_a_stall_that_outlasts_another_bound_is_reported_again_not_at_every_check() -> None:
    clock = Clock()
    watchdog = dog(clock)
    reports = []
    for _ in range(20):  # 100 s in 5 s checks
        reports += [(s.for_s, s.again) for s in watchdog.check({T0: Offsets(end=10, position=4)})]
        clock.advance(5)
    assert reports == [(30.0, False), (60.0, True), (90.0, True)]


def test_a_committed_offset_standing_behind_the_position_beyond_its_bound_is_commit_behind() -> None:
    clock = Clock()
    watchdog = dog(clock, commit_lag_after_s=300)
    found = []
    for position in range(21, 100):  # reading on (the position moves), one record never acknowledged
        found += watchdog.check({T0: Offsets(end=position + 1, position=position, committed=21)})
        clock.advance(5)
    [stall] = found
    assert (stall.reason, stall.committed, stall.for_s) == ("commit_behind", 21, 300.0)
    assert stall.position == 22 + 300 // 5  # standing since the first check it was behind


def test_a_committed_offset_that_keeps_moving_behind_the_position_is_no_stall() -> None:
    # The worker's normal state: what the open windows hold is unacknowledged, so the
    # committed offset trails the position all the time, and moves as windows close.
    clock = Clock()
    watchdog = dog(clock, commit_lag_after_s=300)
    for step in range(200):
        position = 1000 + 100 * step
        assert watchdog.check({T0: Offsets(end=position, position=position, committed=position - 500)}) == []
        clock.advance(5)


def test_an_idle_partition_is_never_reported() -> None:
    clock = Clock()
    watchdog = dog(clock, stall_after_s=1, commit_lag_after_s=1)
    for _ in range(100):
        assert watchdog.check({T0: Offsets(end=7, position=7, committed=7), T1: Offsets(end=0, position=0)}) == []
        clock.advance(60)


def test_a_partition_held_on_purpose_is_no_fetch_stall_but_its_commits_are_watched() -> None:
    clock = Clock()
    watchdog = dog(clock, stall_after_s=10, commit_lag_after_s=100)
    found = []
    for _ in range(30):
        found += watchdog.check({T0: Offsets(end=50, position=20, committed=5, held=True)})
        clock.advance(5)
    assert [(s.reason, s.for_s) for s in found] == [("commit_behind", 100.0)]


def test_unassigned_partitions_are_forgotten() -> None:
    clock = Clock()
    watchdog = dog(clock)
    watchdog.check({T0: Offsets(end=10, position=4), T1: Offsets(end=10, position=4)})
    clock.advance(20)
    watchdog.check({T1: Offsets(end=10, position=4)})  # T0 revoked
    clock.advance(20)
    # T0 assigned again, standing where it stood: a new start, not 40 s of standing.
    [stall] = watchdog.check({T0: Offsets(end=10, position=4), T1: Offsets(end=10, position=4)})
    assert stall.partition == T1
    clock.advance(30)
    assert [s.partition for s in watchdog.check({T0: Offsets(end=10, position=4)})] == [T0]


def test_the_commit_bound_exceeds_a_window_the_lateness_and_a_record_ahead_of_the_clock() -> None:
    settings = Settings()
    assert (
        commit_lag_bound(settings)
        > settings.windows.window_s + settings.windows.max_lateness_s + settings.windows.max_future_s
    )
    assert commit_lag_bound(Settings(max_lateness_s=600)) > commit_lag_bound(settings)
    with pytest.raises(ValueError):
        PartitionWatchdog(0, 10)


# -- one check: counted, logged, recovered -------------------------------------------------


class Standin:
    """A consumer as ``check_partitions`` sees it: offsets set by the test, recoveries noted."""

    def __init__(self, offsets: Mapping[tuple[str, int], Offsets] | None, fail: bool = False) -> None:
        self.seen = offsets
        self.fail = fail
        self.calls: list[tuple[str, tuple[str, int], int]] = []

    async def offsets(self) -> Mapping[tuple[str, int], Offsets] | None:
        return self.seen

    async def restart_fetch(self, partition: tuple[str, int], position: int) -> None:
        self.calls.append(("restart_fetch", partition, position))
        if self.fail:
            raise ConnectionError("broker gone")

    async def rewind(self, partition: tuple[str, int], committed: int) -> None:
        self.calls.append(("rewind", partition, committed))


async def test_a_check_counts_logs_and_restarts_a_stalled_fetch_where_it_stands(
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = new_topic("unit")
    clock = Clock()
    watchdog = dog(clock, stall_after_s=10)
    consumer = Standin({(topic, 2): Offsets(end=40, position=30, committed=25), (topic, 0): Offsets(end=9, position=9)})
    assert await check_partitions(consumer, watchdog) == []
    clock.advance(10)
    with caplog.at_level(logging.WARNING):
        [stall] = await check_partitions(consumer, watchdog)
    assert stall.partition == (topic, 2)
    assert consumer.calls == [("restart_fetch", (topic, 2), 30)]  # never the committed offset: nothing re-read
    assert stalled_total(topic, "no_progress") == 1
    assert stalled_total(topic, "commit_behind") == 0
    assert f"partition {topic}/2 reads nothing: position 30 has not moved for 10 s" in caplog.text
    assert "fetch restarted at 30" in caplog.text
    clock.advance(5)
    assert await check_partitions(consumer, watchdog) == []  # once per episode
    assert stalled_total(topic, "no_progress") == 1


async def test_a_commit_behind_is_re_read_from_the_committed_offset_unless_that_would_count_twice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    replayable, counted_twice = new_topic("replayable"), new_topic("requests")
    clock = Clock()
    watchdog = dog(clock, commit_lag_after_s=100)
    consumer = Standin({
        (replayable, 0): Offsets(end=50, position=50, committed=21),
        (counted_twice, 0): Offsets(end=50, position=50, committed=21),
    })  # fmt: skip
    await check_partitions(consumer, watchdog, no_rewind=(counted_twice,))
    clock.advance(100)
    with caplog.at_level(logging.WARNING):
        stalls = await check_partitions(consumer, watchdog, no_rewind=(counted_twice,))
    assert sorted((s.topic, s.reason) for s in stalls) == sorted(
        [(replayable, "commit_behind"), (counted_twice, "commit_behind")]
    )
    assert consumer.calls == [("rewind", (replayable, 0), 21)]
    assert stalled_total(replayable, "commit_behind") == stalled_total(counted_twice, "commit_behind") == 1
    assert "re-reading it from 21" in caplog.text
    assert "not re-read: its records would be counted twice" in caplog.text


async def test_a_recovery_that_fails_is_logged_and_the_stall_reported_again_after_another_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = new_topic("failing")
    clock = Clock()
    watchdog = dog(clock, stall_after_s=10)
    consumer = Standin({(topic, 0): Offsets(end=40, position=30)}, fail=True)
    await check_partitions(consumer, watchdog)
    clock.advance(10)
    with caplog.at_level(logging.WARNING):
        await check_partitions(consumer, watchdog)
    assert "recovery failed (ConnectionError('broker gone'))" in caplog.text
    clock.advance(10)
    [again] = await check_partitions(consumer, watchdog)
    assert again.again and again.for_s == 20.0
    assert "still reads nothing" in caplog.text
    assert stalled_total(topic, "no_progress") == 2


async def test_a_check_during_a_rebalance_forgets_what_it_saw() -> None:
    clock = Clock()
    watchdog = dog(clock, stall_after_s=10)
    consumer = Standin({T0: Offsets(end=40, position=30)})
    await check_partitions(consumer, watchdog)
    clock.advance(10)
    consumer.seen = None  # rebalancing: the position stands because the flow does
    assert await check_partitions(consumer, watchdog) == []
    consumer.seen = {T0: Offsets(end=40, position=30)}
    clock.advance(5)
    assert await check_partitions(consumer, watchdog) == []  # 5 s since the rebalance, not 15
    assert consumer.calls == []


def test_an_app_gets_one_watchdog_timer_however_often_it_is_added() -> None:
    # The worker's app may carry the notifier too, and both add the watchdog.
    settings = Settings(broker="127.0.0.1:9")
    app, other = faust_app(settings, app_id="watchdog-once"), faust_app(settings, app_id="watchdog-other")
    before = len(app._app_tasks), len(other._app_tasks)
    add_partition_watchdog(app, settings)
    add_partition_watchdog(app, settings)
    add_partition_watchdog(other, settings)
    assert (len(app._app_tasks), len(other._app_tasks)) == (before[0] + 1, before[1] + 1)


# -- on the embedded broker -------------------------------------------------------------------


class Reader:
    """Reads its consumer's partitions, acknowledging each record and committing each
    partition's contiguous acknowledged prefix, as Faust does. ``lose``: (partition, offset)
    of records whose first delivery is lost unacknowledged (what Faust's resume after a
    rebalance did before ``seek_guard``)."""

    def __init__(self, client: AIOKafkaConsumer, lose: set[tuple[int, int]] | None = None) -> None:
        self.client = client
        self.lose = set(lose or ())
        self.reads: list[tuple[int, int]] = []
        self.acked: dict[TopicPartition, set[int]] = defaultdict(set)
        self.commit_at: dict[TopicPartition, int] = {}

    async def run(self) -> None:
        while True:
            batches = await self.client.getmany(timeout_ms=100)
            for tp, records in batches.items():
                for record in records:
                    if (tp.partition, record.offset) in self.lose:
                        self.lose.discard((tp.partition, record.offset))
                        continue
                    self.reads.append((tp.partition, record.offset))
                    self.acked[tp].add(record.offset)
                start = at = self.commit_at.get(tp, 0)
                while at in self.acked[tp]:
                    at += 1
                if at > start:
                    await self.client.commit({tp: at})
                    self.commit_at[tp] = at

    def read_from(self, partitions: set[int]) -> int:
        return sum(1 for partition, _ in self.reads if partition in partitions)


async def until(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {HANG_S} s: {what}"
        await asyncio.sleep(0.05)


async def until_seen(
    what: str, consumer: FaustWatched, condition: Callable[[Mapping[tuple[str, int], Offsets]], bool]
) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition(await consumer.offsets() or {}):
        assert time.monotonic() < deadline, f"not within {HANG_S} s: {what}"
        await asyncio.sleep(0.1)


async def produce(bootstrap: str, topic: str, partitions: int, each: int) -> None:
    client = producer(bootstrap)
    await client.start()
    try:
        for partition in range(partitions):
            for _ in range(each):
                await client.send_and_wait(topic, b"record", partition=partition)
    finally:
        await client.stop()


async def reading(bootstrap: str, topic: str, partitions: int, lose: set[tuple[int, int]] | None = None) -> Reader:
    """A started consumer in a group of its own, assigned every partition of ``topic``, and its reader."""
    client = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=f"{topic}-group", enable_auto_commit=False,
        auto_offset_reset="earliest", fetch_max_wait_ms=100,
    )  # fmt: skip
    await client.start()
    client.assign([TopicPartition(topic, p) for p in range(partitions)])
    return Reader(client, lose)


async def _reported_once(
    consumer: AIOKafkaWatched, watchdog: PartitionWatchdog, clock: Clock, topic: str, reason: str, step_s: float
) -> None:
    """Nothing more is reported over three more periods: the stall was counted once, for ``reason``."""
    for _ in range(3):
        clock.advance(step_s)
        assert await check_partitions(consumer, watchdog) == []
    assert stalled_total(topic, reason) == 1
    assert stalled_total(topic, "commit_behind" if reason == "no_progress" else "no_progress") == 0


@pytest.mark.integration
async def test_a_partition_whose_fetch_stalls_behind_the_watchdogs_back_is_reported_once_and_read_again(
    broker: Broker,
) -> None:
    topic, partitions, first, more = new_topic("fetch"), 3, 4, 5
    await ensure_topics(broker.bootstrap, partitions, names=(topic,))
    await produce(broker.bootstrap, topic, partitions, first)
    reader = await reading(broker.bootstrap, topic, partitions)
    task = asyncio.create_task(reader.run())
    try:
        await until("the first records read", lambda: len(reader.reads) == partitions * first)
        stalled = TopicPartition(topic, 1)
        reader.client.pause(stalled)  # its fetch stops; nobody tells the watchdog
        await produce(broker.bootstrap, topic, partitions, more)
        await until("the other partitions read", lambda: reader.read_from({0, 2}) == 2 * (first + more))

        clock = Clock()
        watchdog = PartitionWatchdog(stall_after_s=10, commit_lag_after_s=1000, clock=clock)
        consumer = AIOKafkaWatched(reader.client)
        assert await check_partitions(consumer, watchdog) == []
        clock.advance(10)
        stalls = await check_partitions(consumer, watchdog)
        assert stalls == [Stall(stalled, "no_progress", end=first + more, position=first, committed=first, for_s=10.0)]

        # Its recovery read the rest, once each; nothing else was ever reported.
        await until("every record read", lambda: len(reader.reads) == partitions * (first + more))
        assert sorted(reader.reads) == [(p, o) for p in range(partitions) for o in range(first + more)]
        await _reported_once(consumer, watchdog, clock, topic, "no_progress", step_s=10)
    finally:
        task.cancel()
        await reader.client.stop()


@pytest.mark.integration
async def test_a_commit_pinned_behind_a_lost_record_is_re_read_from_it_and_moves_to_the_end(broker: Broker) -> None:
    topic, partitions, each = new_topic("commit"), 2, 6
    await ensure_topics(broker.bootstrap, partitions, names=(topic,))
    await produce(broker.bootstrap, topic, partitions, each)
    reader = await reading(broker.bootstrap, topic, partitions, lose={(0, 2)})
    task = asyncio.create_task(reader.run())
    try:
        await until("all but the lost record read", lambda: len(reader.reads) == partitions * each - 1)
        # A record is counted read before its partition's commit returns.
        await until("partition 1 committed", lambda: reader.commit_at.get(TopicPartition(topic, 1)) == each)
        assert reader.commit_at == {TopicPartition(topic, 0): 2, TopicPartition(topic, 1): each}

        clock = Clock()
        watchdog = PartitionWatchdog(stall_after_s=1000, commit_lag_after_s=100, clock=clock)
        consumer = AIOKafkaWatched(reader.client)
        assert await check_partitions(consumer, watchdog) == []
        clock.advance(100)
        stalls = await check_partitions(consumer, watchdog)
        assert stalls == [
            Stall(TopicPartition(topic, 0), "commit_behind", end=each, position=each, committed=2, for_s=100.0)
        ]

        # Re-read from the lost record: it is read once, the records after it again (as a
        # restart would), and the committed offset reaches the end.
        await until("the commit at the end", lambda: reader.commit_at[TopicPartition(topic, 0)] == each)
        assert await reader.client.committed(TopicPartition(topic, 0)) == each
        reads = sorted(reader.reads)
        assert reads == sorted(
            [(0, o) for o in range(each)] + [(0, o) for o in range(3, each)] + [(1, o) for o in range(each)]
        )
        await _reported_once(consumer, watchdog, clock, topic, "commit_behind", step_s=100)
    finally:
        task.cancel()
        await reader.client.stop()


@pytest.mark.integration
async def test_a_faust_consumer_with_a_stalled_fetch_and_a_pinned_commit_recovers_both(
    broker: Broker, tmp_path: Path
) -> None:
    """The Faust adapter on a Faust app of servewatch's own (``faust_app``): partition 1's
    fetch paused on its aiokafka client, behind Faust's back; partition 0's commit pinned by
    two records its agent never acknowledged (Faust commits past a gap of one)."""
    topic, partitions, first, more = new_topic("faust"), 3, 4, 5
    await ensure_topics(broker.bootstrap, partitions, names=(topic,))
    await produce(broker.bootstrap, topic, partitions, first)
    settings = Settings(broker=broker.bootstrap, topic_partitions=partitions, data_dir=str(tmp_path))
    app = faust_app(settings, app_id=f"{topic}-app")
    lose = {(0, 2), (0, 3)}
    reads: list[tuple[int, int]] = []

    @app.agent(app.topic(topic, key_serializer="raw", value_serializer="raw"))
    async def read(stream: faust.StreamT) -> None:
        async for event in stream.noack().events():
            where = (event.message.partition, event.message.offset)
            if where in lose:
                lose.discard(where)  # lost on its first delivery: never acknowledged
                continue
            reads.append(where)
            event.ack()

    consumer = FaustWatched(app)
    pinned, stalled = (topic, 0), (topic, 1)

    def committed(seen: Mapping[tuple[str, int], Offsets]) -> dict[int, int | None]:
        return {tp[1]: offsets.committed for tp, offsets in seen.items() if tp[0] == topic}

    await app.start()
    try:
        await until("the first records read", lambda: len(reads) == partitions * first - 2)
        client = app.consumer._thread._ensure_consumer()
        client.pause(TopicPartition(*stalled))
        await produce(broker.bootstrap, topic, partitions, more)
        await until("the other partitions read", lambda: len(reads) == partitions * first - 2 + 2 * more)
        end = first + more
        await until_seen("Faust's commits", consumer, lambda seen: committed(seen) == {0: 2, 1: first, 2: end})

        clock = Clock()
        watchdog = PartitionWatchdog(stall_after_s=10, commit_lag_after_s=10, clock=clock)
        assert await check_partitions(consumer, watchdog) == []
        clock.advance(10)
        stalls = await check_partitions(consumer, watchdog)
        assert sorted((s.partition, s.reason, s.end, s.position, s.committed) for s in stalls) == [
            (pinned, "commit_behind", end, end, 2),
            (stalled, "no_progress", end, first, first),
        ]

        # Both recovered: every record read (those after the lost ones twice: a re-read), and
        # every partition committed to its end; nothing else was reported.
        everything = [(p, o) for p in range(partitions) for o in range(end)]
        expected = sorted(everything + [(0, o) for o in range(4, end)])
        # Every read counted, not merely every offset seen once: the re-read goes on after the
        # lost records come, and the agent yields between records.
        await until("every record read, those after the lost ones twice", lambda: len(reads) >= len(expected))
        assert sorted(reads) == expected
        await until_seen(
            "every commit at the end", consumer, lambda seen: committed(seen) == dict.fromkeys(range(3), end)
        )
        for _ in range(3):
            clock.advance(10)
            assert await check_partitions(consumer, watchdog) == []
        assert stalled_total(topic, "no_progress") == stalled_total(topic, "commit_behind") == 1
    finally:
        await app.stop()
