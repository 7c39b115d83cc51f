"""Delivery end to end on the real embedded broker: ``servewatch notify`` reads
incident groups from the anomaly topic and delivers them to real HTTP receivers on
127.0.0.1 that imitate Slack (webhook and bot), PagerDuty, Alertmanager and a signed
webhook, while those receivers answer 429 with Retry-After, 500, time out, and go down
for a while; the notifier is killed with SIGKILL twice, once mid-delivery. Every group's
firing and resolve reaches every sink exactly once, firing first; a silenced model's
groups reach no one and are recorded as silenced."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline import topics
from servewatch.pipeline.dev.demo import start_worker, stop_worker
from servewatch.pipeline.dev.receivers import Fault, LocalReceiver, Received
from servewatch.pipeline.kafka import ensure_topics, producer, read_topic
from servewatch.pipeline.notify.sinks.webhook import verify
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.delivery import Delivery
from servewatch.schemas.incident_group import IncidentGroup
from tests.conftest import Broker

pytestmark = pytest.mark.integration

MODELS = ("llama-70b", "qwen-32b", "mistral-7b")  # the last one is silenced
SECRET = "test-secret"


def config_yaml(urls: dict[str, str]) -> str:
    timing = "{group_wait: 500ms, group_interval: 1s, repeat_interval: 1h}"
    return f"""
defaults: {timing}
retry: {{initial: 200ms, max_wait: 1s, timeout: 1s, give_up_after: 10m}}
triage_url: "http://127.0.0.1:9/groups/{{group}}"
sinks:
  - {{name: chat, type: slack, url: "{urls["slack"]}", min_interval: 0, route: {{min_severity: info}}}}
  - {{name: chat-bot, type: slack_bot, token: xoxb-test, channel: "#oncall", api_url: "{urls["slack_api"]}",
     min_interval: 0, route: {{min_severity: info}}}}
  - {{name: pager, type: pagerduty, routing_key: "{"r" * 32}", url: "{urls["pagerduty"]}",
     route: {{min_severity: critical}}}}
  - {{name: am, type: alertmanager, url: "{urls["alertmanager"]}", timing: {timing}}}
  - {{name: hook, type: webhook, url: "{urls["webhook"]}", secret: {SECRET}, route: {{min_severity: info}}}}
