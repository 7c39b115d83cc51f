"""``servewatch silence add`` as an on-call types it: a maintenance schedule recurs until it
is expired, and a matcher that cannot work is one line saying why."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from servewatch.pipeline.cli.main import main
from servewatch.pipeline.notify import silence_store
from servewatch.pipeline.notify.silences import state_of
from servewatch.schemas.silence import UNTIL_EXPIRED, Silence


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[Silence]:
    """The silences ``silence add`` would publish (no broker: this is about what it builds)."""
    kept: list[Silence] = []

    async def write(bootstrap: str, silence: Silence, auth: Any = None) -> None:
        kept.append(silence)

    monkeypatch.setattr(silence_store, "write_silence", write)
    return kept


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_a_weekly_maintenance_window_recurs_until_it_is_expired(written: list[Silence]) -> None:
    """Added on a Wednesday, the README's weekend window mutes the Saturday nights after it
    (it had ended two hours after it was added, and never applied)."""
    args = ["silence", "add", "model=llama-70b", "--daily", "22:00-02:00", "--weekdays", "sat,sun"]
    assert main([*args, "--start", "2026-12-02T10:00:00Z", "--broker", "kafka:9092"]) == 0
    (silence,) = written
    assert silence.ends_at == UNTIL_EXPIRED
    assert state_of(silence, at("2026-12-05T23:00:00")) == "active"  # that Saturday night
    assert state_of(silence, at("2027-06-05T23:30:00")) == "active"  # and months later
    assert state_of(silence, at("2026-12-07T23:00:00")) == "pending"  # a Monday


def test_a_window_with_a_duration_or_an_end_keeps_it(written: list[Silence]) -> None:
    start = "2026-12-02T10:00:00Z"
    base = ["silence", "add", "model=m", "--daily", "22:00-02:00", "--start", start, "--broker", "kafka:9092"]
    assert main([*base, "--duration", "7d"]) == 0 and main([*base, "--end", "2026-12-31T00:00:00Z"]) == 0
    assert [s.ends_at for s in written] == [at("2026-12-09T10:00:00"), at("2026-12-31T00:00:00")]
    assert main(["silence", "add", "model=m", "--start", start, "--broker", "kafka:9092"]) == 0
    assert written[-1].ends_at == at("2026-12-02T12:00:00")  # a plain silence: 2 hours


def test_a_regular_expression_that_does_not_compile_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["silence", "add", 'model=~"(llama', "--broker", "kafka:9092"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "not a regular expression" in errors[0] and "pydantic" not in errors[0], errors


def test_who_silenced_is_given_with_by_as_for_mark_or_with_author(written: list[Silence]) -> None:
    base = ["silence", "add", "model=m", "--duration", "1h", "--broker", "kafka:9092"]
    assert main([*base, "--by", "alice"]) == 0 and main([*base, "--author", "bob"]) == 0
    assert [silence.created_by for silence in written] == ["alice", "bob"]
