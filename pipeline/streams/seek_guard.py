"""Keep Faust from skipping anomaly records when its streams resume after a rebalance.

When a worker has recovered its tables, Faust (faust-streaming 0.15) resumes the stream
partitions, then seeks them to their committed offsets, then resumes the agents' flow,
which empties their queues. Nothing stops the consumer between the first step and the
last: records it fetches meanwhile move its read offsets forward, sit in an agent's
queue, are thrown away with the queue, and when they are fetched again after the seek
they are below the read offset and dropped as already read. Later records are acked and
their offsets committed, so the skipped ones are gone for good: a notifier restarted
after a crash, on the embedded broker or Apache Kafka, can lose records produced while it
was down (a group's resolve), and never send them; a restarted worker, requests it never
judges.

``hold_flow_while_seeking`` stops the consumer's flow before each such seek. Faust's
recovery resumes it right after the seek, with the read offsets the seek set; what was
fetched before is fetched again and applied once (the notifier's ``ModelState.apply`` and
the worker's window tables ignore replays). ``faust_app`` guards every app it builds.

A partition with no committed offset (or 0) is the same hole wider: aiokafka seeks only to
a committed offset above 0, so the records fetched before the seek are not fetched again
at all (a worker that took over an internal topic's partition nobody had committed on yet
never grouped its first incidents). The guard seeks such partitions to their beginning,
which is where the group's reset policy (``earliest``) starts them anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class SeekingConsumer(Protocol):
    """The part of a Faust consumer (``faust.transport.consumer.Consumer``) the guard uses."""

    flow_active: bool

    def stop_flow(self) -> None: ...

    def resume_flow(self) -> None: ...

    async def perform_seek(self) -> None: ...

    async def seek_to_committed(self) -> Mapping[Any, int | None]: ...

    async def seek(self, partition: Any, offset: int) -> None: ...


def hold_flow_while_seeking(consumer: SeekingConsumer) -> None:
    """Stop ``consumer``'s flow before it seeks its partitions to their committed offsets."""
    seek = consumer.perform_seek
    if getattr(seek, "holds_flow", False):
        return  # guarded already

    async def perform_seek() -> None:
        was_active = consumer.flow_active
        # No record may reach an agent between here and the caller resuming the flow: it
        # would advance the read offset past records that the resume then discards.
        consumer.stop_flow()
        try:
            await seek()
        except BaseException:
            if was_active:  # as it was: the caller gave up on this seek, not on consuming
                consumer.resume_flow()
            raise

    to_committed = consumer.seek_to_committed

    async def seek_to_committed() -> Mapping[Any, int | None]:
        committed = await to_committed()
        for partition, offset in committed.items():
            if offset is None or offset <= 0:  # not sought by aiokafka: from the beginning
                await consumer.seek(partition, 0)
        return committed

    perform_seek.holds_flow = True  # type: ignore[attr-defined]
    consumer.perform_seek = perform_seek  # type: ignore[method-assign]
    consumer.seek_to_committed = seek_to_committed  # type: ignore[method-assign]
