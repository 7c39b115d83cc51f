"""The partition a key goes to, computed the way the producer computes it."""

from __future__ import annotations

from aiokafka.partitioner import murmur2

from servewatch.models.windows.segment_keys import routing_key


def partition_of(key: str, partitions: int) -> int:
    """Stable partition of a key (a segment, an engine, a model), the same on every worker and every run.

    Kafka's default partitioner (murmur2 of the key, as the Java client and aiokafka
    compute it), so the detector-state table, keyed by segment and partitioned by the
    producer, puts a segment's state on the same partition number as its partials: the
    worker that judges a segment is the one that holds its state.
    """
    return (murmur2(key.encode()) & 0x7FFFFFFF) % partitions


def partials_partition(key: str, partitions: int) -> int:
    """The partials partition a segment's (or a replica row's) windows travel through: the
    stage-2 worker that judges it, and the stream whose event time it is judged in."""
    return partition_of(routing_key(key), partitions)
