"""Recovery: how long detection is blind after a worker is killed, and how long a worker takes to join.

    python -m bench.recovery [--rounds 3] [--profile tansu|kafka]

On the embedded broker, real-time traffic (request logs stamped with the wall clock as
they are produced, every partition, a few segments each) flows while two workers of one
consumer group share the work. Each round, measured beside each other in one run:

* **join**: a second worker started next to a running one (a broker with an existing
  group, whose partitions a rebalance then splits): seconds from its start to the first
  message it reads, and to its first judged window (a window must close first);
* **takeover**: ``kill -9`` of one of two workers: seconds from the kill until the
  survivor judges windows of every partials partition the dead one owned, and until its
  judged event time there is back within the usual lag of the live stream.

Times come from the workers' own ``servewatch_judged_until_seconds{partition}`` gauges,
polled every 0.2 s. ``--profile kafka`` runs the workers with the Apache Kafka consumer
timings (session 10 s) instead of the embedded broker's (6 s) to show what the session
timeout costs; on Apache Kafka itself the takeover is bounded the same way, by the session
timeout plus a rebalance.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import threading
import time
import uuid
from typing import Any

import orjson

from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import EmbeddedBroker, free_loopback_port
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.pipeline.worker.metrics import served_samples, served_value

PARTITIONS = 4
MODELS = ("llama-70b", "qwen-32b", "mistral-7b", "gemma-27b", "llama-8b", "qwen-7b", "phi-4", "granite-8b")


def judged_until(port: int) -> dict[int, float]:
    """A worker's judged event time per partials partition it owns ({} when down or not yet)."""
    samples = served_samples(port, "servewatch_judged_until_seconds")
    return {int(labels["partition"]): value for labels, value in samples}


class Traffic(threading.Thread):
    """Real-time request logs into every partition, 4 messages a second, until stopped."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap, self.stop = bootstrap, threading.Event()

    def run(self) -> None:
        asyncio.run(self._produce())

    async def _produce(self) -> None:
        prod = producer(self.bootstrap)
        await prod.start()
        n = 0
        try:
            while not self.stop.is_set():
                now = time.time()
                for partition in range(PARTITIONS):
                    rows: list[dict[str, Any]] = []
                    for i in range(16):
                        n += 1
                        rows.append({"request_id": f"r{n}", "timestamp": now - 0.2 + i / 60,
                                     "model": MODELS[i % len(MODELS)], "route": ("chat", "rag")[n % 2],
                                     "prompt_tokens": 900, "completion_tokens": 80, "e2e_s": 1.6, "ttft_s": 0.25,
                                     "finish_reason": "stop"})  # fmt: skip
                    await prod.send_and_wait(topics.REQUESTS, orjson.dumps(rows), partition=partition)
                await asyncio.sleep(0.25)
        finally:
            await prod.stop()


def wait(predicate: Any, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(0.2)
    raise TimeoutError(f"not within {timeout_s:.0f} s")


def one_round(bootstrap: str, profile: str) -> tuple[float, float, float, float, float]:
    """(join s, takeover s, caught-up s, usual lag s, first read s) of one round on a fresh consumer group."""
    group = f"recovery-{uuid.uuid4().hex[:6]}"
    ports = [free_loopback_port() for _ in range(2)]

    def start(port: int) -> Any:
        env = {"SERVEWATCH_APP_ID": group, "SERVEWATCH_METRICS_PORT": str(port), "SERVEWATCH_LOG_LEVEL": "ERROR",
               "SERVEWATCH_BROKER_PROFILE": profile}  # fmt: skip
        return start_worker(bootstrap, env)

    workers = [start(ports[0])]
    try:
        wait(lambda: len(judged_until(ports[0])) >= PARTITIONS, 120)
        time.sleep(10)  # settle: judging, the lateness learned
        usual = statistics.median(time.time() - v for v in judged_until(ports[0]).values())

        started = time.monotonic()
        workers.append(start(ports[1]))  # joins a running group: a rebalance splits the partitions
        reads = wait(lambda: served_value(ports[1], "servewatch_messages_total") > 0, 120) - started
        join = wait(lambda: bool(judged_until(ports[1])), 120) - started
        wait(lambda: len(judged_until(ports[0])) + len(judged_until(ports[1])) >= PARTITIONS, 120)
        time.sleep(10)

        victim, survivor = (0, 1) if judged_until(ports[0]) else (1, 0)
        theirs = set(judged_until(ports[victim]))
        os.kill(workers[victim].pid, signal.SIGKILL)
        killed, killed_wall = time.monotonic(), time.time()
        takeover = wait(lambda: theirs <= set(judged_until(ports[survivor])), 120) - killed

        def caught_up() -> bool:
            mine = judged_until(ports[survivor])
            return all(time.time() - mine.get(p, 0.0) <= usual + 10.0 and mine[p] > killed_wall for p in theirs)

        back = wait(caught_up, 180) - killed
        return join, takeover, back, usual, reads
    finally:
        for worker in workers:
            if worker.poll() is None:
                stop_worker(worker)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", choices=("tansu", "kafka"), default="tansu")
    args = parser.parse_args()
    rows = []
    with EmbeddedBroker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, PARTITIONS))
        traffic = Traffic(broker.bootstrap)
        traffic.start()
        try:
            for k in range(args.rounds):
                rows.append(one_round(broker.bootstrap, args.profile))
                print(f"round {k + 1}: join: reads {rows[-1][4]:.1f} s, judges {rows[-1][0]:.1f} s; takeover "
                      f"{rows[-1][1]:.1f} s, caught up {rows[-1][2]:.1f} s (usual lag {rows[-1][3]:.1f} s)",
                      flush=True)  # fmt: skip
        finally:
            traffic.stop.set()
            traffic.join(timeout=10)
    med = [statistics.median(column) for column in zip(*rows, strict=True)]
    print(f"\nprofile {args.profile}, {args.rounds} rounds, medians:")
    print(f"  a second worker joining a running group reads its first message after {med[4]:5.1f} s")
    print(f"  ... and judges its first window after                                 {med[0]:5.1f} s")
    print(f"  after kill -9 of one of two workers, the survivor judges its windows   {med[1]:5.1f} s")
    print(f"  ... and is back to the usual lag ({med[3]:.1f} s behind the wall) after  {med[2]:5.1f} s")


if __name__ == "__main__":
    main()
