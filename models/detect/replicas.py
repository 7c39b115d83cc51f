"""Each serving instance against its peers: which replica to drain.

A model served by several replicas behind a load balancer most often fails one replica at
a time (a throttled GPU, a noisy neighbour, a replica left on an old config). At the model
level that is diluted to a share of the traffic; compared with its peers in the same windows,
on the same request mix, it stands out. Stage 1 folds every request that names its instance
a second time into a *replica row* of its segment and instance
(``models.windows.segment_keys.REPLICA_PREFIX``), so here each (segment, window) holds every
instance's figures side by side.

Per window, per instance and signal:

- latency (prefill seconds per uncached prompt token, inter-token latency), on the log scale:
  in each segment, the instance's mean against the mean of its peers' requests, a peer far
  faster than the rest weighed down (``_peers``; instances an incident names left out; the
  prompt and output bands and the route are held fixed by the segment), weighted by its
  requests over the segments, with the standard error of that difference from the
  requests' own spread; made twice, over its requests alike and with each weighed by the
  share of its life spent in the window (``RECENT_COLUMNS``: a request log comes when the
  request ends, and a replica that slowed down a moment ago first finishes requests it
  slowed for part of their life), the view that says more counting;
- errors: the instance's failed requests against its peers' rate.

Evidence accumulates in a one-sided CUSUM of the log-likelihood ratio of "``min_ratio`` or
more worse than its peers" against "as its peers" (a Gaussian mean shift for latency, a
Poisson rate for errors): a difference below ``min_ratio`` drifts it down however much
traffic there is, a 1.5x-slower replica with a few requests a window climbs within a few
windows, and a shift of every replica (a fleet-wide fault) moves no instance from its peers.

Real traffic is rougher than a per-request spread says, so three guards (each found on the
real GPU load tests, where replicas are random splits of one server's requests and any page
is false): a segment's spread is its window's shrunk towards the one learned over many
(``PRIOR_SPREAD``, ``PRIOR_DF``); a comparison pools an instance's windows until it holds
``MIN_BLOCK_REQUESTS`` requests (or as much evidence as one window may add, or slower
requests while it completes far fewer than its usual share: ``SHORT_SHARE_SURPRISE``); and
the standard errors are calibrated against how far the model's recent differences actually
strayed (``Calibration``), nothing judged before ``CALIBRATION_SEEN`` of them. As a
segment's lifecycle, one window pages alone only with critical evidence
(``models.detect.peer_incidents``). The CUSUM is reported on the surprise scale (log10 of
the likelihood ratio) and judged against the detector's ``threshold``. An instance is judged
once it has served ``warmup_requests`` requests (a replica that just started has a cold
cache and warms up); an instance absent from a window counts as normal there, so a drained
replica resolves.

>>> from servewatch.models.windows.window import COLUMN_OF, WindowStats, log_seconds
>>> import numpy as np
>>> watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
>>> def row(instance, start, itl_s):
...     w = WindowStats(f"~replica|model=m|instance={instance}", start, 10.0, requests=40, itl_n=40)
...     rng = np.random.default_rng(int(start) + len(instance))
...     logs = log_seconds(itl_s * np.exp(rng.normal(0, 0.2, 40)))
...     w.block.sums[0, [COLUMN_OF["itl_log"], COLUMN_OF["itl_log2"]]] = logs.sum(), (logs**2).sum()
...     return w
>>> events = []
>>> for start in range(0, 400, 10):  # the fleet's usual differences are learned first
...     rows = [row(f"10.0.0.{k}:8000", float(start), 0.05 if k == 3 and start >= 300 else 0.02) for k in range(4)]
...     events += watch.observe(rows)
>>> [(e.segment["instance"], e.signal.value, e.hints[0].code) for e in events][:1]
[('10.0.0.3:8000', 'itl', 'replica_outlier')]
"""

from __future__ import annotations

import functools
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.special import bdtr

from servewatch.models.detect.peer_incidents import (
    InstanceState,
    PeerIncidents,
    count_step,
    ratio_point,
    replica_series_key,
    restored_instances,
    tail_spread,
    window_cap,
)
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.windows.segment_keys import join_key, parse_key
from servewatch.models.windows.window import PHASE_COLUMNS, RECENT_COLUMNS, WindowStats
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.series import SeriesPoint

