"""The broker frozen for 30 s under traffic: ``SIGSTOP`` of the embedded broker
while a shipper follows a growing request log, a scraper scrapes an engine and a worker
judges. After ``SIGCONT`` all three carry on by themselves; every line written reaches
the worker, and the worker accounts for every record: judged + late + duplicates =
accepted, with nothing dropped silently; and since silence is taken for idleness only
while the broker answers, what the frozen broker held back is judged, not late. On Apache
Kafka the freeze outlasts the group's session: the worker rejoins at its committed offsets
and reads again what it had read, which it counts as duplicates (requests) and replays
(partials), never judging a record twice nor losing one."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest

from servewatch.pipeline import topics
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.kafka import ensure_topics, read_topic
from servewatch.pipeline.worker.metrics import served_value
from servewatch.schemas.engine_interval import EngineInterval
from tests.conftest import new_broker
from tests.engine_sim import ExpositionHandler, SimulatedVllm

pytestmark = pytest.mark.integration

PAUSE_S = 30.0


class Engine(ExpositionHandler):
    sim = SimulatedVllm()
    lock = threading.Lock()

    def text(self) -> str:
        with self.lock:
            self.sim.step(50)
            return self.sim.text()


def _servewatch(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "servewatch", *args], env={**os.environ, **env},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip


def _write(log: Path, start: int, count: int) -> None:
    now = time.time()
    with log.open("ab") as out:
        for n in range(start, start + count):
            record = {"request_id": f"p{n}", "timestamp": now - 0.5 + (n - start) / count / 2, "model": "m",
                      "route": ("chat", "rag")[n % 2], "prompt_tokens": 700, "completion_tokens": 50, "e2e_s": 1.1,
                      "ttft_s": 0.2, "finish_reason": "stop"}  # fmt: skip
            out.write(orjson.dumps(record) + b"\n")


async def _intervals_after(bootstrap: str, since: float, timeout_s: float) -> EngineInterval:
    async def scan() -> EngineInterval:
        async for raw in read_topic(bootstrap, topics.SCRAPES):
            interval = EngineInterval.model_validate_json(raw)
            if interval.end > since:
                return interval
        raise AssertionError("reader ended")

    return await asyncio.wait_for(scan(), timeout_s)


def test_a_frozen_broker_stalls_shipper_scraper_and_worker_and_loses_nothing(tmp_path: Path) -> None:
    engine = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    log, port = tmp_path / "requests.jsonl", free_loopback_port()
    log.touch()
    with new_broker() as broker:
        asyncio.run(ensure_topics(broker.bootstrap, 4))
        env = {"SERVEWATCH_BROKER": broker.bootstrap, "SERVEWATCH_BROKER_PROFILE": broker.profile}
        worker = start_worker(broker.bootstrap, {"SERVEWATCH_APP_ID": f"pause-{uuid.uuid4().hex[:6]}",
                                                 "SERVEWATCH_METRICS_PORT": str(port),
                                                 "SERVEWATCH_LATENESS_PRIOR_S": "2"})  # fmt: skip
        shipper = _servewatch("ship", "--in", str(log), "--state", str(tmp_path / "pos.json"), "--linger", "200ms",
                              env=env)  # fmt: skip
        scraper = _servewatch("scrape", "--target", f"http://127.0.0.1:{engine.server_port}/metrics",
                              "--interval", "1s", "--give-up-after", "0", env=env)  # fmt: skip
        written = 0
        try:
            for _ in range(6):  # 6 s of traffic, 200 requests a second
                _write(log, written, 200)
                written += 200
                time.sleep(1)
            broker.pause()
            for _ in range(int(PAUSE_S)):  # the log keeps growing while Kafka is frozen
                _write(log, written, 200)
                written += 200
                time.sleep(1)
            broker.resume()
            resumed = time.time()
            for _ in range(6):
                _write(log, written, 200)
                written += 200
                time.sleep(1)

            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                accepted = served_value(port, "servewatch_records_total")
                done = sum(served_value(port, f"servewatch_{k}_total")
                           for k in ("judged_records", "late_records", "duplicate_records"))  # fmt: skip
                if accepted >= written and done == accepted:
                    break
                time.sleep(1)
            late = served_value(port, "servewatch_late_records_total")
            interval = asyncio.run(_intervals_after(broker.bootstrap, resumed, timeout_s=30))
            alive = (shipper.poll(), scraper.poll(), worker.poll())
        finally:
            for process in (shipper, scraper):
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
                    process.wait(timeout=30)
            stop_worker(worker)
            engine.shutdown()
    assert alive == (None, None, None), "shipper, scraper and worker all lived through the pause"
    assert accepted >= written, f"the worker got {accepted:.0f} of {written} lines"  # more: re-sent (at least once)
    assert done == accepted, f"accepted {accepted:.0f}, judged + late + duplicates {done:.0f}"
    # Silence while the broker does not answer is not idleness: what it held back is not late
    # (before that rule, 1,803 of these 10,000 records were).
    assert late <= 0.01 * written, f"{late:.0f} records late"
    assert interval.end > resumed, "the scraper's intervals reach Kafka again after the pause"
    assert b"ship: read" in shipper.stderr.read()  # type: ignore[union-attr]
