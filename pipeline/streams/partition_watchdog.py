"""Notice a partition the consumer stopped reading or committing, count it, and unstick it.

A restarted consumer has been seen to hold a partition on the embedded broker: its
committed offset pinned far behind its end for minutes and through a SIGTERM; a notifier
that read a partition's first record and nothing after. One cause, records skipped while
Faust seeks after a rebalance, is fixed (``pipeline.seek_guard``); this watches for the
symptoms, whatever their cause, on every partition the consumer is assigned:

- ``no_progress``: records wait (the end offset is past the position) and the position has
  not moved for ``stall_after_s``. The fetch is restarted where it stands (a seek to the
  position, resuming the partition if something paused it behind the app's back): nothing
  is read twice, nothing skipped.
- ``commit_behind``: the committed offset has stayed at one value behind the position for
  ``commit_lag_after_s``. The worker acknowledges a requests message only once every window
  it fed was sent on, so such a gap is normal for a window plus the allowed lateness, and
  for as long again as a record may be ahead of the clock (``commit_lag_bound``). Past the
  bound, the partition is read again from its committed offset: what a restart would
  replay, minus the restart. Each stage takes a replay once (stage 2 by source offsets,
  the engines by interval, the grouper and the notifier by fingerprint, stage 1 only with
  request-id dedup); a topic whose replay would count twice (the requests topic without
  dedup) is reported only.

A stall is reported (logged, counted in ``servewatch_partition_stalled_total``) once when
it passes its bound and again only if it outlasts another bound (its recovery did not
take), never at every check; partitions no longer assigned are forgotten.

``PartitionWatchdog`` is the logic, on offsets and an injected clock; ``check_partitions``
runs one check through a ``WatchedConsumer``: ``AIOKafkaWatched`` for a plain aiokafka
consumer, ``FaustWatched`` for a Faust app's. ``add_partition_watchdog(app, settings)``
checks a Faust app's partitions every ``CHECK_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, cast

from prometheus_client import Counter

if TYPE_CHECKING:
    import faust
    from aiokafka import AIOKafkaConsumer
    from faust.transport.consumer import ThreadDelegateConsumer
    from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
    from faust.types import TP

    from servewatch.pipeline.settings import Settings

logger = logging.getLogger(__name__)

STALLED = Counter(
    "servewatch_partition_stalled",
    "Partitions found stalled: no_progress (records wait, the position does not move) or commit_behind "
    "(the committed offset stays behind the position past its bound); each stall once, again if it outlasts "
    "another bound.",
    ["topic", "reason"],
)

Reason = Literal["no_progress", "commit_behind"]
#: A partition as the consumer names it: aiokafka's ``TopicPartition``, Faust's ``TP``.
P = TypeVar("P", bound=tuple[str, int])

#: Seconds a partition may have records waiting while its position stands still. A fetch
#: returns within its long-poll (0.1 s on Tansu, 0.5 s on Kafka) and the app takes a batch
#: in well under a second; a partition held on purpose (paused, or its stream's buffer
#: full) is not watched for it, nor is any during a rebalance. A wrong call costs a seek to
#: where the partition stands, which re-reads nothing, so the bound stays short.
STALL_AFTER_S = 30.0
#: Seconds beyond the worker's own bound on unacknowledged offsets (``commit_lag_bound``):
#: its idle flush (2 s), fold (0.5 s) and Faust's commit interval (2.8 s), a rebalance on
#: the way (20 s at most on Kafka), with room to spare. A wrong call re-reads records.
COMMIT_LAG_MARGIN_S = 60.0
#: Seconds between checks: each asks the broker for the end offsets once.
CHECK_EVERY_S = 5.0
#: Seconds a check may take to read the offsets; a slower one is skipped.
READ_TIMEOUT_S = 10.0
#: Seconds given to the record in Faust's hands when a partition is taken out of its
#: active set, before its read offset is lowered for a re-read (see ``FaustWatched.rewind``).
REWIND_SETTLE_S = 0.1


def commit_lag_bound(settings: Settings) -> float:
    """How long a committed offset may legitimately stay behind the position, and a margin.

    A requests message is acknowledged once every window it fed was sent on: when the
    slowest partition's event time has passed its window's end plus the allowed lateness
    (``window_s`` + ``max_lateness_s`` at most). A record up to ``max_future_s`` ahead of
    the clock is taken, and holds its window, and so its partition's offsets, that much
    longer (``models.windows.windowing.Windower``). A partials message is acknowledged once
    its windows were judged (``assembler_max_wait_s`` at most after their end) and are in
    stored state (``2 * state_every_windows`` windows at most; ``StageTwo.judged_and_stored``).

    >>> from servewatch.pipeline.settings import Settings
    >>> commit_lag_bound(Settings(window_s=10, max_lateness_s=120, max_future_s=300))
    490.0
    """
    requests = settings.windows.window_s + settings.windows.max_lateness_s + settings.windows.max_future_s
    partials = (
        settings.windows.window_s * (1 + 2 * settings.windows.state_every_windows)
        + settings.windows.assembler_max_wait_s
    )
    return max(requests, partials) + COMMIT_LAG_MARGIN_S


@dataclass(frozen=True)
class Offsets:
    """What a check sees of one partition. Offsets are Kafka's "next" offsets: ``end`` the
    next one written (the high watermark), ``position`` the next one the consumer fetches,
    ``committed`` the next one its group would resume from (None: unknown, not checked)."""

    end: int
    position: int
    committed: int | None = None
    #: The consumer holds the partition on purpose (its stream's buffer is full): no fetch
    #: is expected, so a standing position is no stall; its commits are still watched.
    held: bool = False


@dataclass(frozen=True)
class Stall(Generic[P]):
    """A partition found stalled, with the offsets it was found at."""

    partition: P
    reason: Reason
    end: int
    position: int
    committed: int | None
    #: Seconds the position (no_progress) or the committed offset (commit_behind) has stood.
    for_s: float
    #: Whether it was reported before in this episode (its recovery did not take).
    again: bool = False

    @property
    def topic(self) -> str:
        return self.partition[0]

    def describe(self) -> str:
        where = f"{self.partition[0]}/{self.partition[1]}"
        still = "still " if self.again else ""
        if self.reason == "no_progress":
            return (f"partition {where} {still}reads nothing: position {self.position} has not moved for "
                    f"{self.for_s:.0f} s, end offset {self.end}")  # fmt: skip
        return (f"partition {where} {still}commits nothing: committed offset {self.committed} has stood behind "
                f"position {self.position} for {self.for_s:.0f} s")  # fmt: skip


@dataclass
class _Standing:
    """Since when one offset of a partition has stood at one value while that counts as a
    stall, and when that was last reported."""

    value: int | None = None
    since: float | None = None  # None: not standing (moving, or nothing to wait for)
    reported_at: float | None = None

    def observe(self, value: int | None, now: float, stuck: bool) -> None:
        """Note the offset; ``stuck``: its standing would count (else the episode is over)."""
        if not stuck:
            self.value, self.since, self.reported_at = value, None, None
        elif value != self.value or self.since is None:  # a new episode starts at this check
            self.value, self.since, self.reported_at = value, now, None

    def due(self, now: float, bound: float) -> bool:
        """Standing past its bound, and not reported within the last one."""
        if self.since is None or now - self.since < bound:
            return False
        return self.reported_at is None or now - self.reported_at >= bound


@dataclass
class _Partition:
    position: _Standing = field(default_factory=_Standing)
    committed: _Standing = field(default_factory=_Standing)


class PartitionWatchdog(Generic[P]):
    """Finds stalled partitions from what each check sees of them (no I/O, no Kafka).

    >>> clock = iter([0.0, 31.0]).__next__
    >>> dog = PartitionWatchdog(stall_after_s=30, commit_lag_after_s=600, clock=clock)
    >>> dog.check({("t", 0): Offsets(end=10, position=4)})
    []
    >>> [(s.reason, s.position, s.end) for s in dog.check({("t", 0): Offsets(end=12, position=4)})]
    [('no_progress', 4, 12)]
    """

    def __init__(
        self, stall_after_s: float, commit_lag_after_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if stall_after_s <= 0 or commit_lag_after_s <= 0:
            raise ValueError("the bounds must be positive")
        self.stall_after_s = stall_after_s
        self.commit_lag_after_s = commit_lag_after_s
        self.clock = clock
        self._seen: dict[P, _Partition] = {}

    def check(self, offsets: Mapping[P, Offsets]) -> list[Stall[P]]:
        """The stalls due now among ``offsets`` (every partition assigned and watched now;
        the others are forgotten, so one assigned again starts afresh)."""
        now = self.clock()
        for gone in self._seen.keys() - offsets.keys():
            del self._seen[gone]
        stalls: list[Stall[P]] = []
        for partition, seen in offsets.items():
            state = self._seen.setdefault(partition, _Partition())
            # A position stands still legitimately when nothing waits or the consumer holds it.
            waiting = seen.end > seen.position and not seen.held
            state.position.observe(seen.position, now, stuck=waiting)
            if waiting and state.position.due(now, self.stall_after_s):
                stalls.append(self._report(partition, "no_progress", seen, state.position, now))
            behind = seen.committed is not None and seen.committed < seen.position
            state.committed.observe(seen.committed, now, stuck=behind)
            if behind and state.committed.due(now, self.commit_lag_after_s):
                stalls.append(self._report(partition, "commit_behind", seen, state.committed, now))
        return stalls

    def reset(self) -> None:
        """Forget every partition: what was seen before a rebalance says nothing after it."""
        self._seen.clear()

    def _report(self, partition: P, reason: Reason, seen: Offsets, standing: _Standing, now: float) -> Stall[P]:
        assert standing.since is not None  # due
        again = standing.reported_at is not None
        standing.reported_at = now
        return Stall(partition, reason, seen.end, seen.position, seen.committed, now - standing.since, again)


class WatchedConsumer(Protocol[P]):
    """What ``check_partitions`` needs of a consumer."""

    async def offsets(self) -> Mapping[P, Offsets] | None:
        """The partitions to watch now and their offsets; None while none can be (a rebalance)."""
        ...

    async def restart_fetch(self, partition: P, position: int) -> None:
        """Fetch ``partition`` again from ``position``, where it stands: nothing re-read."""
        ...

    async def rewind(self, partition: P, committed: int) -> None:
        """Read ``partition`` again from its committed offset (records past it are read twice)."""
        ...


async def check_partitions(
    consumer: WatchedConsumer[P], watchdog: PartitionWatchdog[P], no_rewind: Collection[str] = ()
) -> list[Stall[P]]:
    """One check: each stall found is logged, counted and recovered; ``no_rewind``: topics
    whose commit_behind is only reported (re-reading them would count records twice)."""
    offsets = await consumer.offsets()
    if offsets is None:
        watchdog.reset()
        return []
    stalls = watchdog.check(offsets)
    for stall in stalls:
        STALLED.labels(stall.topic, stall.reason).inc()
        logger.warning("%s; %s", stall.describe(), await _recover(consumer, stall, no_rewind))
    return stalls


async def _recover(consumer: WatchedConsumer[P], stall: Stall[P], no_rewind: Collection[str]) -> str:
    """Recover from ``stall``; what was done, in words. Never raises: a recovery that fails
    leaves the stall to be reported again."""
    try:
        if stall.reason == "no_progress":
            await consumer.restart_fetch(stall.partition, stall.position)
            return f"fetch restarted at {stall.position}"
        if stall.topic in no_rewind:
            return "not re-read: its records would be counted twice"
        assert stall.committed is not None  # commit_behind needs one
        await consumer.rewind(stall.partition, stall.committed)
        return f"re-reading it from {stall.committed}"
    except Exception as exc:
        return f"recovery failed ({exc!r})"


async def _seek_resumed(client: AIOKafkaConsumer, partition: tuple[str, int], offset: int) -> None:
    """Seek an aiokafka consumer's partition, resuming it first if it was paused: whatever
    stopped its fetch (a pause, a fetch state gone astray), the seek starts a new one."""
    from aiokafka import TopicPartition

    tp = TopicPartition(*partition)  # aiokafka takes its own tuples only
    if tp in client.paused():
        client.resume(tp)
    client.seek(tp, offset)


class AIOKafkaWatched:
    """A plain aiokafka consumer in a group, watched on every partition it is assigned.

    Not thread-safe: use it on the consumer's own event loop. ``held``: partitions the
    application paused on purpose (not resumed, not watched).
    """

    def __init__(self, client: AIOKafkaConsumer, held: Callable[[], Set[tuple[str, int]]] = frozenset) -> None:
        self.client = client
        self.held = held

    async def offsets(self) -> dict[tuple[str, int], Offsets]:
        held = self.held()
        partitions = [tp for tp in self.client.assignment() if tp not in held]
        if not partitions:
            return {}
        ends = await self.client.end_offsets(partitions)
        return {
            tp: Offsets(ends[tp], await self.client.position(tp), await self.client.committed(tp)) for tp in partitions
        }

    async def restart_fetch(self, partition: tuple[str, int], position: int) -> None:
        await _seek_resumed(self.client, partition, position)

    async def rewind(self, partition: tuple[str, int], committed: int) -> None:
        await _seek_resumed(self.client, partition, committed)


class FaustWatched:
    """A Faust app's consumer (faust-streaming 0.15, aiokafka driver), watched on the
    partitions its streams read: not its tables' changelogs (Faust's recovery reads and
    pauses those), not partitions Faust paused; none during a rebalance or a recovery, or
    while its flow is stopped.

    Faust exposes no committed offsets, no fetch restart that leaves its read offsets alone
    and no way to resume a pause made on its aiokafka client, so this reads its consumer's
    bookkeeping (``_committed_offset``, ``_paused_partitions``, ``_buffered_partitions``)
    and reaches that client through its consumer thread.
    """

    def __init__(self, app: faust.App) -> None:
        self.app = app

    @property
    def consumer(self) -> ThreadDelegateConsumer:
        return cast("ThreadDelegateConsumer", self.app.consumer)

    def _watchable(self) -> bool:
        app = self.app
        return not (app.rebalancing or app.in_recovery) and self.consumer.flow_active

    async def offsets(self) -> dict[TP, Offsets] | None:
        if not self._watchable():
            return None
        consumer = self.consumer
        changelogs = self.app.tables.changelog_topics
        partitions = [
            tp for tp in consumer.assignment() if tp.topic not in changelogs and tp not in consumer._paused_partitions
        ]
        if not partitions:
            return {}
        ends = await asyncio.wait_for(consumer.highwaters(*partitions), READ_TIMEOUT_S)
        positions = {tp: await asyncio.wait_for(consumer.position(tp), READ_TIMEOUT_S) for tp in partitions}
        if not self._watchable():  # a rebalance began meanwhile: the offsets mean nothing
            return None
        acking = self.app.topics.acks_enabled_for
        seen = {}
        for tp in partitions:
            end, position = ends.get(tp), positions[tp]
            if end is None or position is None:
                continue  # being reset: a new start, not a stall
            # Faust keeps a committed 0 as None: either way, nothing acknowledged to compare with.
            committed = consumer._committed_offset.get(tp) if acking(tp.topic) else None
            seen[tp] = Offsets(end, position, committed, held=tp in consumer._buffered_partitions)
        return seen

    async def restart_fetch(self, partition: TP, position: int) -> None:
        consumer = self.consumer
        # Back in Faust's active set, should it have fallen out (it is neither paused nor buffered).
        consumer.resume_partitions({partition})
        # On the client, in its thread: Faust's own ``seek`` would also set the partition's read
        # offset to the position, and records below it still in Faust's hands (fetched, not yet
        # delivered) would then be dropped as already read.
        thread = cast("AIOKafkaConsumerThread", consumer._thread)
        await thread.call_thread(_seek_resumed, thread._ensure_consumer(), partition, position)

    async def rewind(self, partition: TP, committed: int) -> None:
        consumer = self.consumer
        # Out of Faust's active set, what it fetched of the partition and holds in the batch
        # in hand is dropped instead of delivered; delivered after the seek, it would raise
        # the read offset above the records to re-read, and Faust would drop those as read.
        was_active = partition in consumer._get_active_partitions()  # not held by a full buffer
        consumer.pause_partitions({partition})
        try:
            await asyncio.sleep(REWIND_SETTLE_S)  # the one record being delivered now
            await consumer.seek(partition, committed)  # fetch position and read offset
        finally:
            if was_active:
                consumer.resume_partitions({partition})
            else:  # a full buffer holds it still: Faust puts it back once the buffer drains
                consumer._paused_partitions.discard(partition)


#: Apps given a watchdog already: the worker's app may also carry the notifier.
_watched_apps: weakref.WeakSet[Any] = weakref.WeakSet()


def add_partition_watchdog(
    app: faust.App, settings: Settings, reader: Callable[[], AIOKafkaConsumer | None] | None = None
) -> None:
    """Check ``app``'s partitions every ``CHECK_EVERY_S`` (once per app, however often
    called); with ``reader``, also those of the plain consumer it returns (None until started)."""
    if app in _watched_apps:
        return
    _watched_apps.add(app)
    from servewatch.pipeline.topics import REQUESTS

    # Stage 1 drops a request it already holds only with dedup; stage 2 and the notifier
    # always ignore what they already took.
    no_rewind = () if settings.windows.dedup_request_ids else (REQUESTS,)
    faust_consumer = FaustWatched(app)
    watched: list[tuple[Callable[[], WatchedConsumer[Any] | None], PartitionWatchdog[Any]]] = [
        (lambda: faust_consumer, PartitionWatchdog(STALL_AFTER_S, commit_lag_bound(settings)))
    ]
    if reader is not None:
        plain = reader

        def of_reader() -> WatchedConsumer[Any] | None:
            client = plain()
            return None if client is None else AIOKafkaWatched(client)

        watched.append((of_reader, PartitionWatchdog(STALL_AFTER_S, commit_lag_bound(settings))))

    @app.timer(CHECK_EVERY_S)
    async def watch_partitions() -> None:
        for consumer, watchdog in watched:
            client = consumer()
            if client is None:
                continue
            try:
                await check_partitions(client, watchdog, no_rewind)
            except Exception as exc:  # the broker did not answer, the consumer is restarting...
                logger.info("partition watchdog: check skipped (%r)", exc)
