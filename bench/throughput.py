"""Throughput: the servewatch worker against a raw aiokafka consumer, side by side in one run.

    python -m bench.throughput [--records 200000] [--batch 500] [--single 200000] [--repeat 5] [--kafka apache]
    SERVEWATCH_BATCH_READER=false python -m bench.throughput    # requests read by a Faust agent instead

For each message shape (batched JSON arrays, then one record per message) it starts a fresh
broker (the embedded one; ``--kafka apache``: an Apache Kafka node, from the jars Maven
fetched for the tests), produces the same request logs, then measures, ``--repeat`` times in turn,
  (a) a raw aiokafka consumer that only reads and JSON-decodes every record (in a process
      of its own, like the worker), and
  (b) one servewatch worker process end to end (decode, validate, segment, window, models,
      anomaly topic), timed from its first record to its last through its own metrics,
and prints records/s of both, the ratio (b)/(a) of each round and their median, and the
worker's peak RSS. Then the same records through ``servewatch replay`` (file -> anomalies,
no broker), ``--repeat`` times. Rounds are paired (raw, then worker, on the same broker a
moment apart) because this kind of machine's speed drifts by tens of percent within a
minute; the median of the paired ratios is the figure to quote, the range shows the drift.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import orjson
from aiokafka import AIOKafkaConsumer

from bench.common import PEAK_RATE, encode, fleet_records, peak_rss_kib, produce, wait_for
from servewatch.pipeline import topics
from servewatch.pipeline.dev.apache_kafka import ApacheKafka
from servewatch.pipeline.dev.broker import EmbeddedBroker, free_loopback_port
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.kafka import ensure_topics
from servewatch.pipeline.replay.request_logs import REPLAY_CHUNK_LINES, JsonlChunks, Replay
from servewatch.pipeline.tuning import tune_process
from servewatch.pipeline.worker.metrics import served_value

PARTITIONS = 4


async def raw_consumer(bootstrap: str, expected: int) -> float:
    """Records/s of a consumer that reads and JSON-decodes every record, nothing else."""
    consumer = AIOKafkaConsumer(
        topics.REQUESTS,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=32 * 1024 * 1024,
    )
    await consumer.start()
    count, started = 0, None
    try:
        while count < expected:
            batches = await consumer.getmany(timeout_ms=1000, max_records=20_000)
            if started is None and batches:
                started = time.perf_counter()
            for messages in batches.values():
                for message in messages:
                    value = orjson.loads(message.value)
                    count += len(value) if isinstance(value, list) else 1
    finally:
        await consumer.stop()
    assert started is not None
    return count / (time.perf_counter() - started)


def raw_rate(bootstrap: str, expected: int) -> float:
    """``raw_consumer`` in a fresh process, as the worker runs: a process holding the bench's
    records (hundreds of MB of dicts) decodes JSON markedly slower, which would flatter the
    worker (measured: 323-336k against 553k records/s over 1,000,000 records)."""
    return float(run_self("--raw-child", bootstrap, str(expected)).strip().splitlines()[-1])


def run_self(*args: str) -> str:
    """This script in a fresh process (one of its ``--*-child`` modes); its standard output."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.throughput", *args],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return out.stdout


def worker_rate(bootstrap: str, expected: int) -> tuple[float, int, float]:
    """Records/s of one worker process from its first record to its last; its peak RSS (KiB);
    seconds after the last record until stage 2 had judged every window it was going to."""
    port = free_loopback_port()
    env = {
        "SERVEWATCH_METRICS_PORT": str(port),
        "SERVEWATCH_APP_ID": f"bench-{uuid.uuid4().hex[:6]}",
        "SERVEWATCH_LOG_LEVEL": "WARNING",
        "SERVEWATCH_TOPIC_PARTITIONS": str(PARTITIONS),
    }
    worker = start_worker(bootstrap, env)
    try:
        wait_for(lambda: served_value(port, "servewatch_records_total") > 0, timeout_s=60, poll_s=0.05)
        started, first = time.time(), served_value(port, "servewatch_records_total")
        # Poll slowly while it works (a scrape costs the worker CPU); the worker stamps
        # the time of its last message itself.
        wait_for(lambda: served_value(port, "servewatch_records_total") >= expected, timeout_s=600, poll_s=0.5)
        finished = served_value(port, "servewatch_last_message_timestamp_seconds")
        rate = (expected - first) / (finished - started)
        # Stage 2 keeps judging windows; wait until it is quiet (the last windows close on idle flush).
        last, quiet_since = served_value(port, "servewatch_windows_total"), time.time()
        while time.time() - quiet_since < 3.0:
            time.sleep(0.2)
            now = served_value(port, "servewatch_windows_total")
            if now != last:
                last, quiet_since = now, time.time()
        settled = max(quiet_since - finished, 0.0)
        rss = peak_rss_kib(worker.pid)
    finally:
        stop_worker(worker)
    return rate, rss, settled


