"""The cost of Kafka transactions for the worker's output, measured side by side in one run.

    python -m bench.transactions [--messages 10000] [--size 3000] [--windows 10,100] [--repeat 3] [--kafka tansu]

The design question: should the worker publish an incident's event together with its state
and its input offsets in one Kafka transaction (readers on read_committed), rather than
at-least-once (publish, wait for the acks, then commit the offsets; state replay-safe)?

On a broker it starts (an Apache Kafka node from the jars Maven fetched for the tests;
``--kafka tansu``: the embedded broker, which grants no producer id, so only the rows that
need none run), the bench writes ``--messages`` messages of ``--size`` bytes (a firing event
with its evidence is a few KB) over 4 partitions, each way in turn, ``--repeat`` rounds:
  plain             servewatch's producer (acks=all, no linger), idempotence off; acks awaited at the end
  idempotent        the same with a producer id
  at-least-once /N  plain, and every N messages: wait for their acks, then commit the input offsets
                    (an OffsetCommit of a consumer group), as a worker closing a window would
  transactional /N  every N messages one transaction: begin, N sends, send_offsets_to_transaction
                    with the input offsets, commit
and prints messages/s, the ratio to plain in the same round (the median over rounds; the rounds
are paired because this kind of machine's speed drifts within a minute), and the median time a
window's end took (acks and OffsetCommit, or send_offsets and EndTxn). The input offsets are a
notional input's (nothing is consumed in the loop): the rows differ only by what producing and
committing cost. Then it reads the plain topic and the smallest window's transactional topic
from the beginning with read_uncommitted and read_committed consumers, in turn (6 pairs, in
both orders), and prints their rates.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time
import uuid
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from servewatch.pipeline.dev.apache_kafka import ApacheKafka
from servewatch.pipeline.dev.broker import EmbeddedBroker
from servewatch.pipeline.kafka import Producer, producer

PARTITIONS = 4
INPUT = "bench-txn-input"  # the notional input whose offsets each window commits
WARM_UP = 200  # messages each way writes once before the timed rounds
READS = 6  # paired reads of each topic: a read takes about a second, so more of them than writes


@dataclass
class Mode:
    """One way of writing: its label, window (0: none) and whether it runs in transactions."""

    label: str
    window: int = 0
    transactional: bool = False
    idempotent: bool = False
    topic: str = field(init=False)
    written: int = 0
    rates: list[float] = field(default_factory=list)
    window_ms: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.topic = "bench-txn-" + self.label.replace(" /", "-").replace(" ", "-")

    @property
    def needs_producer_id(self) -> bool:
        return self.idempotent or self.transactional


def modes(windows: list[int]) -> list[Mode]:
    out = [Mode("plain"), Mode("idempotent", idempotent=True)]
    for n in windows:
        out += [Mode(f"at-least-once /{n}", window=n), Mode(f"transactional /{n}", window=n, transactional=True)]
    return out


def offsets(window: int) -> dict[TopicPartition, int]:
    """The input offsets a window's end commits: one more message per partition each window."""
    return {TopicPartition(INPUT, p): window + 1 for p in range(PARTITIONS)}


async def create_topics(bootstrap: str, names: list[str]) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=PARTITIONS, replication_factor=1) for name in names])
    finally:
        await admin.close()


async def write(bootstrap: str, mode: Mode, messages: int, value: bytes) -> tuple[float, list[float]]:
    """Messages/s of one run of ``mode`` (from its first send to its last ack or commit) and
    the milliseconds each window's end took."""
    group = f"bench-txn-{mode.label.replace(' /', '-').replace(' ', '-')}"
    client: Producer = (
        Producer(bootstrap_servers=bootstrap, acks="all", linger_ms=0, transactional_id=f"bench-{uuid.uuid4().hex}")
        if mode.transactional
        else producer(bootstrap, idempotence=mode.idempotent)
    )
    committer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await client.start()
    await committer.start()
    ends: list[float] = []
    try:
        committer.assign(list(offsets(0)))
        started = time.perf_counter()
        if mode.window == 0:
            pending = [await client.send(mode.topic, value, partition=i % PARTITIONS) for i in range(messages)]
            await asyncio.gather(*pending)
        else:
            for w, first in enumerate(range(0, messages, mode.window)):
                count = min(mode.window, messages - first)
                if mode.transactional:
                    await client.begin_transaction()
                pending = [await client.send(mode.topic, value, partition=(first + i) % PARTITIONS)
                           for i in range(count)]  # fmt: skip
                end = time.perf_counter()
                if mode.transactional:
                    await client.send_offsets_to_transaction(offsets(w), group)
                    await client.commit_transaction()  # flushes the window's sends first
                else:
                    await asyncio.gather(*pending)
                    await committer.commit(offsets(w))
                ends.append((time.perf_counter() - end) * 1000)
        elapsed = time.perf_counter() - started
    finally:
        await committer.stop()
        await client.stop()
    return messages / elapsed, ends


