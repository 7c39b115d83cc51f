"""The learned lateness against bursts of stragglers, through stage 1 and 2 as the worker
and ``servewatch replay`` run them: a batch of old records is counted late and does not hold
everyone's windows back for long, while a host steadily behind is still waited for.

Everything is measured in event time: the *judged delay* of a window is how far the
stream's newest event time was past the window's end when the window was judged."""

from __future__ import annotations

import math
import statistics

import numpy as np
import orjson

from servewatch.models.windows.lateness import LearnedLateness
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.pipeline.settings import Settings
from servewatch.schemas.request_log import RequestLogRow
from tests.test_event_time import T0, log

#: Records per second from each live host.
RATE = 20
#: Live hosts on time, flushing every second in turn (Fluent Bit's default): records arrive
#: up to half a second out of order.
HOSTS = 2


class Stream:
    """One partition of live traffic fed to a replay message by message, with the judged
    delay of every window and the records sent."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.replay = Replay(settings or Settings())
        self.sent = 0
        self.offset = 0
        self.judged: list[tuple[float, float]] = []  # (event time judged, delay), per window
        self._released = -math.inf

    def ship(self, rows: list[RequestLogRow]) -> None:
        self.sent += len(rows)
        self.replay.feed(orjson.dumps(rows), self.offset)
        self.offset += 1
        released = self.replay.stage_two.assembler.released_until.get(0, -math.inf)
        if released > self._released:
            newest = max(self.replay.stage_one.windower.max_event_time.values())
            first = released if math.isinf(self._released) else self._released + 10.0
            for end in np.arange(first, released + 1.0, 10.0).tolist():
                self.judged.append((newest - T0, newest - end))
            self._released = released

    def live(self, seconds: range, behind: tuple[float, ...] = ()) -> None:
        """``seconds`` of traffic from the on-time hosts, and one more host per ``behind``
        (seconds its records are behind), each flushing its last second every second."""
        lags = [0.0] * HOSTS + list(behind)
        for second in seconds:
            for host, lag in enumerate(lags):
                flush = T0 + second + host / len(lags)
                self.ship([log(f"h{host}-{second}-{i}", flush - lag - 1 + (i + 0.5) / RATE, model=f"m{host}")
                           for i in range(RATE)])  # fmt: skip

    def accounted(self) -> bool:
        """Judge what is still open (the stream ended): every record sent is judged or late."""
        self.replay.finish()
        two = self.replay.stage_two
        return two.judged_records + two.late_records == self.sent

    @property
    def late(self) -> int:
        return self.replay.stage_two.late_records

    def usual_delay(self, since: float, until: float) -> float:
        return statistics.median(delay for at, delay in self.judged if since <= at < until)

    def worst_delay(self, since: float, until: float = math.inf) -> float:
        return max(delay for at, delay in self.judged if since <= at < until)


def old_batch(prefix: str, records: int, newest: float, span_s: float = 10.0) -> list[RequestLogRow]:
    return [log(f"{prefix}{i}", newest - span_s + span_s * i / records) for i in range(records)]


def test_records_older_than_the_cap_are_counted_late_and_hold_nothing_back() -> None:
    """2,000 records ten minutes old, shipped in four 500-record messages (``servewatch ship
    --no-follow`` of a finished file) during live traffic: each is counted late, and the
    windows judged after them are judged as soon as before."""
    stream = Stream()
    stream.live(range(720))  # the prior fades in a few minutes: the usual delay by then
    assert stream.late == 0
    usual = stream.usual_delay(600, 720)
    batch = old_batch("old", 2000, T0 + 720 - 600)
    for start in range(0, len(batch), 500):
        stream.ship(batch[start : start + 500])
    stream.live(range(720, 960))
    assert stream.late == 2000
    assert stream.worst_delay(720 + 120) <= usual + 1.0  # back to usual within 2 minutes
    assert stream.worst_delay(720) <= 10.0  # nothing waited for a cap-sized lateness
    assert stream.accounted()


def test_a_one_off_batch_a_minute_old_does_not_stretch_the_wait() -> None:
    """One host flushes 300 records a minute old once, in six messages: they are late (their
    windows were judged long ago), and the wait is back to usual within two minutes.

    Every message is folded on its own, as the worker does when its half-second fold timer
    beats the traffic: each of the six reopens the same old windows, which close again at
    once, and that is still one burst, not six windows of stragglers."""
    stream = Stream(Settings(fold_records=1))
    stream.live(range(600))
    usual = stream.usual_delay(480, 600)
    batch = old_batch("straggler", 300, T0 + 600 - 60)
    for start in range(0, len(batch), 50):
        stream.ship(batch[start : start + 50])
    stream.live(range(600, 840))
    assert stream.late == 300
    assert stream.worst_delay(600 + 120) <= usual + 1.0


def test_a_host_steadily_30_s_behind_is_waited_for_after_a_learning_period() -> None:
    """A host 30 s behind joins the live ones (a third of the records, every window): a few
    windows of its records are late while that is learned, none after."""
    stream = Stream()
    stream.live(range(360))
    stream.live(range(360, 480), behind=(30.0,))
    learning = stream.late
    assert 0 < learning <= 120 * RATE  # at most its first two minutes
    stream.live(range(480, 900), behind=(30.0,))
    assert stream.late == learning  # waited for: none of its later records is late
    assert 30.0 <= stream.usual_delay(780, 900) <= 40.0
    assert stream.accounted()


def test_a_host_behind_by_more_than_the_cap_is_not_learned() -> None:
    """Nobody waits longer than the cap, so records further behind teach nothing: they are
    late whatever the wait, and holding every window back for them would buy nothing."""
    lateness = LearnedLateness(floor_s=1.0, cap_s=120.0, prior_s=10.0)
    rng = np.random.default_rng(3)
    for _ in range(60):
        lateness.observe(np.where(rng.random(1000) < 0.33, 200.0, 0.0) + rng.random(1000))
        lateness.window_closed()
    assert lateness.value < 1.1
