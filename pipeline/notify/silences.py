"""Which silence, if any, mutes a group now. Pure, with the clock passed in.

``SilenceBook`` holds the latest record of every silence id as read from the silences
topic (a compacted topic: the newest record of an id wins, so an expired silence is the
same id written again with ``ends_at`` = the moment it was expired).

>>> from servewatch.schemas.silence import Matcher, Recurrence, Silence
>>> book = SilenceBook()
>>> book.apply(Silence(id="s1", matchers=[Matcher(name="model", value="llama")], starts_at=0, ends_at=100))
>>> book.muting({"model": {"llama"}}, now=50).id, book.muting({"model": {"llama"}}, now=150)
('s1', None)
>>> nightly = Silence(id="s2", matchers=[Matcher(name="model", value="m")], starts_at=0, ends_at=1e10,
...                   recurrence=Recurrence(weekdays=["thu"], start="23:00", end="01:00"))
>>> active(nightly, 0.0), active(nightly, 3600.0), active(nightly, 7200.0)  # 1970-01-01 was a Thursday
(False, False, False)
>>> active(nightly, 23.5 * 3600), active(nightly, 24.5 * 3600), active(nightly, 25.5 * 3600)
(True, True, False)
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from servewatch.pipeline.notify.routing import Labels, matches
from servewatch.schemas.silence import Silence

_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def _minutes(hhmm: str) -> int:
    hours, minutes = hhmm.split(":")
    return int(hours) * 60 + int(minutes)


def active(silence: Silence, now: float) -> bool:
    """Whether ``silence`` is in force at ``now`` (Unix seconds)."""
    if not silence.starts_at <= now < silence.ends_at:
        return False
    if silence.recurrence is None:
        return True
    rule = silence.recurrence
    when = datetime.fromtimestamp(now, UTC)
    minute = when.hour * 60 + when.minute
    start, end = _minutes(rule.start), _minutes(rule.end)
    today = _WEEKDAYS[when.weekday()] in rule.weekdays
    if start < end:
        return today and start <= minute < end
    # The span crosses midnight: tonight's part belongs to today, this morning's to yesterday.
    yesterday = _WEEKDAYS[(when - timedelta(days=1)).weekday()] in rule.weekdays
    return (today and minute >= start) or (yesterday and minute < end)


def state_of(silence: Silence, now: float) -> str:
    """``active``, ``pending`` (not started, or between recurrences) or ``expired``."""
    if now >= silence.ends_at:
        return "expired"
    return "active" if active(silence, now) else "pending"


class SilenceBook:
    def __init__(self) -> None:
        self._by_id: dict[str, Silence] = {}

    def apply(self, silence: Silence) -> None:
        self._by_id[silence.id] = silence

    def get(self, silence_id: str) -> Silence | None:
        return self._by_id.get(silence_id)

    def all(self) -> list[Silence]:
        return sorted(self._by_id.values(), key=lambda s: (s.starts_at, s.id))

    def muting(self, labels: Labels, now: float) -> Silence | None:
        """The first silence in force at ``now`` whose matchers all hold for ``labels``."""
        for silence in self.all():
            if active(silence, now) and all(matches(m, labels) for m in silence.matchers):
                return silence
        return None
