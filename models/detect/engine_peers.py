"""From scrapes alone: each engine against the other engines of its model.

A fleet that ships no request logs still scrapes every replica's ``/metrics``: each scrape
target is an instance. Intervals come one engine at a time and scrapers are not in step,
so an engine's interval is compared with each peer's latest one that ended within
``peer_horizon_s`` of it: its mean inter-token latency and its prefill seconds per prompt
token the prefix cache did not serve (the prefill histogram's mean over the uncached prompt
tokens per request of the same finished requests, ``_uncached_per_request``: prompt lengths
and a cold cache taken out; the model's fixed cost per request counted as that many tokens'
worth, ``models.stats.prefill_cost``, as every engine is read at once: else an interval of
short prompts reads slow) on the log scale against the median of its peers', and its
failed requests and preemptions per request against their rates.

Scrapes carry no per-request spread, and an interval's mean moves with the few requests
it holds (a 30k-token prompt in one engine's interval and not in its peers'), besides the
small differences replicas always have. So the spread is *learned*, per request and
robustly: each difference is put on the scale of one request (times the square root of
``1/n + (pi/2)/n_peers``, the requests behind the engine's mean and its peers' median), and
the spread is the 90th percentile of the model's engines' recent ones over the normal
curve's (1.645): a percentile, so that a minority of bad replicas moves it little (and an
engine an incident names adds nothing to it: ``InstanceState.names``), and the 90th rather
than the median, as ``models.detect.replicas.Calibration`` reads its own, because
intervals' differences have heavy tails (one interval of long prompts is prefilled slower per
token than the pooled prompt lengths say). An interval of 8 requests is then judged with the
error 8 requests have, not the error of a busy interval's 60; never below
``MIN_STANDARD_ERROR``. Until enough were seen, nothing is judged.
Evidence then accumulates as in ``models.detect.replicas`` (``models.detect.peer_incidents``).

One interval pages alone only with critical evidence over the same stretch of time. Judged
on arrival, an interval meets its peers' latest, which end up to a scrape period earlier:
a fleet-wide change is in it and not yet in theirs. So a critical difference is held
(``_Held``) until every peer it was compared with has an interval ending after it (or the
engine's own next interval comes), and judged again against each peer's intervals weighted
by how much of its span they cover (``_over``). What is still critical pages alone; what is
not counts as any other interval, half the bar at most.

>>> from servewatch.models.windows.engine_window import EngineWindow
>>> from servewatch.schemas.engine_interval import LatencySummary
>>> peers = EnginePeers(DetectorConfig())
>>> def interval(k, t, itl):
...     return EngineWindow(key=f"10.0.0.{k}:8000|m", labels={"model": "m", "instance": f"10.0.0.{k}:8000"},
...         start=t - 10, end=t + k * 0.5, requests=20, prompt_tokens_per_s=0, output_tokens_per_s=0, running=4,
...         waiting=0, kv_cache_usage=0.3, cache_hit_rate=0.5, preempted=0,
...         latency={"itl": LatencySummary(count=2000, mean_s=itl)})
>>> events = []
>>> for t in range(0, 900, 10):
...     for k in range(4):
...         events += peers.observe(interval(k, float(t), 0.05 if k == 2 and t >= 600 else 0.02 * (1 + 0.02 * k)))
>>> [(e.segment["instance"], e.signal.value, e.hints[0].code) for e in events][:1]
[('10.0.0.2:8000', 'itl', 'replica_outlier')]
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servewatch.models.detect.peer_incidents import (
    LN10,
    InstanceState,
    PeerIncidents,
    count_step,
    ratio_point,
    restored_instances,
    tail_spread,
)
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.stats.prefill_cost import PrefillCost
from servewatch.models.windows.engine_window import EngineWindow
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.series import SeriesPoint

#: Latency signals compared across engines, the histogram each reads, and how a ratio is said.
WORDS = {
    Signal.ITL: "decodes {ratio:.1f}x slower per output token",
    Signal.PREFILL_PER_TOKEN: "prefills {ratio:.1f}x slower per uncached prompt token",
    Signal.ERROR_RATE: "fails {ratio:.1f}x as many requests",
    Signal.PREEMPTIONS: "preempts {ratio:.1f}x as many requests",
}
#: Requests an interval's histogram must count for its mean to be compared. A quiet engine
#: (a request every few seconds) finishes three or four in an interval, and skipping those
#: delays its first slowed interval by one; the mean of one or two is their own tail, wider
#: than the learned per-request spread allows for (a healthy fleet scaling out paged on it).
MIN_COUNT = 3
MIN_STANDARD_ERROR = 0.05
#: The learned spread is over the latest ``SPREAD_MEMORY`` differences (a few minutes of a
#: model's engines); no engine is judged before ``SPREAD_SEEN`` were seen.
SPREAD_SEEN = 30
SPREAD_MEMORY = 300
#: Events per finished request assumed of the peers at least (a replica's few among peers
#: that had none are not "infinitely" more), and the multiple of the peers' rate tested for.
MIN_PEER_RATE = {Signal.ERROR_RATE: 1e-3, Signal.PREEMPTIONS: 0.01}
COUNT_ALTERNATIVE = 10.0


@dataclass(slots=True)
class _Latest:
    start: float
    end: float
    logs: dict[Signal, tuple[float, float]]  # signal -> (log of the interval's mean seconds, requests behind it)
    requests: float
    counts: dict[Signal, float]  # errors and preemptions in the interval
    before: _Latest | None = None  # the engine's interval before this one (its own ``before`` dropped)
    prefill: tuple[float, float, float] | None = None  # mean prefill seconds, uncached tokens, requests

    def log(self, signal: Signal, overhead: float) -> tuple[float, float] | None:
        """The interval's log mean of ``signal`` and the requests behind it; prefill per
        uncached token read with the model's fixed cost of ``overhead`` tokens, which every
        engine compared is read with at once."""
        if signal is Signal.PREFILL_PER_TOKEN and self.prefill is not None:
            mean_s, uncached, requests = self.prefill
            return math.log(mean_s / (uncached + overhead)), requests
        return self.logs.get(signal)

    def all_logs(self, overhead: float) -> dict[Signal, tuple[float, float]]:
        found = dict(self.logs)
        prefill = self.log(Signal.PREFILL_PER_TOKEN, overhead)
        if prefill is not None:
            found[Signal.PREFILL_PER_TOKEN] = prefill
        return found


@dataclass(slots=True)
class _Held:
    """An engine's interval whose difference from its peers was critical for ``logs``' signals,
    waiting for each of ``peers`` to report an interval ending after it."""

    start: float
    end: float
    logs: dict[Signal, tuple[float, float]]
    peers: frozenset[str]
    load: dict[str, float]
    overhead: float = 0.0  # the prefill fixed cost ``logs`` were read with, in tokens; the peers' are too

    def state(self) -> dict[str, Any]:
        return {"start": self.start, "end": self.end, "logs": {s.value: list(v) for s, v in self.logs.items()},
                "peers": sorted(self.peers), "load": self.load, "overhead": self.overhead}  # fmt: skip

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> _Held:
        logs = {Signal(signal): (float(log), float(n)) for signal, (log, n) in saved["logs"].items()}
        load = {str(k): float(v) for k, v in saved["load"].items()}
        peers = frozenset(map(str, saved["peers"]))
        return cls(float(saved["start"]), float(saved["end"]), logs, peers, load, float(saved.get("overhead", 0.0)))


def _over(peer: _Latest, signal: Signal, start: float, end: float, overhead: float) -> tuple[float, float] | None:
    """A peer's log mean of ``signal`` over ``start`` to ``end``: its intervals there weighted
    by how much of the span each covers, with the requests behind that share of each."""
    weight = log_sum = requests = 0.0
    for interval in (peer.before, peer):
        figure = None if interval is None else interval.log(signal, overhead)
        if interval is None or figure is None:
            continue
        covered = min(interval.end, end) - max(interval.start, start)
        if covered > 0:
            log, n = figure
            weight, log_sum = weight + covered, log_sum + covered * log
            requests += n * covered / max(interval.end - interval.start, 1e-9)
    if weight <= 0:
        return peer.log(signal, overhead)
    return log_sum / weight, max(requests, 1.0)


def _latest(window: EngineWindow, before: _Latest | None) -> _Latest:
    """The interval as compared: its mean ITL as a log, and its mean prefill seconds with the
    uncached prompt tokens per request behind them, each with the requests behind it (only
    those with ``MIN_COUNT`` observations behind them), and its errors and preemptions."""
    logs = {}
    itl = window.latency.get("itl")
    if itl is not None and itl.mean_s and itl.count >= MIN_COUNT:
        # Its tokens come from the requests decoding: those that finished, or the batch running.
        logs[Signal.ITL] = (math.log(itl.mean_s), max(window.requests, window.running or 0.0, 1.0))
    prefill, figures = window.latency.get("prefill_time"), None
    uncached = _uncached_per_request(window)
    if prefill is not None and prefill.mean_s and prefill.count >= MIN_COUNT and uncached >= 1.0:
        figures = (prefill.mean_s, uncached, float(prefill.count))
    counts = {Signal.ERROR_RATE: window.errors, Signal.PREEMPTIONS: float(window.preempted)}
    return _Latest(window.start, window.end, logs, window.requests, counts, before, figures)


def _uncached_per_request(window: EngineWindow) -> float:
    """Prompt tokens per request the prefix cache did not serve, of the requests whose prefill
    times the interval's histogram holds, as closely as the engine says.

    Best, the very requests (vLLM's ``request_prefill_kv_computed_tokens``, observed at finish
    as the prefill time is): an interval's mean prefill time rises and falls with the one long
    or uncached prompt in it, and so does this mean, so their ratio does not. Next, their
    prompt lengths (``request_prompt_tokens``) less the engine's recent hit rate. Last, both
    pooled over the engine's recent scrapes (``EngineMemory``): vLLM counts prompt tokens at
    the first token and observes prefill time when the request finishes, so one interval's two
    can be a decode's length apart."""
    if not math.isnan(window.uncached_per_finished):
        return window.uncached_per_finished
    per_request, hit = window.prompt_per_finished, window.pooled_hit_rate
    if math.isnan(per_request):
        per_request = window.prompt_per_request
    if math.isnan(per_request):
        per_request = window.prompt_tokens_per_s * window.length / max(window.requests, 1.0)
    if math.isnan(hit):
        hit = 0.0 if math.isnan(window.cache_hit_rate) else window.cache_hit_rate
    return per_request * (1.0 - hit)