#: Latency signals compared across replicas, with the window phase each reads and how it is said.
LATENCY_PHASES: dict[Signal, tuple[str, str]] = {
    Signal.PREFILL_PER_TOKEN: ("prefill_token", "prefills {ratio:.1f}x slower per uncached prompt token"),
    Signal.ITL: ("itl", "decodes {ratio:.1f}x slower per output token"),
}
WORDS = {
    **{signal: words for signal, (_, words) in LATENCY_PHASES.items()},
    Signal.ERROR_RATE: "fails {ratio:.1f}x as many requests",
}
#: The spread of a request's log latency assumed at least (a window of identical requests
#: must not make a 3 % difference a certainty), and the standard error of one instance's
#: difference from its peers at least (mix, routing and time-of-arrival differences between
#: replicas that no per-request spread shows).
MIN_SPREAD = 0.1
MIN_STANDARD_ERROR = 0.05
#: The spread a segment's requests are assumed to have before any was seen (log scale: a
#: request 1.6x its segment's typical is one standard deviation out), worth ``PRIOR_DF``
#: requests against a window's own; learned over about ``LEARN_DF`` requests.
PRIOR_SPREAD = 0.5
PRIOR_DF = 20
LEARN_DF = 500
#: A peer whose mean stands below (faster than) its peers' level by more than this many
#: standard errors of its own is weighed down in their reference (Huber's constant: 95 % as
#: efficient as the plain mean where nothing is off), in a few reweighting steps.
HUBER_K = 1.345
HUBER_STEPS = 3
#: Requests of an instance a latency comparison needs at least (pooled over windows).
MIN_BLOCK_REQUESTS = 10
#: A replica whose requests slow down completes fewer of them for a while (they are still
#: running): its few completions are not a quiet replica's, but the part of a slowdown the
#: logs show so far. Fewer than its usual share of the model's completions with this surprise
#: (1 in 100, the lower tail of a binomial) and its few requests are compared without waiting
#: for ``MIN_BLOCK_REQUESTS`` (a drained replica's few are as fast as ever: no evidence).
SHORT_SHARE_SURPRISE = 2.0
#: Windows over which an instance's usual share of its model's completions is learned.
SHARE_HALFLIFE = 30.0
#: Differences the calibration of standard errors keeps, and needs before latency is judged.
CALIBRATION_MEMORY = 500
CALIBRATION_SEEN = 50
#: Peer error rate assumed at least, per request: a replica's few failures among peers that
#: had none are not "infinitely" more.
MIN_PEER_ERROR_RATE = 1e-3
#: The error rate, as a multiple of its peers', that the errors' CUSUM tests for: a replica
#: that fails now and then as they do never accumulates, one failing a few requests in
#: every window does within a few.
ERROR_ALTERNATIVE = 10.0


