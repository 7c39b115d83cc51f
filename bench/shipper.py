"""Shipper throughput: ``servewatch ship`` from a JSONL file into Kafka, against a raw aiokafka producer.

    python -m bench.shipper [--records 200000] [--openai 50000] [--batch 500] [--repeat 3]

Two inputs, each written once as a JSONL file: the bench fleet's request logs as native
``RequestLog`` JSON (``bench/common.py``), and the same kind of requests as an OpenAI-compatible
gateway logs them (``{"response", "request", "timing"}``, a 2,500-character system prompt
per route and a user turn, ~3 KB a line; the shipper hashes the prompt and drops it). Each
round starts a fresh embedded broker and measures, one after the other, each in a process
of its own:
  (a) a raw aiokafka producer (``pipeline.kafka.producer``, the shipper's own settings) sending
      the very messages the shipper will send (JSON arrays of ``--batch`` adapted records,
      built beforehand), from its first send to its last acknowledgement, and
  (b) ``servewatch ship --in F --no-follow`` end to end (read, split lines, parse, adapt,
      validate, hash prompts, batch, send, save positions), from its first line read to its
      last acknowledgement, as it reports on exit,
and prints records/s of both and the ratio (b)/(a) per round, then the round with the
median ratio. Rounds are paired because this kind of machine drifts by tens of per cent
within a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import encode, fleet_records
from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import EmbeddedBroker
from servewatch.pipeline.ingest.ship.adapters import Rejection, adapter_for
from servewatch.pipeline.kafka import ensure_topics, producer

PARTITIONS = 4
ROUTE_PROMPTS = {route: f"You are the {route} assistant of Example Corp. " * 50 for route in ("chat", "rag", "agent")}
ANSWER = {"role": "assistant", "content": "- one\n- two\n- three"}
SHIP_LINE = re.compile(r"ship: read ([\d,]+), sent ([\d,]+), rejected ([\d,]+).*\(([\d,]+) records/s")


def as_openai(record: dict[str, Any]) -> dict[str, Any]:
    """A bench request log as an OpenAI-compatible gateway would log the call."""
    system = ROUTE_PROMPTS.get(record["route"], ROUTE_PROMPTS["chat"])
    question = f"Question {record['request_id']}: summarise the attached report in three bullet points."
    return {
        "route": record["route"],
        "instance": record["instance"],
        "engine": record["engine"],
        "request": {
            "model": record["model"],
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_completion_tokens": record["max_tokens"],
        },
        "response": {
            "id": record["request_id"],
            "object": "chat.completion",
            "created": int(record["timestamp"] - record["e2e_s"]),
            "model": record["model"],
            "choices": [{"index": 0, "finish_reason": record["finish_reason"], "message": ANSWER}],
            "usage": {
                "prompt_tokens": record["prompt_tokens"],
                "completion_tokens": record["completion_tokens"],
                "total_tokens": record["prompt_tokens"] + record["completion_tokens"],
                "prompt_tokens_details": {"cached_tokens": record["cached_tokens"]},
            },
        },
        "timing": {f"{key}_s": record[f"{key}_s"] for key in ("e2e", "ttft", "queue", "prefill", "decode")}
        | {"end": record["timestamp"]},
    }


def prepare(directory: Path, name: str, lines: list[dict[str, Any]], batch: int) -> tuple[Path, Path, int]:
    """The JSONL input and the messages the shipper will send (adapted records, ``batch`` per message)."""
    source, messages = directory / f"{name}.jsonl", directory / f"{name}.messages"
    source.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    adapt = adapter_for("auto")
    rows = [row for row in map(adapt, lines) if not isinstance(row, Rejection)]
    assert len(rows) == len(lines), "the bench input is meant to be clean"
    messages.write_bytes(b"".join(value + b"\n" for value in encode(rows, batch)))
    return source, messages, len(rows)


async def raw_producer(bootstrap: str, path: str, records: int) -> float:
    """Records/s of the pre-built messages sent with ``send()`` per message, all acknowledged."""
    values = Path(path).read_bytes().split(b"\n")[:-1]
    kafka = producer(bootstrap)
    await kafka.start()
    try:
        started = time.perf_counter()
        futures = [await kafka.send(topics.REQUESTS, value) for value in values]
        await asyncio.gather(*futures)
        return records / (time.perf_counter() - started)
    finally:
        await kafka.stop()


def run_child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=True,
                          stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[1])  # fmt: skip


def ship_rate(bootstrap: str, source: Path, records: int, batch: int, state: Path) -> float:
    done = run_child("-m", "servewatch", "ship", "--in", str(source), "--no-follow", "--state", str(state),
                     "--batch", str(batch), "--broker", bootstrap)  # fmt: skip
    match = SHIP_LINE.search(done.stderr)
    assert match is not None, done.stderr[-2000:]
    read, sent, rejected, rate = (int(group.replace(",", "")) for group in match.groups())
    assert (read, sent, rejected) == (records, records, 0), done.stderr[-2000:]
    return float(rate)


def measure(
    source: Path, messages: Path, records: int, batch: int, repeat: int, tmp: Path
) -> list[tuple[float, float]]:
    """(raw producer records/s, ship records/s) per round."""
    rounds = []
    for n in range(repeat):
        with EmbeddedBroker() as broker:  # fresh per round: Tansu keeps every record in memory
            asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS, (topics.REQUESTS, topics.DEADLETTER)))
            raw = float(
                run_child("-m", "bench.shipper", "--raw-child", broker.bootstrap, str(messages), str(records)).stdout
            )
            shipped = ship_rate(broker.bootstrap, source, records, batch, tmp / f"{source.stem}-{n}.state")
        rounds.append((raw, shipped))
        print(f"  {source.stem}, round {n + 1}: raw producer {raw:,.0f}/s, servewatch ship {shipped:,.0f}/s, "
              f"ratio {shipped / raw:.2f}", flush=True)  # fmt: skip
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=200_000, help="native RequestLog lines")
    parser.add_argument("--openai", type=int, default=None, help="OpenAI-style lines (default: records / 4)")
    parser.add_argument("--batch", type=int, default=500, help="records per message")
    parser.add_argument("--repeat", type=int, default=3, help="paired rounds per input")
    parser.add_argument("--raw-child", nargs=3, metavar=("BOOTSTRAP", "MESSAGES", "RECORDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_child:
        bootstrap, path, records = args.raw_child
        print(asyncio.run(raw_producer(bootstrap, path, int(records))))
        return

    print(f"machine: {os.cpu_count()} cores; broker, producer and shipper share them", flush=True)
    native = fleet_records(args.records)
    openai = [as_openai(record) for record in native[: args.openai or max(args.records // 4, 1)]]
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        for name, lines in (("native", native), ("openai", openai)):
            source, messages, records = prepare(tmp, name, lines, args.batch)
            size = source.stat().st_size
            print(f"{name}: {records:,} lines, {size / 1e6:,.0f} MB ({size / records:,.0f} B/line)", flush=True)
            rows.append((name, records, size, measure(source, messages, records, args.batch, args.repeat, tmp)))

    print()
    header = ("input", "records", "MB", "raw producer", "servewatch ship", "ratio")
    print("{:8} {:>9} {:>6} {:>14} {:>16} {:>6}   {}".format(*header, "ratio per round"))
    for name, records, size, rounds in rows:
        ratios = [shipped / raw for raw, shipped in rounds]
        raw, shipped = rounds[ratios.index(statistics.median_low(ratios))]
        spread = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{name:8} {records:9,} {size / 1e6:6,.0f} {raw:12,.0f}/s {shipped:14,.0f}/s {shipped / raw:6.2f}   "
              f"{spread}")  # fmt: skip
    print()
    print("records/s into Kafka, first send (raw) or first line read (ship) to last acknowledgement; the raw")
    print("producer sends the shipper's own messages, pre-built; the row shows the round with the median ratio.")


if __name__ == "__main__":
    main()