def measure(
    records: list[dict], batch: int, repeat: int, kafka: str = "tansu"
) -> list[tuple[float, float, int, float]]:
    """(raw records/s, worker records/s, worker peak RSS KiB, tail s) per round, on one broker."""
    messages = encode(records, batch)
    rounds = []
    with ApacheKafka() if kafka == "apache" else EmbeddedBroker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))
        asyncio.run(produce(broker.bootstrap, topics.REQUESTS, messages, PARTITIONS))
        for _ in range(repeat):
            raw = raw_rate(broker.bootstrap, len(records))
            pipeline, rss, settled = worker_rate(broker.bootstrap, len(records))  # a new consumer group each
            rounds.append((raw, pipeline, rss, settled))
    return rounds


def replay_rate(records: list[dict], repeat: int = 1) -> list[float]:
    """Records/s of ``servewatch replay``'s engine over the records written as JSONL, per run,
    in a process of its own (see ``raw_rate``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
        out = run_self("--replay-child", str(path), str(len(records)), str(repeat))
    return [float(rate) for rate in out.split()]


def replay_child(path: str, expected: int, repeat: int) -> list[float]:
    tune_process()  # as `servewatch replay` does
    rates = []
    for _ in range(repeat):
        chunks = JsonlChunks(path, REPLAY_CHUNK_LINES)
        engine = Replay(reread=chunks.reread)
        started = time.perf_counter()
        for _ in engine.run(chunks):
            pass
        elapsed = time.perf_counter() - started
        assert engine.stats.records == expected, engine.stats
        rates.append(expected / elapsed)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=500, help="records per message in the batched run")
    parser.add_argument("--single", type=int, default=200_000, help="records in the one-per-message run")
    parser.add_argument("--repeat", type=int, default=5, help="paired rounds (and replay runs) to take the median of")
    parser.add_argument("--rate", type=float, default=PEAK_RATE, help="the fleet's requests/s in event time")
    parser.add_argument("--kafka", choices=("tansu", "apache"), default="tansu", help="the broker (default: embedded)")
    parser.add_argument("--raw-child", nargs=2, metavar=("BOOTSTRAP", "RECORDS"), help=argparse.SUPPRESS)
    parser.add_argument("--replay-child", nargs=3, metavar=("PATH", "RECORDS", "REPEAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_child:
        print(asyncio.run(raw_consumer(args.raw_child[0], int(args.raw_child[1]))))
        return
    if args.replay_child:
        path, expected, repeat = args.replay_child
        print(" ".join(str(rate) for rate in replay_child(path, int(expected), int(repeat))))
        return

    # The worker's transport and timeouts follow the broker this run starts, whatever the caller's
    # environment says (Tansu refuses the idempotent producer the Kafka profile asks for).
    os.environ["SERVEWATCH_BROKER_PROFILE"] = "kafka" if args.kafka == "apache" else "tansu"
    print(f"machine: {os.cpu_count()} cores; broker ({args.kafka}), producer, consumer and worker share them",
          flush=True)  # fmt: skip
    records = fleet_records(args.records, rate=args.rate)
    print(f"workload: {len(records):,} request logs at {args.rate:,.0f} requests/s of event time, "
          f"{len({(r['model'], r['route']) for r in records})} model x route pairs (x length bands = segments)",
          flush=True)  # fmt: skip

    rows = []
    for label, batch, subset, repeat in (
        (f"batched ({args.batch}/msg)", args.batch, records, args.repeat),
        ("one record per message", 1, records[: args.single], args.repeat),
    ):
        rounds = measure(subset, batch, repeat, args.kafka)
        rows.append((label, len(subset), rounds))
        for i, (raw, pipe, _, _) in enumerate(rounds, 1):
            print(f"  {label}, round {i}: raw {raw:,.0f}/s, servewatch {pipe:,.0f}/s, ratio {pipe / raw:.2f}",
                  flush=True)  # fmt: skip
    replays = replay_rate(records, args.repeat)

    print()
    header = ("messages", "records", "raw consumer", "servewatch", "ratio", "peak RSS", "tail")
    print("{:26} {:>9} {:>14} {:>12} {:>6} {:>9} {:>6}   {}".format(*header, "ratio per round"))
    for label, n, rounds in rows:
        ratios = [pipe / raw for raw, pipe, _, _ in rounds]
        k = ratios.index(statistics.median_low(ratios))  # the round whose ratio is the median
        raw, pipe, _, settled = rounds[k]
        rss = max(r[2] for r in rounds)
        spread = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{label:26} {n:9,} {raw:12,.0f}/s {pipe:10,.0f}/s {pipe / raw:6.2f} {rss / 1024:7.0f}MB "
              f"{settled:5.1f}s   {spread}")  # fmt: skip
    median_replay = statistics.median(replays)
    spread = ", ".join(f"{r:,.0f}" for r in replays)
    print(f"{'replay (file, no broker)':26} {len(records):9,} {'':>14} {median_replay:10,.0f}/s {'':>24}   {spread}")
    print()
    print("ratio = servewatch / raw consumer records/s, same records, same broker, measured side by side;")
    print("the row shows the round with the median ratio, replay its median run; peak RSS is the largest.")
    print("tail = seconds after the last record until stage 2 had judged every window (idle flush included).")


if __name__ == "__main__":
    main()
