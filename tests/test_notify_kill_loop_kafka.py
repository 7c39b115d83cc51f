"""A kill loop for delivery: ``servewatch notify`` killed with SIGKILL at random points (``KILLS``
times, restarted at once) while incident groups keep arriving and the receivers keep failing:
Slack answers 429 with Retry-After, PagerDuty 500, the webhook hangs past the sink's timeout,
Alertmanager drops connections for seconds at a time. A notification is done when its sink
accepted it (or it was dead-lettered), not when it was queued in memory, so every group's
firing and resolve must reach every sink, firing first, each with its ``sent`` Delivery
record, whatever was in flight at each kill.

Exactly once holds except where no protocol can give it: a kill between a receiver's answer
and the notifier's booking of it (milliseconds) sends that notification again on restart.
So a duplicate is allowed only as one resend per kill; the count is printed (``-s``)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.dev.receivers import Fault, LocalReceiver
from tests.conftest import Broker
from tests.test_notify_kafka import (
    by_sink_and_status,
    classified,
    grouped,
    incidents,
    produce,
    receiving,
    recorded,
    sigkill,
    until,
)

pytestmark = pytest.mark.integration

KILLS = 10  # half while groups fire, half while they resolve
KILL_SEED = 20261203
#: Models whose groups fire (then resolve) during the loop, one new group every ``WAVE_S``.
MODELS = tuple(f"model-{i}" for i in range(8))
WAVE_S = 2.0
SINKS = ("chat", "chat-bot", "pager", "am", "hook")


def _fail_a_while(receiver: LocalReceiver) -> None:
    """A round of refusals, errors, a hang and a short outage, for the next requests."""
    receiver.inject("slack", Fault.status(429, retry_after=1), Fault.status(429, retry_after=1))
    receiver.inject("slack_api", Fault.status(429, retry_after=1))
    receiver.inject("pagerduty", Fault.status(500), Fault.status(502))
    receiver.inject("webhook", Fault.delay(2.5))  # longer than the sink's 1 s timeout
    receiver.down("alertmanager", 2.0)


async def _play(bootstrap: str, receiver: LocalReceiver, grouper: IncidentGrouper, status: str) -> None:
    """Each model's group moves to ``status``, one a wave, each wave with its round of faults."""
    for model in MODELS:
        await produce(bootstrap, grouped(grouper, incidents(model, status)))
        _fail_a_while(receiver)
        await asyncio.sleep(WAVE_S)


async def _start(bootstrap: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_loopback_port()
    return start_worker(bootstrap, {**env, "SERVEWATCH_METRICS_PORT": str(port)}, command=("notify",)), port


async def _serving(port: int, timeout_s: float = 60.0) -> None:
    """Until the notifier's /metrics answers: it is past its imports (a kill before that only
    tests Python's start-up); the kills then fall anywhere from joining the group on."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            try:
                if (await client.get(f"http://127.0.0.1:{port}/metrics")).status_code == 200:
                    return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)


def _every(status: str) -> set[tuple[str, str, str]]:
    return {(sink, model, status) for sink in SINKS for model in MODELS}


async def _all_out(bootstrap: str, receiver: LocalReceiver, status: str) -> None:
    """Every sink accepted every group's ``status``, and each has its sent Delivery record."""
    wanted = _every(status)
    await until(lambda: wanted <= set(by_sink_and_status(receiver, MODELS)), 120, f"every {status}",
                lambda: f"missing {sorted(wanted - set(by_sink_and_status(receiver, MODELS)))}")  # fmt: skip
    await recorded(bootstrap, wanted, timeout_s=60.0)


async def test_no_notification_is_lost_when_the_notifier_is_killed_ten_times(broker: Broker, tmp_path: Path) -> None:
    bootstrap = broker.bootstrap
    receiver, config = await receiving(bootstrap, tmp_path)
    env = {"SERVEWATCH_APP_ID": f"notify-kill-{uuid.uuid4().hex[:8]}", "SERVEWATCH_NOTIFY_CONFIG": str(config)}
    grouper, draw = IncidentGrouper(), random.Random(KILL_SEED)
    notifier, metrics_port = await _start(bootstrap, env)
    kills, killed_at = 0, []
    try:
        # The groups fire, then resolve once every firing is out (a group that resolves before
        # any sink was told of it sends nothing, see ``notify.plan``). In each half, kills at
        # random points: start-up, group waits, retries and deliveries alike.
        for status in ("firing", "resolved"):
            playing = asyncio.create_task(_play(bootstrap, receiver, grouper, status))
            for _ in range(KILLS // 2):
                await _serving(metrics_port)
                await asyncio.sleep(draw.uniform(0.0, 10.0))
                sigkill(notifier)
                kills, killed_at = kills + 1, [*killed_at, time.time()]
                notifier, metrics_port = await _start(bootstrap, env)
            await playing
            await _all_out(bootstrap, receiver, status)
        await asyncio.sleep(4.0)  # anything sent twice would come now
    finally:
        stop_worker(notifier)
        await receiver.stop()

    seen = by_sink_and_status(receiver, MODELS)
    duplicates = {key: n - 1 for key, n in seen.items() if n > 1}
    faults = Counter((a.kind, a.fault or "accepted") for a in receiver.attempts)
    # A kill with a request to a receiver in the second before it struck mid-delivery.
    mid_delivery = sum(any(at - 1.0 <= a.at <= at for a in receiver.attempts) for at in killed_at)
    print(f"kills {kills} ({mid_delivery} mid-delivery); duplicates {sum(duplicates.values())} {duplicates};",
          "requests per receiver and outcome:", dict(sorted(faults.items())))  # fmt: skip
    assert set(seen) == _every("firing") | _every("resolved")
    assert sum(duplicates.values()) <= kills, duplicates
    last = {key: at for key, at in classified(receiver, MODELS)}  # the latest of each
    first = {key: at for key, at in reversed(classified(receiver, MODELS))}
    for sink in SINKS:  # a group's resolve never reaches a sink before its firing
        for model in MODELS:
            assert first[(sink, model, "firing")] < last[(sink, model, "resolved")], (sink, model)