@dataclass
class ReplicaWatch:
    """Every model's replicas, each against its peers, fed the replica rows of released windows.

    ``restore(key)`` returns a model's stored state (``states``) the first time the watch meets
    the model; ``states()`` hands back every model's, for the state table.
    """

    config: DetectorConfig = field(default_factory=DetectorConfig)
    #: The smallest difference from peers worth a page (a ratio); smaller ones never accumulate.
    min_ratio: float = 1.3
    warmup_requests: int = 100
    #: Windows an instance may be absent before it is forgotten (scaled in or renamed).
    forget_after_windows: int = 360
    restore: Callable[[str], dict[str, Any] | None] | None = None
    models: dict[str, dict[str, InstanceState]] = field(default_factory=dict)
    incidents: PeerIncidents = field(init=False)
    # model -> segment|phase -> the spread of its requests' log latency, learned; stored with
    # the model's instances, as is each phase's calibration (a restarted watch goes on with
    # what it learned, rather than from the prior)
    spread: dict[str, dict[str, float]] = field(default_factory=dict)
    calibration: dict[str, Calibration] = field(default_factory=dict)  # model|phase ->
    # model|phase -> instance -> [weight, weighted difference, weighted variance] of each view
    # (``_latency_steps``), then requests, not yet compared
    blocks: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    judged_until: dict[str, float] = field(default_factory=dict)  # model -> newest window end judged
    judged: int = 0  # windows judged since the states were last taken

    def __post_init__(self) -> None:
        self.incidents = PeerIncidents(self.config, WORDS, "on the same request mix")

    @staticmethod
    def key(model: str) -> str:
        """The state table key of a model's replicas, also the partials key its replica rows
        travel under (``models.windows.segment_keys.routing_key``): state and rows share a partition."""
        return f"~replicas|{model}"

    def view(self, model: str) -> dict[str, dict[str, float]]:
        """Per instance, each signal's latest ratio to its peers (for a replica table)."""
        return {instance: dict(state.ratio) for instance, state in self.models.get(model, {}).items()}

    # -- state -----------------------------------------------------------------------
    def states(self) -> list[tuple[str, dict[str, Any]]]:
        self.judged = 0
        return [(self.key(model), self._state(model)) for model in self.models]

    def _state(self, model: str) -> dict[str, Any]:
        instances = {name: state.state() for name, state in self.models[model].items()}
        calibration = {
            phase: [round(ratio, 4) for ratio in kept.seen]
            for phase, _ in LATENCY_PHASES.values()
            if (kept := self.calibration.get(f"{model}|{phase}")) is not None
        }
        spread = {key: round(value, 6) for key, value in self.spread.get(model, {}).items()}
        return {"until": self.judged_until.get(model, -math.inf), "instances": instances, "spread": spread,
                "calibration": calibration}  # fmt: skip

    def _meet(self, model: str) -> dict[str, InstanceState]:
        def until(stored: dict[str, Any]) -> None:
            self.judged_until[model] = float(stored["until"])
            # Absent in a state stored before they were: learned again from the prior.
            self.spread[model] = {str(key): float(value) for key, value in stored.get("spread", {}).items()}
            for phase, seen in stored.get("calibration", {}).items():
                self.calibration[f"{model}|{phase}"] = Calibration(deque(map(float, seen), maxlen=CALIBRATION_MEMORY))

        instances = self.models[model] = restored_instances(self.restore, self.key(model), self.config, until)
        return instances

    # -- judging ---------------------------------------------------------------------
    def observe(self, rows: list[WindowStats], series: list[SeriesPoint] | None = None) -> list[AnomalyEvent]:
        """Judge the replica rows of windows released together (every row of a model's window
        comes in one release: stage 1 sends them through one partials partition); with
        ``series``, append each compared instance's ratios to its peers (``ratio_point``)."""
        by_window: dict[tuple[str, float], dict[str, dict[str, WindowStats]]] = {}
        for row in rows:
            model, segment, instance = _split(row.key)
            if instance is None or instance == "-":
                continue  # records without an instance (or the overflow row): nothing to compare
            by_window.setdefault((model, row.start), {}).setdefault(segment, {})[instance] = row
        events: list[AnomalyEvent] = []
        for (model, start), segments in sorted(by_window.items(), key=lambda item: item[0][1]):
            length = next(iter(next(iter(segments.values())).values())).length
            if start + length <= self.judged_until.get(model, -math.inf):
                continue  # judged before (a replay after a restart)
            events += self._judge(model, start, start + length, segments, series)
        return events

    def _judge(
        self, model: str, start: float, end: float, segments: dict[str, dict[str, WindowStats]],
        series: list[SeriesPoint] | None,
    ) -> list[AnomalyEvent]:  # fmt: skip
        self.judged += 1
        self.judged_until[model] = end
        instances = self.models.get(model)
        if instances is None:
            instances = self._meet(model)
        served: dict[str, int] = {}
        for rows in segments.values():
            for instance, row in rows.items():
                served[instance] = served.get(instance, 0) + int(row.requests)
        for instance, count in served.items():
            state = instances.setdefault(instance, InstanceState())
            state.served += count
            state.last_seen = end
        ready = {name for name, state in instances.items() if state.served >= self.warmup_requests and name in served}
        findings: dict[str, dict[Signal, tuple[float, float]]] = {name: {} for name in ready}
        if len(ready) >= 2:
            short = _short_of_share(instances, ready, served)
            for signal, (phase, _) in LATENCY_PHASES.items():
                calibration = self.calibration.setdefault(f"{model}|{phase}", Calibration())
                blocks = self.blocks.setdefault(f"{model}|{phase}", {})
                steps = _latency_steps(
                    segments,
                    ready,
                    phase,
                    self.min_ratio,
                    self.spread.setdefault(model, {}),
                    calibration,
                    blocks,
                    window_cap(self.config),
                    frozenset(name for name, state in instances.items() if state.names(signal)),
                    short,
                )
                for name, step in steps.items():
                    findings[name][signal] = step
            for name, step in _error_steps(segments, ready, served).items():
                findings[name][Signal.ERROR_RATE] = step
        events = []
        for name, state in list(instances.items()):
            if end - state.last_seen > self.forget_after_windows * (end - start) and not state.firing:
                del instances[name]
                continue
            state.peers = len(ready) - 1
            requests = served.get(name, 0)
            load = {"requests": float(requests), "requests_per_s": requests / (end - start)}
            found = findings.get(name, {})
            for signal in WORDS:
                event = self.incidents.step(
                    model, name, state, signal, found.get(signal), (start, end), name in served, load
                )
                if event is not None:
                    events.append(event)
            if series is not None and found:
                point = ratio_point(self.incidents, self.min_ratio, model, name, state, found, (start, end), load)
                series.append(point)
        return events


