"""Demand from arrivals, and what a model's engines can serve: is a queue load, or a fault?

Request logs are written when a request *finishes*, so a window's request count is what
the engines served, not what asked to be served. Judged against that, a server that slows
down finishes fewer requests, measures less demand, and lowers its own expectation. So a
window also counts its requests by the window they *started* in (``timestamp - e2e_s``;
the ``arrived_<lag>`` columns of ``models.windows.window``), and a segment keeps the last few
windows' arrivals of its model as they fill in (``ARRIVAL_LAGS`` windows: a request that
takes longer than that is not counted as an arrival at all). Demand is the highest arrival
rate among them: a slow server cannot hide the requests that did arrive and did finish.

Capacity is the most the model's engines have served (requests and prompt tokens per
second, finished, smoothed over a few windows), forgetting slowly (``halflife`` windows).
When the engines serve as much as they ever have while arrivals are well above their usual
rate, demand exceeds what they can keep up with, and a queue that builds is explained by
load: the segment is *saturated*. Saturation holds while the engines keep serving near
their capacity (``held_share``) and latency stays up; it ends at the first normal window
(the queue drained). Served throughput that falls well below capacity is the opposite:
capacity lost, a fault, and it pages. So do engines at capacity at their *usual* demand
with latency up (a closed-loop load test at a fixed concurrency, whose arrivals are its
completions): nothing asked for more, so the queue is not load.

Arrivals of requests still waiting are invisible in request logs, so during a long queue
arrivals read low; that is why saturation is entered on a surge of arrivals and then held
on served throughput, not re-tested window by window.

>>> from servewatch.models.windows.window import WindowStats
>>> def window(start, served, arrived):
...     return WindowStats("model=m", float(start), 10.0, requests=served, prompt_tokens=1000 * served,
...                        model_requests=served, model_prompt_tokens=1000 * served,
...                        model_arrived_1=arrived, model_arrived_tokens_1=1000 * arrived)
>>> capacity = Capacity()
>>> for start in range(0, 400, 10):  # 5 requests/s, the engines at most 6/s
...     w = window(start, 60 if start == 200 else 50, 50)
...     load = w.load()
...     capacity.observe(w, load)
...     capacity.learn(load)
>>> load["model_arrivals_per_s"], round(load["capacity_requests_per_s"], 1), load["saturated"]
(5.0, 5.5, 0.0)
>>> for start in (400, 410):  # twice the usual arrivals, the engines flat out
...     w = window(start, 56, 100)
...     load = w.load()
...     capacity.observe(w, load)
>>> load["model_arrivals_per_s"], load["saturated"]
(10.0, 1.0)
"""

from __future__ import annotations

import math
from array import array
from typing import Any, NamedTuple

from servewatch.models.stats.compact import CompactState, count, number
from servewatch.models.stats.params import shared

#: Load figures this module adds to a window's ``load``.
ARRIVAL_FIGURES = ("model_arrivals_per_s", "model_arrival_prompt_tokens_per_s")
#: The served figures capacity is learned from (``WindowStats.load``), in the same order.
SERVED_FIGURES = ("model_requests_per_s", "model_prompt_tokens_per_s")

#: Windows back that a request's start is counted in (``arrived_<lag>`` of ``models.windows.window``):
#: 0 is this window. A request started earlier than that is not counted as an arrival.
ARRIVAL_LAGS = 4
_RING = 2 * ARRIVAL_LAGS  # arrivals (requests, prompt tokens) per window, latest first
#: Weight of the newest window in the smoothed busy slots: an exponential mean whose centre of
#: mass is that of the last ``ARRIVAL_LAGS`` windows (2 / (n + 1)).
RUNNING_SMOOTHING = 2.0 / (ARRIVAL_LAGS + 1)


class _Params(NamedTuple):
    halflife: float
    busy_share: float
    held_share: float
    warm_windows: int
    surge_ratio: float
    usual_halflife: float