@dataclass
class EnginePeers:
    """Every model's engines, each against its peers, fed one engine interval at a time.

    ``restore(key)`` returns a model's stored state (``states_to_save``) the first time its
    engines are met: each engine's CUSUMs and open incidents, and the model's learned spread.
    So a restarted worker resolves the incidents its predecessor fired, and judges at once.
    The peers' latest intervals are not stored: they come again within an interval. An
    interval held for a second look is (at once): a kill between the hold and that look
    would otherwise lose a fault that shows in one interval.
    """

    config: DetectorConfig = field(default_factory=DetectorConfig)
    min_ratio: float = 1.3
    #: Intervals an engine serves before it is compared (a restarted engine warms up).
    warmup_intervals: int = 6
    peer_horizon_s: float = 30.0
    latest: dict[str, dict[str, _Latest]] = field(default_factory=dict)  # model -> instance -> latest interval
    states: dict[str, dict[str, InstanceState]] = field(default_factory=dict)
    # model -> signal -> recent absolute log differences of its engines from their peers
    spread: dict[str, dict[Signal, deque[float]]] = field(default_factory=dict)
    prefill_cost: dict[str, PrefillCost] = field(default_factory=dict)  # model -> its engines' prefill cost
    incidents: PeerIncidents = field(init=False)
    # Where each compared interval's ratios go as a replica table row (``ratio_point``); None:
    # nowhere (a replay). The worker publishes and empties it, as ``DetectorBank.series``.
    series: list[SeriesPoint] | None = None
    restore: Callable[[str], dict[str, Any] | None] | None = None
    save_every: int = 30  # intervals of a model between its stored states (and at once after an event)
    _unsaved: dict[str, int] = field(default_factory=dict)  # model -> intervals judged since stored (-1: an event)
    # model -> instance -> its interval held for a second look (stored with the model)
    held: dict[str, dict[str, _Held]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.incidents = PeerIncidents(self.config, WORDS, "at the same time", critical_alone=False)

    @staticmethod
    def key(model: str) -> str:
        """The state table key of a model's engines against their peers."""
        return f"~engine-peers|{model}"

    def states_to_save(self, every_one: bool = False) -> list[tuple[str, dict[str, Any]]]:
        """(key, state) of models judged ``save_every`` intervals since last stored, or whose
        incidents moved; of every model with ``every_one``."""
        due = []
        for model, unsaved in self._unsaved.items():
            if every_one or unsaved < 0 or unsaved >= self.save_every:
                self._unsaved[model] = 0
                instances = {name: state.state() for name, state in self.states[model].items()}
                spread = {
                    signal.value: [round(d, 5) for d in seen] for signal, seen in self.spread.get(model, {}).items()
                }
                held = {name: interval.state() for name, interval in self.held.get(model, {}).items()}
                cost = self.prefill_cost[model].state() if model in self.prefill_cost else None
                due.append((self.key(model), {"instances": instances, "spread": spread, "held": held,
                                              "prefill_cost": cost}))  # fmt: skip
        return due

    def forget(self) -> None:
        """Drop every model (after ``states_to_save(every_one=True)``, when engines were handed
        to another worker): each is met again from its stored state."""
        self.latest.clear()
        self.states.clear()
        self.spread.clear()
        self.prefill_cost.clear()
        self._unsaved.clear()
        self.held.clear()

    def _meet(self, model: str) -> dict[str, InstanceState]:
        """A model's engines as stored, or none known (another version's state: fresh)."""

        def rest(stored: dict[str, Any]) -> None:
            self.spread[model] = {
                Signal(signal): deque(map(float, seen), maxlen=SPREAD_MEMORY)
                for signal, seen in stored["spread"].items()
            }
            # Absent in a state stored before holds were: nothing held.
            held = {str(name): _Held.from_state(saved) for name, saved in stored.get("held", {}).items()}
            if held:
                self.held[model] = held
            cost = stored.get("prefill_cost")  # absent in a state stored before it was learned
            if cost is not None:
                self.prefill_cost[model] = PrefillCost.from_state(cost)

        instances = self.states[model] = restored_instances(self.restore, self.key(model), self.config, rest)
        self._unsaved[model] = 0
        return instances

    def observe(self, window: EngineWindow) -> list[AnomalyEvent]:
        model, instance = window.labels.get("model", "other"), window.labels.get("instance", "")
        instances = self.states.get(model)
        if instances is None:
            instances = self._meet(model)
        cost = self.prefill_cost.get(model)
        if cost is None:  # (not setdefault: that would build one on every interval)
            cost = self.prefill_cost[model] = PrefillCost()
        overhead = cost.overhead_tokens
        engines = self.latest.setdefault(model, {})
        previous = engines.get(instance)
        if previous is not None:
            previous.before = None
        latest = engines[instance] = _latest(window, previous)
        logs, counts = latest.all_logs(overhead), latest.counts
        events = self._look_again(model, instance)
        state = instances.setdefault(instance, InstanceState())
        state.served += 1  # intervals, for the warm-up
        state.last_seen = window.end
        peers = {
            name: latest
            for name, latest in engines.items()
            if name != instance
            and abs(latest.end - window.end) <= self.peer_horizon_s
            and self.states[model][name].served >= self.warmup_intervals
        }
        for name in [name for name, latest in engines.items() if window.end - latest.end > 10 * self.peer_horizon_s]:
            del engines[name]  # gone (scaled in): its last interval is no peer any more
            if not instances[name].firing:
                del instances[name]  # nor is it kept, or stored, unless an incident of it is open
        state.peers = len(peers)
        steps: dict[Signal, tuple[float, float]] = {}
        if peers and state.served >= self.warmup_intervals:
            for signal, (own, n) in logs.items():
                theirs = [f for f in (peer.log(signal, overhead) for peer in peers.values()) if f is not None]
                step = self._difference(model, state, signal, own, n, theirs, learn=True)
                if step is not None:
                    steps[signal] = step
            for signal in MIN_PEER_RATE:
                steps.update(_count_step(signal, window.requests, counts[signal], peers))
        if latest.prefill is not None and not state.names(Signal.PREFILL_PER_TOKEN):
            mean_s, uncached, requests = latest.prefill
            cost.learn(uncached, mean_s, requests)  # after the comparison: an interval is not judged on itself
        load = {"requests": window.requests, "requests_per_s": window.requests / max(window.length, 1e-9)}
        if window.kv_cache_usage is not None:
            load["kv_cache_usage"] = window.kv_cache_usage
        if window.waiting is not None:
            load["waiting"] = window.waiting
        critical = self.config.critical * LN10
        hold = {
            signal: logs[signal] for signal, (increment, _) in steps.items() if signal in logs and increment >= critical
        }
        if hold:
            self.held.setdefault(model, {})[instance] = _Held(
                window.start, window.end, hold, frozenset(peers), load, overhead
            )
            self._unsaved[model] = -1  # stored at once, as an event would be
        for signal in WORDS:
            if signal in hold:
                continue  # judged again once the peers' intervals over the same time are in
            event = self.incidents.step(
                model, instance, state, signal, steps.get(signal), (window.start, window.end), True, load
            )
            if event is not None:
                events.append(event)
        self._unsaved[model] = -1 if events or self._unsaved[model] < 0 else self._unsaved[model] + 1
        if self.series is not None and steps:
            span = (window.start, window.end)
            self.series.append(ratio_point(self.incidents, self.min_ratio, model, instance, state, steps, span, load,
                                           source="scrapes"))  # fmt: skip
        return events

    def _difference(
        self, model: str, state: InstanceState, signal: Signal, own: float, n: float,
        theirs: list[tuple[float, float]], learn: bool,
    ) -> tuple[float, float] | None:  # fmt: skip
        """(CUSUM increment, ratio) of an engine's log mean ``own`` of ``n`` requests against
        the median of its peers' ``theirs``; with ``learn``, the difference joins the
        model's spread (unless an incident names the engine). None until the spread is known."""
        if not theirs:
            return None
        diff = own - statistics.median(log for log, _ in theirs)
        # The median of the peers' means is about as noisy as a mean of pi/2 fewer requests.
        scale = math.sqrt(1.0 / n + (math.pi / 2) / sum(k for _, k in theirs))
        seen = self.spread.setdefault(model, {}).setdefault(signal, deque(maxlen=SPREAD_MEMORY))
        known = len(seen) >= SPREAD_SEEN  # judged once the fleet's usual spread is
        error = max(tail_spread(seen) * scale, MIN_STANDARD_ERROR) if known else math.inf
        if learn and not state.names(signal):  # how far healthy engines stray, not a named one
            seen.append(abs(diff) / scale)
        if not known:
            return None
        shift = math.log(self.min_ratio)
        return (diff - shift) * 2 * shift / error**2, math.exp(diff)

    def _look_again(self, model: str, reported: str) -> list[AnomalyEvent]:
        """Held intervals of ``model`` whose peers have all reported past them, or whose engine
        (``reported``) sent its next one: judged against the peers over the same time. Peers
        not heard from (gone, or not yet heard by a restarted worker, which restored the hold)
        are waited for up to ``peer_horizon_s`` of the model's time, as a peer is compared."""
        held, engines = self.held.get(model), self.latest.get(model, {})
        if not held:
            return []
        newest = max(latest.end for latest in engines.values())
        events = []
        for instance, interval in list(held.items()):
            heard = [name for name in interval.peers if name in engines]
            covered = all(engines[name].end >= interval.end for name in heard)
            waited = newest - interval.end > self.peer_horizon_s
            if not waited and not (heard and (covered or instance == reported)):
                continue
            del held[instance]
            state = self.states[model].get(instance)
            if state is None:
                continue
            span = (interval.start, interval.end)
            for signal, (own, n) in interval.logs.items():
                over = [_over(engines[name], signal, interval.start, interval.end, interval.overhead) for name in heard]
                theirs = [figure for figure in over if figure is not None]
                step = self._difference(model, state, signal, own, n, theirs, learn=False)
                event = self.incidents.step(model, instance, state, signal, step, span, True, interval.load, alone=True)
                if event is not None:
                    events.append(event)
        return events


def _count_step(
    signal: Signal, requests: float, count: float, peers: dict[str, _Latest]
) -> dict[Signal, tuple[float, float]]:
    """``count_step`` of ``signal``'s events per finished request against the peers' rate."""
    peer_requests = sum(latest.requests for latest in peers.values())
    peer_count = sum(latest.counts.get(signal, 0.0) for latest in peers.values())
    step = count_step(count, requests, peer_count, peer_requests, MIN_PEER_RATE[signal], COUNT_ALTERNATIVE)
    return {} if step is None else {signal: step}