"""


def incidents(model: str, status: str) -> list[AnomalyEvent]:
    """Two critical incidents of one cause on ``model`` (one group), firing or resolving."""
    return [
        AnomalyEvent(
            id=f"{model}:{route}:{status}",
            fingerprint=f"{model}:{route}",
            status=Status(status),
            transition=status,  # type: ignore[arg-type]
            signal=Signal.TTFT,
            segment={"model": model, "route": route},
            window_start=1000.0 + offset,
            window_end=1010.0 + offset + (100 if status == "resolved" else 0),
            observed=19.5,
            expected=2.1,
            score=9.0,
            severity=Severity.CRITICAL,
            load={"requests_per_s": 4.0},
            explained_by_load=False,
            hints=[Hint(code="prefix_cache_ineffective", message="hit rate 3 % against 91 % usual")],
            evidence=[
                {
                    "request_id": f"req-{route}-1",
                    "ttft_s": 19.8,
                    "prompt_tokens": 7100,
                    "sample": "slowest",
                    "excerpt": "<!channel> *click* <https://evil|here>",
                }
            ],
            summary=f"TTFT 9x expected on {model} {route}",
        )
        for offset, route in enumerate(("chat", "rag"))
    ]


async def produce(bootstrap: str, records: list[AnomalyEvent | IncidentGroup]) -> None:
    client = producer(bootstrap)
    await client.start()
    try:
        for record in records:
            model = record.model if isinstance(record, IncidentGroup) else record.segment["model"]
            await client.send_and_wait(topics.ANOMALIES, key=model.encode(), value=record.model_dump_json().encode())
    finally:
        await client.stop()


def grouped(grouper: IncidentGrouper, events: list[AnomalyEvent]) -> list[AnomalyEvent | IncidentGroup]:
    out: list[AnomalyEvent | IncidentGroup] = []
    for event in events:
        member, told = grouper.add(event)
        out += [member, *told]
    return out


async def receiving(bootstrap: str, tmp_path: Path) -> tuple[LocalReceiver, Path]:
    """The topics, a started receiver for every sink kind, and a notifier config pointing at it."""
    await ensure_topics(bootstrap, 4)
    receiver = LocalReceiver()
    await receiver.start()
    config = tmp_path / "notify.yaml"
    config.write_text(config_yaml(receiver.urls()))
    return receiver, config


def status_of(received: Received) -> tuple[str, str]:
    """(sink kind, group status) of one accepted request, from its payload."""
    body = received.body
    if received.kind == "pagerduty":
        return "pager", "firing" if body["event_action"] == "trigger" else "resolved"
    if received.kind == "webhook":
        return "hook", body["status"]
    if received.kind == "alertmanager":
        # Alertmanager has no status field: a resolved alert is one whose endsAt has passed.
        return "am", "resolved" if all(_past(a["endsAt"], received.at) for a in body) else "firing"
    text = orjson.dumps(body).decode().lower()
    kind = "chat-bot" if received.kind == "slack_api" else "chat"
    return kind, "resolved" if "resolved" in text else "firing"


def classified(receiver: LocalReceiver, models: tuple[str, ...]) -> list[tuple[tuple[str, str, str], float]]:
    """(sink, model, status) of every accepted request, with its arrival time, in order."""
    # A PagerDuty resolve carries only its dedup_key: the trigger with the same key names the model.
    pager_model = {r.body["dedup_key"]: r.body["payload"]["component"] for r in receiver.received
                   if r.kind == "pagerduty" and r.body["event_action"] == "trigger"}  # fmt: skip
    out = []
    for received in receiver.received:
        text = orjson.dumps(received.body).decode()
        model = next((m for m in models if m in text), "?")
        if received.kind == "pagerduty":
            model = pager_model.get(received.body["dedup_key"], "?")
        kind, status = status_of(received)
        out.append(((kind, model, status), received.at))
    return out


def by_sink_and_status(receiver: LocalReceiver, models: tuple[str, ...]) -> Counter[tuple[str, str, str]]:
    """How many accepted requests each (sink, model, status) had."""
    return Counter(key for key, _ in classified(receiver, models))


def _past(rfc3339: str, at: float) -> bool:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp() <= at


async def until(condition: Callable[[], bool], timeout_s: float, what: str, seen: Callable[[], object] = str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; have {seen()}")
        await asyncio.sleep(0.2)


def sigkill(process: subprocess.Popen[bytes]) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


async def test_every_group_reaches_every_sink_exactly_once_through_faults_silences_and_kills(
    broker: Broker, tmp_path: Path
) -> None:
    bootstrap = broker.bootstrap
    receiver, config = await receiving(bootstrap, tmp_path)
    env = {"SERVEWATCH_APP_ID": f"notify-test-{uuid.uuid4().hex[:8]}", "SERVEWATCH_LOG_LEVEL": "INFO",
           "SERVEWATCH_NOTIFY_CONFIG": str(config)}  # fmt: skip
    check = subprocess.run([sys.executable, "-m", "servewatch", "check-config", str(config)], capture_output=True,
                           text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr
    silence = subprocess.run([sys.executable, "-m", "servewatch", "silence", "add", f"model={MODELS[2]}",
                              "--duration", "1h", "--comment", "maintenance", "--broker", bootstrap],
                             capture_output=True, text=True)  # fmt: skip
    assert silence.returncode == 0, silence.stderr
    grouper = IncidentGrouper()
    live = MODELS[:2]
    notifier = start_worker(bootstrap, env, command=("notify",))
    try:
        # Firing, through a receiver that refuses and fails first.
        receiver.inject("slack", Fault.status(429, retry_after=1), Fault.status(429, retry_after=1))
        receiver.inject("pagerduty", Fault.status(500), Fault.status(502), Fault.status(503))
        receiver.inject("webhook", Fault.delay(2.5))  # longer than the sink's 1 s timeout
        receiver.down("alertmanager", 12.0)  # past the notifier's start (~5 s): its first attempts fail
        await produce(bootstrap, [r for m in MODELS for r in grouped(grouper, incidents(m, "firing"))])
        wanted_firing = {(sink, model, "firing") for sink in ("chat", "chat-bot", "pager", "am", "hook")
                         for model in live}  # fmt: skip
        await until(lambda: wanted_firing <= set(by_sink_and_status(receiver, MODELS)), 90, "every firing")
        await recorded(bootstrap, wanted_firing)
        sigkill(notifier)  # right after the firings went out: its offsets are not all committed
        notifier = start_worker(bootstrap, env, command=("notify",))

        # Resolve while Alertmanager is down; kill the notifier while it retries, restart it.
        receiver.down("alertmanager", 600.0)
        await produce(bootstrap, [r for m in MODELS for r in grouped(grouper, incidents(m, "resolved"))])
        others = {(sink, model, "resolved") for sink in ("chat", "chat-bot", "pager", "hook") for model in live}
        await until(
            lambda: others <= set(by_sink_and_status(receiver, MODELS)),
            90,
            "the resolves but one",
            lambda: by_sink_and_status(receiver, MODELS),
        )
        await recorded(bootstrap, others)
        await until(lambda: any(a.kind == "alertmanager" and a.fault == "down" and a.at > time.time() - 1.5
                                for a in receiver.attempts), 30, "a retry to the downed receiver")  # fmt: skip
        sigkill(notifier)
        receiver.down("alertmanager", 0)
        notifier = start_worker(bootstrap, env, command=("notify",))
        await until(lambda: ("am", live[0], "resolved") in by_sink_and_status(receiver, MODELS)
                    and ("am", live[1], "resolved") in by_sink_and_status(receiver, MODELS), 90,
                    "Alertmanager's resolves")  # fmt: skip
        await asyncio.sleep(4.0)  # anything sent twice would come now
    finally:
        stop_worker(notifier)
        await receiver.stop()

    seen = by_sink_and_status(receiver, MODELS)
    faults = Counter((a.kind, a.fault or "accepted") for a in receiver.attempts)
    print("requests per receiver and outcome:", dict(sorted(faults.items())))  # shown with -s: the closing note's
    expected = {(sink, model, status): 1 for sink in ("chat", "chat-bot", "pager", "am", "hook") for model in live
                for status in ("firing", "resolved")}  # fmt: skip
    assert dict(seen) == expected  # exactly once each; nothing about the silenced model
    order = [(status_of(r), r.at) for r in receiver.received]
    for sink in ("chat", "pager", "hook"):
        times = {s: max(at for (k, s2), at in order if k == sink and s2 == s) for s in ("firing", "resolved")}
        assert times["firing"] < times["resolved"]
    for hooked in (r for r in receiver.received if r.kind == "webhook"):
        stamp, signature = hooked.headers["x-servewatch-timestamp"], hooked.headers["x-servewatch-signature"]
        assert verify(SECRET.encode(), int(stamp), hooked.raw, signature, now=float(stamp))
    slack = [orjson.dumps(r.body).decode() for r in receiver.received if r.kind.startswith("slack")]
    assert slack and not [text for text in slack if "<!channel>" in text]

    deliveries: list[Delivery] = []
    await read_deliveries(bootstrap, deliveries, lambda read: any(d.model == MODELS[2] for d in read), 60.0)
    silenced = {(d.sink, d.model) for d in deliveries if d.outcome == "silenced"}
    assert {model for _, model in silenced} == {MODELS[2]}
    assert not [d for d in deliveries if d.outcome == "sent" and d.model == MODELS[2]]


async def recorded(bootstrap: str, wanted: set[tuple[str, str, str]], timeout_s: float = 30.0) -> None:
    """Wait until the notifier reported each (sink, model, status) as sent: it reports a delivery
    only once it is booked in its state table, which is the promise a restart keeps. (A kill
    between a receiver's answer and that booking, a few milliseconds, resends one message.)"""

    def sent(read: list[Delivery]) -> set[tuple[str, str, str]]:
        return {(d.sink, d.model, d.status.value) for d in read if d.outcome == "sent"}

    read: list[Delivery] = []
    try:
        await read_deliveries(bootstrap, read, lambda so_far: wanted <= sent(so_far), timeout_s, quiet_s=0.0)
    except TimeoutError:
        missing = sorted(wanted - sent(read))
        raise AssertionError(f"no 'sent' Delivery record within {timeout_s:.0f} s for {missing}") from None


async def read_deliveries(
    bootstrap: str, read: list[Delivery], enough: Callable[[list[Delivery]], bool], timeout_s: float,
    quiet_s: float = 2.0,
) -> None:  # fmt: skip
    """Append the notifications topic's records to ``read`` until ``enough(read)`` holds
    (``TimeoutError`` after ``timeout_s``: a hang bound only), then until none comes for
    ``quiet_s``, so that a record after them (one that should not be there) is read too.
    Quiet is not waited for from the start: a reader slow to start would take its own
    start-up for the end of the topic."""

    async def scan() -> None:
        async for raw in read_topic(bootstrap, topics.NOTIFICATIONS):
            read.append(Delivery.model_validate_json(raw))

    scanning = asyncio.create_task(scan())
    try:
        deadline = time.monotonic() + timeout_s
        while not enough(read):
            if scanning.done():
                scanning.result()  # the reader failed: its error, not a timeout
            if time.monotonic() >= deadline:
                raise TimeoutError
            await asyncio.sleep(0.2)
        seen = -1
        while seen != len(read):
            seen = len(read)
            await asyncio.sleep(quiet_s)
    finally:
        scanning.cancel()
        await asyncio.gather(scanning, return_exceptions=True)
