"""``BrokerWatch``: the worker's waits start over while the broker does not answer, and
once more when it is heard from again."""

from __future__ import annotations

import pytest

from servewatch.pipeline.worker.broker_watch import BrokerWatch


class Broker:
    def __init__(self) -> None:
        self.up = True
        self.asked = 0

    async def answers(self) -> bool:
        self.asked += 1
        return self.up


async def test_waits_restart_at_every_unanswered_question_and_when_the_broker_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker, restarts = Broker(), []
    watch = BrokerWatch(broker.answers, lambda: restarts.append(broker.asked))
    assert await watch.answers() and restarts == []  # answering: silence is idleness
    broker.up = False
    assert [await watch.answers() for _ in range(3)] == [False] * 3
    assert restarts == [2, 3, 4] and watch.silent
    watch.heard()  # a message came: the broker is back, the waits count from now
    assert restarts == [2, 3, 4, 4] and not watch.silent
    broker.up = True
    assert await watch.answers() and restarts == [2, 3, 4, 4]
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "the broker does not answer: quiet partitions are held, not taken as idle",
        "the broker answers again: quiet partitions are idle again",
    ]  # once each, not at every question


async def test_a_probe_answered_after_a_silence_ends_it() -> None:
    broker, restarts = Broker(), []
    watch = BrokerWatch(broker.answers, lambda: restarts.append(broker.asked))
    broker.up = False
    await watch.answers()
    broker.up = True
    assert await watch.answers() and not watch.silent and restarts == [1, 2]