class Capacity(CompactState):
    """A segment's view of its model's arrivals and capacity (``18`` doubles).

    Parameters
    ----------
    halflife
        Windows over which a capacity not reached again is forgotten (a day by default:
        an engine upgrade or a scale-down shows within a day, a quiet night does not).
    busy_share
        The engines are at capacity when what they serve (smoothed over a few windows) is at
        least this share of the most they have served.
    held_share
        Saturation holds while served throughput stays above this share of capacity.
    warm_windows
        Windows seen before capacity is trusted (before that, nothing is saturated).
    surge_ratio
        Saturation also needs arrivals this many times their usual rate: engines busy at
        the usual demand are not overloaded by it (a closed-loop load test, a fault).
    usual_halflife
        Windows over which the usual arrival rate forgets.
    """

    __slots__ = ()
    STATE_SIZE = 1 + _RING + 2 + 1 + 1 + 2 + 2 + 1 + 1
    ring_end = number(0)  # end of the latest window in the ring (-1e18: empty)
    capacity_requests_per_s = number(1 + _RING)
    capacity_prompt_tokens_per_s = number(2 + _RING)
    saturated = number(3 + _RING)  # 1.0 while saturated
    windows = count(4 + _RING)
    usual_arrivals_per_s = number(5 + _RING)  # EW mean of arrivals (requests, prompt tokens)
    usual_arrival_tokens_per_s = number(6 + _RING)
    served_requests_per_s = number(7 + _RING)  # served, smoothed over a few windows
    served_prompt_tokens_per_s = number(8 + _RING)
    most_running = number(9 + _RING)  # the most slots the model's engines kept busy (smoothed)
    # Slots busy, smoothed over a few windows (-1: none yet). A window's figure is Little's law
    # over the requests that *finished* in it, each counted with its whole service time: where
    # service takes about a window or more (long prompts, long answers), a window in which
    # several long requests end reads far above the slots there are, the next one far below.
    # Over four windows the figure follows the true busy slots (correlation 0.83 against 0.59
    # for one window on the Mooncake trace through slot-limited engines), and its most is the
    # most slots really held, so "as busy as ever" does not read low when long prompts hold them.
    running_smoothed = number(10 + _RING)

    def __init__(
        self,
        halflife: float = 8640.0,
        busy_share: float = 0.9,
        held_share: float = 0.6,
        warm_windows: int = 30,
        surge_ratio: float = 1.3,
        usual_halflife: float = 60.0,
    ) -> None:
        self._params = shared(
            _Params, float(halflife), float(busy_share), float(held_share), int(warm_windows), float(surge_ratio),
            float(usual_halflife),
        )  # fmt: skip
        self._own([-1e18, *[0.0] * _RING, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0])

    def _ring(self) -> list[float]:
        return self._buf[self._at + 1 : self._at + 1 + _RING].tolist()

    def observe(self, window: Any, load: dict[str, float]) -> None:
        """Add ``window``'s arrivals to the ring and write demand and capacity into ``load``:
        ``model_arrivals_per_s`` and ``model_arrival_prompt_tokens_per_s`` (the highest of the
        ring's windows; the served figures when the window says nothing of arrivals),
        ``capacity_requests_per_s``, ``capacity_prompt_tokens_per_s``, ``arrivals_vs_usual``
        (arrivals), ``served_vs_capacity``, ``running_vs_most`` (slots kept busy against the
        most ever, smoothed), ``running_now_vs_most`` (the same, this window alone),
        ``arrivals_seen_s`` (the seconds of starts the arrival figures cover), these five only
        once the capacity is known; and ``saturated`` (1.0 or 0.0)."""
        ring = self._ring()
        length = float(window.length)
        shift = round((window.end - self.ring_end) / length) if self.ring_end > -1e17 else ARRIVAL_LAGS
        if shift > 0:  # newer window: the ring moves on (pairs older than the ring fall out)
            ring = ([0.0, 0.0] * min(shift, ARRIVAL_LAGS) + ring)[:_RING]
            self.ring_end = window.end
        counts = getattr(window, "arrival_counts", None)
        arrived = counts() if counts is not None else None
        if arrived is not None and shift >= 0:  # windows come in order: an older one adds nothing
            for lag, (requests_then, tokens_then) in enumerate(arrived):
                ring[2 * lag] += requests_then
                ring[2 * lag + 1] += tokens_then
        self._buf[self._at + 1 : self._at + 1 + _RING] = array("d", ring)
        requests = max(ring[0::2]) / length
        tokens = max(ring[1::2]) / length
        served_now = [load.get(name, 0.0) for name in SERVED_FIGURES]
        if requests <= 0:  # no arrivals known (an engine's window, a series): what was served
            requests, tokens = served_now
        load["model_arrivals_per_s"], load["model_arrival_prompt_tokens_per_s"] = requests, tokens
        # Served, smoothed: one window's completions jump with the luck of when requests end.
        if self.windows == 0:
            self.served_requests_per_s, self.served_prompt_tokens_per_s = served_now
        else:
            self.served_requests_per_s += 0.5 * (served_now[0] - self.served_requests_per_s)
            self.served_prompt_tokens_per_s += 0.5 * (served_now[1] - self.served_prompt_tokens_per_s)
        served = (self.served_requests_per_s, self.served_prompt_tokens_per_s)
        capacity = (self.capacity_requests_per_s, self.capacity_prompt_tokens_per_s)
        p = self._params
        load["capacity_requests_per_s"], load["capacity_prompt_tokens_per_s"] = capacity
        known = self.windows >= p.warm_windows and capacity[0] > 0
        usual = (self.usual_arrivals_per_s, self.usual_arrival_tokens_per_s)
        surge = _ratio((requests, tokens), usual) if known else 0.0
        busy = _ratio(served, capacity) if known else 0.0
        if known:  # unknown is not zero: "0 % of the slots busy" would read as slots lost
            load["arrivals_vs_usual"], load["served_vs_capacity"] = round(surge, 4), round(busy, 4)
        running = load.get("model_running", 0.0)
        # An engine's running gauge is measured at its scrapes (``EngineWindow.running_measured``),
        # not Little's law over the requests that finished: nothing to smooth, and smoothing would
        # hide for windows the slots an engine just lost.
        if self.running_smoothed < 0 or getattr(window, "running_measured", False):
            self.running_smoothed = running
        else:
            self.running_smoothed += RUNNING_SMOOTHING * (running - self.running_smoothed)
        most = self.most_running
        if known and most > 0:
            load["running_vs_most"] = round(self.running_smoothed / most, 4)
            # The window's own figure beside it: a burst fills every slot in the window that
            # holds it, while slots lost show here before the smoothed figure lets go of the
            # full windows before (``models.explain.hints.slots_short_now``).
            load["running_now_vs_most"] = round(running / most, 4)
            load["arrivals_seen_s"] = ARRIVAL_LAGS * length  # how far back the arrivals figure sees
        if not known or busy < p.held_share:
            self.saturated = 0.0  # the engines serve less than they can: not load (any more)
        elif busy >= p.busy_share and surge >= p.surge_ratio:
            # The engines serve as much as they ever have while far more than usual asks: a
            # queue that builds now is load. Arrivals of requests still queued are not in the
            # logs, so it then holds on served throughput alone, until the queue drains.
            self.saturated = 1.0
        load["saturated"] = self.saturated

    def learn(self, load: dict[str, float]) -> None:
        """Capacity: the most served (smoothed), forgetting with ``halflife``; and the usual
        arrivals. Call for windows that did not page: a fault's throughput is not capacity."""
        p = self._params
        decay = 0.5 ** (1.0 / p.halflife)
        self.capacity_requests_per_s = max(self.capacity_requests_per_s * decay, self.served_requests_per_s)
        self.capacity_prompt_tokens_per_s = max(
            self.capacity_prompt_tokens_per_s * decay, self.served_prompt_tokens_per_s
        )
        self.most_running = max(self.most_running * decay, self.running_smoothed)
        if not self.saturated:  # a surge is not the usual demand
            alpha = max(1.0 - 0.5 ** (1.0 / p.usual_halflife), 1.0 / (self.windows + 1))
            arrivals = [load.get(name, 0.0) for name in ARRIVAL_FIGURES]
            self.usual_arrivals_per_s += alpha * (arrivals[0] - self.usual_arrivals_per_s)
            self.usual_arrival_tokens_per_s += alpha * (arrivals[1] - self.usual_arrival_tokens_per_s)
        self.windows += 1

    def borrow(self, other: Capacity) -> bool:
        """Take ``other``'s capacity, usual arrivals and served rate if this one does not know
        its own yet and ``other`` does (segments of one model share its engines). Returns
        whether it did."""
        warm = self._params.warm_windows
        if self.windows >= warm or other.windows < warm:
            return False
        mine, theirs = self.numbers, other.numbers
        mine[1 + _RING : 3 + _RING] = theirs[1 + _RING : 3 + _RING]
        mine[4 + _RING :] = theirs[4 + _RING :]
        self._set_numbers(0, mine)
        return True

    def settle(self) -> None:
        """A queue-sensitive signal was normal again: the queue drained, saturation ends."""
        self.saturated = 0.0

    def state(self) -> list[float]:
        return self.numbers

    def load_state(self, numbers: list[float]) -> None:
        if len(numbers) == self.STATE_SIZE - 1:  # stored before busy slots were smoothed
            numbers = [*numbers, -1.0]
        if len(numbers) != self.STATE_SIZE:
            raise ValueError(f"capacity state has {len(numbers)} numbers, expected {self.STATE_SIZE}")
        self._set_numbers(0, [float(v) for v in numbers])


def _ratio(now: tuple[float, ...], usual: tuple[float, float]) -> float:
    """Geometric mean of the ratios of two figures (requests, tokens) to their usual values;
    a figure with no usual value is left out."""
    logs = [math.log(max(a, 1e-9) / b) for a, b in zip(now, usual, strict=True) if b > 0]
    return math.exp(sum(logs) / len(logs)) if logs else 0.0