@functools.lru_cache(maxsize=1 << 16)
def _split(key: str) -> tuple[str, str, str | None]:
    """A replica row's model, segment (its key without the instance) and instance: the same
    few thousand keys come every window."""
    labels = parse_key(key)
    instance = labels.pop("instance", None)
    return labels["model"], join_key(labels), instance


def _latency_steps(
    segments: dict[str, dict[str, WindowStats]], ready: set[str], phase: str, min_ratio: float,
    learned: dict[str, float], calibration: Calibration, blocks: dict[str, list[float]], window_llr: float,
    named: frozenset[str] = frozenset(), short: frozenset[str] = frozenset(),
) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Per instance of ``ready``: (CUSUM increment, ratio to its peers) of one latency phase.

    The spread of a request's log latency is the window's own, shrunk towards the segment's
    ``learned`` one (kept in place, by segment and phase): a window of a few requests says
    little about it, and a tight one would make a single slow request a certainty. Instances
    in ``named`` are compared as the others, but their comparisons teach ``calibration`` nothing;
    those in ``short`` (``_short_of_share``) are compared without pooling their few requests, as
    is any instance whose pooled requests already hold ``window_llr`` (``window_cap``)."""
    n_at, log_at, log2_at = PHASE_COLUMNS[phase]
    w_at, recent_at, w2_at = RECENT_COLUMNS[phase]
    # instance -> per view (all requests alike, then the recent ones weighed up): weight,
    # weighted difference, weighted variance; then its requests
    sums: dict[str, list[float]] = {}
    for segment_key, rows in segments.items():
        means: dict[str, tuple[float, float]] = {}  # instance -> (requests, mean)
        recent: dict[str, tuple[float, float]] = {}  # instance -> (effective requests, recent mean)
        spread_n = spread_sq = 0.0
        for instance, row in rows.items():
            if instance not in ready:
                continue
            item, index = row.block.sums.item, row.row
            n, total, squares = item(index, n_at), item(index, log_at), item(index, log2_at)
            if n <= 0:
                continue
            mean = total / n
            means[instance] = (n, mean)
            spread_n += n
            spread_sq += max(squares - n * mean * mean, 0.0)
            # Weighed by how recent each request is (``RECENT_COLUMNS``), with the requests an
            # equal-weight mean as noisy would hold (Kish's effective sample size).
            weight, weighted, squared = item(index, w_at), item(index, recent_at), item(index, w2_at)
            recent[instance] = (weight * weight / squared, weighted / weight) if weight > 0 else (n, mean)
        if len(means) < 2:
            continue
        df = spread_n - len(means)
        known = learned.get(segment := f"{segment_key}|{phase}", PRIOR_SPREAD**2)
        variance = max((spread_sq + PRIOR_DF * known) / (df + PRIOR_DF), MIN_SPREAD**2)
        if df > 0:
            learned[segment] = known + (spread_sq / df - known) * df / (df + LEARN_DF)
        for at, view in ((0, means), (3, recent)):
            for instance, (peer_n, peer_sum) in _peers(view, named, variance).items():
                n, mean = view[instance]
                diff = mean - peer_sum / peer_n
                var_diff = variance / n + variance / peer_n
                kept = sums.setdefault(instance, [0.0] * 7)
                kept[at] += n
                kept[at + 1] += n * diff
                kept[at + 2] += n * n * var_diff
        for instance, (n, _) in means.items():
            sums[instance][6] += n
    # A comparison is made over at least ``MIN_BLOCK_REQUESTS`` of an instance's requests: a
    # quiet replica's few requests of one window are pooled with its next windows'; unless
    # those few already hold ``window_llr``, as much as one window without critical evidence
    # adds to the CUSUM (``window_cap``): compared now, they count that much in this window,
    # and the next requests make a comparison of their own rather than wait in the block
    # (a replica that slows down completes few requests a window, each slower). Or the
    # replica completes far fewer than its share (``SHORT_SHARE_SURPRISE``) and its few are
    # slower than its peers': few because they are slow, not a quiet replica's.
    shift = math.log(min_ratio)
    inflation = calibration.inflation()

    def view_step(weight: float, weighted_diff: float, weighted_var: float) -> tuple[float, float]:
        diff, modelled = weighted_diff / weight, math.sqrt(weighted_var) / weight
        error = max(modelled * (inflation or 1.0), MIN_STANDARD_ERROR)
        # Log-likelihood ratio of a mean 2*shift against 0, with the reference at the shift:
        # positive only for differences beyond ``min_ratio``.
        return (diff - shift) * 2 * shift / error**2, math.exp(diff)

    def step(block: list[float]) -> tuple[float, float]:
        # A request log is written when the request ends: a replica that slowed down a moment
        # ago first finishes requests it slowed for part of their life, and all its requests
        # alike read a part of the change. Its recent requests read more of it, its older
        # ones less; the view that says more is the step. One calibration scales both
        # views' errors, learned from the view over requests alike.
        return max(view_step(*block[0:3]), view_step(*block[3:6]))

    steps = {}
    for instance, kept in sums.items():
        block = blocks.setdefault(instance, [0.0] * 7)
        for k, value in enumerate(kept):
            block[k] += value
        found = step(block)
        if block[6] >= MIN_BLOCK_REQUESTS or found[0] >= window_llr or (instance in short and found[0] > 0):
            del blocks[instance]
            if block[2] > 0 and instance not in named:  # how far healthy ones stray (``InstanceState.names``)
                calibration.note([abs(block[1]) / math.sqrt(block[2])])
            steps[instance] = found
    if inflation is None:
        return {}  # too few differences seen yet to know how far they stray
    return steps


def _peers(
    means: dict[str, tuple[float, float]], named: frozenset[str], variance: float
) -> dict[str, tuple[float, float]]:
    """Per instance of one segment (``means``: instance -> (requests, mean log latency); a
    request's log latency has ``variance``), its peers' reference as (weight in requests,
    weighted sum of log latency): the others' requests, each peer weighed down where its mean
    stands further below their level than its requests' noise explains (``HUBER_K`` standard
    errors; the level a Huber M-estimate), less instances an incident names while any other
    is left (a replica known to be bad must not pull its peers' reference).

    Not the median of the peers' means: with a few requests per peer and latencies in two
    modes (a real server's prefill is fast or 4-5x slower by the moment), that median sits on
    the majority mode, and every instance whose requests mix the modes reads slower than it,
    window after window. Not their plain mean either: one replica far faster than the rest (a
    newer GPU among older ones) would make every other one read slower than its peers. Only
    the faster side is weighed down, because the test is one-sided: a slow peer can only lift
    the others' reference, which pages less, never more. The level is robust both ways, so
    that a slow replica no incident names yet does not make its healthy peers look fast.

    >>> means = {"a": (2.0, 1.0), "b": (1.0, 1.2), "c": (3.0, 0.9)}
    >>> n, total = _peers(means, frozenset(), 0.25)["a"]; n, round(total / n, 3)
    (4.0, 0.975)
    >>> means["d"] = (3.0, -1.0)  # far faster than the others: weighed down
    >>> n, total = _peers(means, frozenset(), 0.25)["a"]; round(n, 2), round(total / n, 3)
    (4.66, 0.696)
    """
    reference = {i: nm for i, nm in means.items() if i not in named} or means
    fit = dict.fromkeys(reference, 1.0)
    fit_n, fit_sum = _weighted_totals(reference, fit)
    for _ in range(HUBER_STEPS):
        level = fit_sum / fit_n
        for instance, (n, mean) in reference.items():
            distance = abs(mean - level) * math.sqrt(n / variance)
            fit[instance] = 1.0 if distance <= HUBER_K else HUBER_K / distance
        fit_n, fit_sum = _weighted_totals(reference, fit)
    level = fit_sum / fit_n
    weights = {instance: 1.0 if reference[instance][1] >= level else fit[instance] for instance in reference}
    total_n, total_sum = _weighted_totals(reference, weights)
    peers = {}
    for instance, (n, mean) in means.items():
        weight = weights.get(instance, 0.0)
        if 2 * weight * n <= total_n:  # the others are most of the reference: the totals less its own
            peers[instance] = (total_n - weight * n, total_sum - weight * n * mean)
            continue
        # Most of the reference is its own (a subtraction would lose the others' digits): theirs,
        # summed; where it is all of it, every other instance, plainly.
        others = [(weights[other], nm) for other, nm in reference.items() if other != instance]
        if not others:
            others = [(1.0, nm) for other, nm in means.items() if other != instance]
        peers[instance] = (sum(w * k for w, (k, _) in others), sum(w * k * m for w, (k, m) in others))
    return peers


def _weighted_totals(means: dict[str, tuple[float, float]], weights: dict[str, float]) -> tuple[float, float]:
    """``means``' requests and their summed log latency, each instance's counted ``weights`` times."""
    total_n = total_sum = 0.0
    for instance, (n, mean) in means.items():
        total_n, total_sum = total_n + weights[instance] * n, total_sum + weights[instance] * n * mean
    return total_n, total_sum


def _short_of_share(instances: dict[str, InstanceState], ready: set[str], served: dict[str, int]) -> frozenset[str]:
    """The instances of ``ready`` that completed surprisingly fewer of the window's requests
    than their usual share (``SHORT_SHARE_SURPRISE``); each one's share learns the window.

    The share is learned, not assumed even: a load balancer may weigh replicas unequally."""
    names = list(ready)
    counts = np.array([served[name] for name in names], dtype=np.int64)
    total = int(counts.sum())
    if total <= 0:
        return frozenset()
    even = 1.0 / len(names)
    usual = np.array([even if math.isnan(instances[name].share) else instances[name].share for name in names])
    usual = np.clip(usual / usual.sum(), 1e-6, 1.0 - 1e-6)  # replicas came or went: shares of those here
    surprise = -np.log10(np.maximum(bdtr(counts, total, usual), 1e-300))
    alpha = 1.0 - 0.5 ** (1.0 / SHARE_HALFLIFE)
    for name, share, count in zip(names, usual, counts, strict=True):
        state = instances[name]
        state.share = float(share + alpha * (count / total - share))
    return frozenset(name for name, s in zip(names, surprise, strict=True) if s >= SHORT_SHARE_SURPRISE)


@dataclass
class Calibration:
    """How far instances' differences from their peers stray beyond what the requests' spread
    predicts: the 90th percentile of recent ``|difference| / standard error`` over the normal
    curve's (1.645), never below 1.

    Requests of one window are not independent draws (a burst queues several together, a few
    mostly cached prompts have extreme seconds per uncached token), so the modelled standard
    error can be several times too small on real traffic; a percentile rather than a mean
    square, so that a minority of bad replicas moves it little, and without the instances an
    incident names (``InstanceState.names``), which would otherwise become that percentile."""

    seen: deque[float] = field(default_factory=lambda: deque(maxlen=CALIBRATION_MEMORY))

    def note(self, ratios: Iterable[float]) -> None:
        """``|difference| / standard error`` of comparisons just made."""
        self.seen.extend(ratios)

    def inflation(self) -> float | None:
        if len(self.seen) < CALIBRATION_SEEN:
            return None
        return max(1.0, tail_spread(self.seen))


def _error_steps(
    segments: dict[str, dict[str, WindowStats]], ready: set[str], served: dict[str, int]
) -> dict[str, tuple[float, float]]:
    """Per instance of ``ready``: (CUSUM increment, ratio to its peers) of its failed requests."""
    errors = dict.fromkeys(ready, 0.0)
    for rows in segments.values():
        for instance, row in rows.items():
            if instance in ready:
                errors[instance] += float(row.errors)
    total_errors, total_requests = sum(errors.values()), sum(served[name] for name in ready)
    steps = {}
    for instance, count in errors.items():
        n = served[instance]
        step = count_step(count, n, total_errors - count, total_requests - n, MIN_PEER_ERROR_RATE, ERROR_ALTERNATIVE)
        if step is not None:
            steps[instance] = step
    return steps


__all__ = ["ReplicaWatch", "replica_series_key"]