async def read_rate(bootstrap: str, topic: str, isolation: str, expected: int) -> float:
    """Messages/s of a group-less consumer reading ``topic`` from its beginning to ``expected`` messages."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, isolation_level=isolation,
        auto_offset_reset="earliest", fetch_max_bytes=64 * 1024 * 1024, max_partition_fetch_bytes=16 * 1024 * 1024,
    )  # fmt: skip
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        count, started = 0, time.perf_counter()
        deadline = time.monotonic() + 300
        while count < expected:
            assert time.monotonic() < deadline, f"read {count} of {expected} messages of {topic} ({isolation})"
            batches = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            count += sum(len(records) for records in batches.values())
        return count / (time.perf_counter() - started)
    finally:
        await consumer.stop()


async def grants_producer_ids(bootstrap: str) -> bool:
    probe = producer(bootstrap)
    await probe.start()
    try:
        return bool(probe.idempotent)
    finally:
        await probe.stop()


async def run(bootstrap: str, args: argparse.Namespace) -> None:
    windows = [int(n) for n in args.windows.split(",")]
    all_modes = modes(windows)
    if not await grants_producer_ids(bootstrap):
        skipped = [m.label for m in all_modes if m.needs_producer_id]
        print(f"the broker grants no producer id: {', '.join(skipped)} cannot run on it", flush=True)
        all_modes = [m for m in all_modes if not m.needs_producer_id]
    await create_topics(bootstrap, [INPUT, *(m.topic for m in all_modes)])
    value = os.urandom(args.size // 2).hex().encode()[: args.size]

    # Not timed: a new topic's first writes wait for its partitions' leaders and in-sync
    # replicas, a group's first commit for its coordinator, a transactional id's for its own.
    for mode in all_modes:
        await write(bootstrap, mode, WARM_UP, value)
        mode.written += WARM_UP

    ratios: dict[str, list[float]] = {m.label: [] for m in all_modes}
    for r in range(1, args.repeat + 1):
        plain = None
        for mode in all_modes:
            rate, ends = await write(bootstrap, mode, args.messages, value)
            mode.written += args.messages
            mode.rates.append(rate)
            mode.window_ms += ends
            plain = plain or rate  # the first mode is plain
            ratios[mode.label].append(rate / plain)
        print(f"  round {r}: " + ", ".join(f"{m.label} {m.rates[-1]:,.0f}/s" for m in all_modes), flush=True)

    print()
    print(f"producer: {args.messages:,} messages of {args.size:,} bytes over {PARTITIONS} partitions per run, "
          f"{args.repeat} rounds")  # fmt: skip
    header = ("writes", "messages/s", "ratio", "per window", "window end")
    print("{:22} {:>11} {:>7} {:>11} {:>11}   {}".format(*header, "ratio per round"))
    for mode in all_modes:
        rate, ratio = statistics.median(mode.rates), statistics.median(ratios[mode.label])
        per_window = f"{mode.window / rate * 1000:.1f} ms" if mode.window else "-"
        end = f"{statistics.median(mode.window_ms):.1f} ms" if mode.window_ms else "-"
        spread = ", ".join(f"{x:.2f}" for x in ratios[mode.label])
        print(f"{mode.label:22} {rate:11,.0f} {ratio:7.2f} {per_window:>11} {end:>11}   {spread}")

    readable = [all_modes[0], *[m for m in all_modes if m.transactional][:1]]
    print()
    print(f"consumer: each topic from its beginning ({all_modes[0].written:,} messages), {READS} rounds in turn")
    print("{:22} {:>17} {:>15} {:>7}   {}".format("topic written", "read_uncommitted", "read_committed", "ratio",
                                                 "ratio per round"))  # fmt: skip
    for mode in readable:
        pairs = []
        for r in range(READS):  # in both orders: the first read of a pair is not the one that warms up
            order = ("read_uncommitted", "read_committed")[:: 1 if r % 2 == 0 else -1]
            rates = {isolation: await read_rate(bootstrap, mode.topic, isolation, mode.written) for isolation in order}
            pairs.append((rates["read_uncommitted"], rates["read_committed"]))
        read_ratios = [c / u for u, c in pairs]
        u, c = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        spread = ", ".join(f"{x:.2f}" for x in read_ratios)
        print(f"{mode.label:22} {u:15,.0f}/s {c:13,.0f}/s {statistics.median(read_ratios):7.2f}   {spread}")
    print()
    print("ratio = messages/s over plain's in the same round (median of rounds); per window = window / messages/s;")
    print("window end = median time from a window's last send to its offsets committed (at-least-once: acks")
    print("awaited, then OffsetCommit; transactional: send_offsets_to_transaction, then commit).")
    print("consumer ratio = read_committed / read_uncommitted messages/s, paired by round (median of rounds).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000, help="messages per run")
    parser.add_argument("--size", type=int, default=3_000, help="bytes per message")
    parser.add_argument("--windows", default="10,100", help="messages per window (transaction), comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="paired rounds to take the median of")
    parser.add_argument("--kafka", choices=("apache", "tansu"), default="apache", help="the broker (default: Apache)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(f"machine: {os.cpu_count()} cores; broker ({args.kafka}) and the bench share them", flush=True)
    with ApacheKafka() if args.kafka == "apache" else EmbeddedBroker() as broker:
        asyncio.run(run(broker.bootstrap, args))


if __name__ == "__main__":
    main()
