"""Shared pieces of the benchmarks: a realistic workload, fast producing, reading worker metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer

from servewatch.pipeline.dev.simulator import Phase, Route, Workload

#: A fleet's mix: 12 models, chat / RAG / agent routes, so ~100 live segments.
FLEET_MODELS = tuple(f"model-{i:02d}" for i in range(12))
FLEET_ROUTES = (
    Route("chat", 0.6, prompt_median=1800, prompt_sigma=0.8, output_median=300, output_sigma=0.8, shared_prefix=0.6),
    Route("rag", 0.25, prompt_median=12000, prompt_sigma=0.6, output_median=350, output_sigma=0.6, shared_prefix=0.9),
    Route(
        "agent", 0.15, prompt_median=30000, prompt_sigma=0.5, output_median=900, output_sigma=0.7, shared_prefix=0.95
    ),
)


#: A busy fleet at peak: ~18,000 requests/s (a few hundred GPUs serving chat and agents).
PEAK_RATE = 18_000.0


def fleet_records(n: int, seed: int = 7, rate: float = PEAK_RATE) -> list[dict[str, Any]]:
    """``n`` request logs of a fleet serving ``rate`` requests/s across 12 models, in finish order.

    The rate sets how many records share a window: per-window work (closing windows,
    judging segments) is spread over ten times fewer records at 1,800/s than at 18,000/s.
    """
    per_model = rate / len(FLEET_MODELS)
    duration = n / rate + 5
    phases = (Phase("normal", duration),)
    workload = Workload(phases, models=FLEET_MODELS, routes=FLEET_ROUTES, base_rate=per_model, seed=seed)
    out: list[dict[str, Any]] = []
    for record in workload.records():
        out.append(record)
        if len(out) == n:
            break
    return out


def encode(records: Sequence[dict[str, Any]], batch: int) -> list[bytes]:
    """Messages as a shipper sends them: JSON arrays of ``batch`` records (1: one object each)."""
    if batch == 1:
        return [orjson.dumps(r) for r in records]
    return [orjson.dumps(list(records[i : i + batch])) for i in range(0, len(records), batch)]


async def produce(bootstrap: str, topic: str, values: list[bytes], partitions: int) -> None:
    """Pre-built record batches per partition (create_batch/send_batch): the fastest aiokafka path."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=0, max_batch_size=4 * 1024 * 1024, max_request_size=32 * 1024 * 1024
    )
    await producer.start()
    try:
        pending = []
        for partition in range(partitions):
            batch = producer.create_batch()
            for value in values[partition::partitions]:
                if batch.append(key=None, value=value, timestamp=None) is None:
                    pending.append(await producer.send_batch(batch, topic, partition=partition))
                    batch = producer.create_batch()
                    batch.append(key=None, value=value, timestamp=None)
            if batch.record_count():
                pending.append(await producer.send_batch(batch, topic, partition=partition))
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def wait_for(predicate: Any, timeout_s: float, poll_s: float = 0.02) -> float:
    """Poll until ``predicate()`` is true; return the monotonic time it became true."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(poll_s)
    raise TimeoutError(f"condition not met within {timeout_s}s")
