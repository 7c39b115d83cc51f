"""The notifier without a broker: records in, retries, outcomes booked, restarts that never resend."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.notify import state as state_module
from servewatch.pipeline.notify.config import NotifyConfig, parse_config
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.notifier import Notifier, Storage
from servewatch.pipeline.notify.sinks.base import RejectedError, RetryableError
from servewatch.pipeline.notify.state import ModelState
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.delivery import Delivery
from servewatch.schemas.silence import Matcher, Silence

CONFIG = parse_config(
    """
defaults: {group_wait: 0s, group_interval: 0s, repeat_interval: 1h}
retry: {initial: 10ms, max_wait: 20ms, give_up_after: 1s}
sinks:
  - {name: flaky, type: webhook, url: "http://127.0.0.1:9/x", route: {min_severity: info}}
  - {name: steady, type: webhook, url: "http://127.0.0.1:9/y", route: {min_severity: info}}
""",
    ".yaml",
    environ={},
)


class ScriptedSink:
    """Raises the scripted errors in turn, then accepts; remembers what it accepted."""

    type = "webhook"

    def __init__(self, name: str, script: list[Exception] | None = None) -> None:
        self.name = name
        self.script = list(script or [])
        self.accepted: list[tuple[str, str, int]] = []

    async def send(self, note: Notification) -> dict[str, str]:
        if self.script:
            raise self.script.pop(0)
        self.accepted.append((note.key, note.status.value, note.seq))
        return {}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counted(sink: str, outcome: str) -> float:
    return REGISTRY.get_sample_value("servewatch_notifications_total", {"sink": sink, "outcome": outcome}) or 0.0


def events() -> list[AnomalyEvent]:
    def one(status: str, transition: str, end: float) -> AnomalyEvent:
        return AnomalyEvent(
            id=f"a:{transition}", fingerprint="a", status=Status(status), transition=transition,  # type: ignore[arg-type]
            signal=Signal.TTFT, segment={"model": "m", "route": "chat"}, window_start=end - 10, window_end=end,
            observed=20.0, expected=2.0, score=8.0, severity=Severity.CRITICAL, load={}, explained_by_load=False,
            hints=[Hint(code="prefix_cache_ineffective", message="hit rate fell")], summary="TTFT 10x",
        )  # fmt: skip

    return [one("firing", "firing", 10.0), one("resolved", "resolved", 60.0)]


class Rig:
    def __init__(
        self, sinks: list[ScriptedSink], table: dict[str, bytes], config: NotifyConfig = CONFIG, *, reports: bool = True
    ) -> None:
        """``reports=False``: the notifications topic refuses every record (a process about to die)."""
        self.table = table
        self.deliveries: list[Delivery] = []
        self.letters: list[DeadLetter] = []
        self.clock = Clock()

        async def publish(delivery: Delivery) -> None:
            if not reports:
                raise ConnectionError("the broker is gone")
            self.deliveries.append(delivery)

        async def letter(dead: DeadLetter) -> None:
            self.letters.append(dead)

        storage = Storage(load=table.get, save=table.__setitem__, keys=lambda: list(table))
        self.notifier = Notifier(config, sinks, storage, publish_delivery=publish, dead_letter=letter,  # type: ignore[arg-type]
                                 clock=self.clock)  # fmt: skip

    async def run_until_idle(self, ticks: int = 50) -> None:
        tasks = [asyncio.create_task(r.run()) for r in self.notifier.runners.values()]
        try:
            for _ in range(ticks):
                await self.notifier.tick()
                await asyncio.sleep(0.02)
                self.clock.now += 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def feed(notifier: Notifier, records: list[AnomalyEvent], grouper: IncidentGrouper | None = None) -> None:
    grouper = IncidentGrouper() if grouper is None else grouper  # (an empty grouper is falsy)
    for event in records:
        grouped, told = grouper.add(event)
        for record in (grouped, *told):
            await notifier.receive(record)


async def test_retries_reach_the_receiver_once_firing_then_resolved_and_one_sink_never_waits_for_another() -> None:
    flaky = ScriptedSink("flaky", [RetryableError("HTTP 429", retry_after=0.05), RetryableError("HTTP 500")])
    steady = ScriptedSink("steady")
    rig = Rig([flaky, steady], {})
    retried_before = counted("flaky", "retried")
    grouper = IncidentGrouper()
    firing, resolved = events()
    await feed(rig.notifier, [firing], grouper)
    await rig.run_until_idle(ticks=10)
    await feed(rig.notifier, [resolved], grouper)
    await rig.run_until_idle(ticks=10)
    for sink in (flaky, steady):
        assert [(status, seq) for _, status, seq in sink.accepted] == [("firing", 1), ("resolved", 2)]
    sent = [(d.sink, d.status.value, d.attempts) for d in rig.deliveries]
    assert ("flaky", "firing", 3) in sent and ("steady", "firing", 1) in sent
    assert rig.letters == []
    assert counted("flaky", "retried") - retried_before == 2  # servewatch_notifications_total{outcome="retried"}


async def test_a_rejected_payload_is_dead_lettered_with_the_answer_and_not_retried() -> None:
    flaky = ScriptedSink("flaky", [RejectedError("HTTP 400: invalid payload", 400, "invalid payload")])
    rig = Rig([flaky, ScriptedSink("steady")], {})
    await feed(rig.notifier, events()[:1])
    await rig.run_until_idle(ticks=10)
    assert flaky.accepted == []
    assert [(letter.reason, "invalid payload" in letter.error) for letter in rig.letters] == [("notify_rejected", True)]
    assert [d.outcome for d in rig.deliveries if d.sink == "flaky"] == ["rejected"]


async def test_a_silenced_group_is_recorded_as_silenced_once_and_sent_nowhere() -> None:
    sinks = [ScriptedSink("flaky"), ScriptedSink("steady")]
    rig = Rig(sinks, {})
    rig.notifier.silences.apply(Silence(id="maint", matchers=[Matcher(name="route", value="chat")], starts_at=0,
                                        ends_at=10_000))  # fmt: skip
    await feed(rig.notifier, events()[:1])
    await rig.run_until_idle(ticks=10)
    assert [s.accepted for s in sinks] == [[], []]
    assert {(d.sink, d.outcome, d.silence) for d in rig.deliveries} == {("flaky", "silenced", "maint"),
                                                                       ("steady", "silenced", "maint")}  # fmt: skip


async def test_a_restarted_notifier_with_the_same_table_sends_nothing_twice() -> None:
    table: dict[str, bytes] = {}
    first = [ScriptedSink("flaky"), ScriptedSink("steady")]
    rig = Rig(first, table)
    records = events()
    await feed(rig.notifier, records[:1])
    await rig.run_until_idle(ticks=5)
    assert [len(s.accepted) for s in first] == [1, 1]
    # A new process: same table; Faust replays the records since the last commit, then the rest.
    second = [ScriptedSink("flaky"), ScriptedSink("steady")]
    again = Rig(second, table)
    await feed(again.notifier, records)
    await again.run_until_idle(ticks=5)
    assert [[status for _, status, _ in s.accepted] for s in second] == [["resolved"], ["resolved"]]
    assert [seq for _, _, seq in second[0].accepted] == [2]


async def test_an_outcome_booked_but_not_yet_reported_is_reported_after_a_restart_and_not_sent_again() -> None:
    table: dict[str, bytes] = {}
    first = [ScriptedSink("flaky"), ScriptedSink("steady")]
    dying = Rig(first, table, reports=False)  # sends and books, then dies before its reports are out
    await feed(dying.notifier, events()[:1])
    await dying.run_until_idle(ticks=5)
    assert [len(s.accepted) for s in first] == [1, 1] and dying.deliveries == []
    second = [ScriptedSink("flaky"), ScriptedSink("steady")]
    again = Rig(second, table)
    await feed(again.notifier, events()[:1])  # Faust replays what was not committed
    await again.run_until_idle(ticks=3)
    assert [s.accepted for s in second] == [[], []]
    assert sorted((d.sink, d.status.value, d.outcome) for d in again.deliveries) == [
        ("flaky", "firing", "sent"), ("steady", "firing", "sent")]  # fmt: skip
    assert b'"unreported":[]' in table["m"]


async def test_outcomes_a_refusing_notifications_topic_leaves_unreported_are_bounded_and_the_dropped_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(state_module, "MAX_UNREPORTED", 3)
    dropped_before = REGISTRY.get_sample_value("servewatch_notify_reports_dropped_total") or 0.0
    table: dict[str, bytes] = {}
    sinks = [ScriptedSink("flaky"), ScriptedSink("steady")]
    rig = Rig(sinks, table, reports=False)
    for record in events():  # firing, then resolved, to two sinks: four outcomes
        await feed(rig.notifier, [record])
        await rig.run_until_idle(ticks=5)
    assert [len(s.accepted) for s in sinks] == [2, 2]
    state = ModelState.model_validate_json(table["m"])
    assert [(d.sink, d.status.value) for d in state.unreported] == [
        ("steady", "firing"), ("flaky", "resolved"), ("steady", "resolved")]  # fmt: skip
    assert (REGISTRY.get_sample_value("servewatch_notify_reports_dropped_total") or 0.0) - dropped_before == 1
