"""From closed segment windows to ``AnomalyEvent``s: per segment, one detector per signal.

Each signal (``models.detect.signals``) reads its observation from the window and asks its model
for a surprise. Latency-like signals are judged twice: against the load-conditioned
prediction (is it worse than this *demand* explains? pages) and against the load-blind
level (is it worse than usual at all? if so but demand explains it, an ``info`` event with
``explained_by_load: true``). Rates and shares are per request already, so load does not
explain them.

Windows that page are not learned, so an incident never becomes the new normal by
accident; one that lasts ``adopt_after`` windows is adopted deliberately, reported once
as a level change. The lifecycle (``IncidentTracker``) turns verdicts into a few events.

Here: a segment's detectors; the bank of all segments is ``models.detect.bank``. One
signal's judgement is in ``models.detect.signal_detector``; how events read, in
``models.explain.wording``.
"""

from __future__ import annotations

import functools
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servewatch.models.detect.events import incident_event
from servewatch.models.detect.grouping import demand_explains
from servewatch.models.detect.lifecycle import Transition
from servewatch.models.detect.signal_detector import DetectorConfig, SignalDetector, Verdict, band, queue_makes_up
from servewatch.models.detect.signals import MODEL_FIGURES, SPEC_SETS, Reading, SignalSpec
from servewatch.models.detect.summary import window_summary
from servewatch.models.detect.tolerance import Tolerances
from servewatch.models.explain.faulty_requests import FAULT_SIGNALS, SLOWNESS
from servewatch.models.explain.hints import PREFILL_SIGNALS, fallback_hint, latency_hints, signal_hints
from servewatch.models.explain.wording import segment_phrase, with_unit
from servewatch.models.stats.baseline import Baseline
from servewatch.models.stats.capacity import Capacity
from servewatch.models.stats.rates import BetaBinomialRate
from servewatch.models.windows.window import WindowStats
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal
from servewatch.schemas.evidence_pointer import EvidencePointer, FaultScan, WindowSample, WorstBy
from servewatch.schemas.series import SeriesPoint, SignalPoint
from servewatch.schemas.version import SCHEMA_VERSION

#: Windows of past model load that latency is also judged against (see ``recent_load``).
LOAD_MEMORY = 2

#: Version of ``SegmentDetectors.state()``: recent load, the baseline, arrivals and capacity
#: (``models.stats.capacity``), each signal's model (latency with tails, drift and floors; rate
#: models with their borrowed prior kept apart, ``BetaBinomialRate.borrow``). ``load_state``
#: refuses other versions (the segment starts fresh).
STATE_VERSION = 4
#: Versions ``load_state`` reads: a rate model of 3 takes the generic prior (its model's at
#: the next window), everything else is as in 4.
READABLE_VERSIONS = (3, STATE_VERSION)


@dataclass(frozen=True, slots=True)
class Layout:
    """Which signals' models a segment's buffer holds, and where each one's numbers start.

    Segments whose signals showed up in the same order share one (``extended`` is cached),
    so a segment pays a reference for it, not a dict of models.
    """

    signals: tuple[Signal, ...] = ()
    offsets: tuple[int, ...] = ()
    size: int = 0

    def offset(self, signal: Signal) -> int | None:
        for known, at in zip(self.signals, self.offsets, strict=True):
            if known is signal:
                return at
        return None

    def extended(self, signal: Signal, size: int) -> Layout:
        return _extended(self, signal, size)


@functools.lru_cache(maxsize=4096)
def _extended(layout: Layout, signal: Signal, size: int) -> Layout:
    return Layout((*layout.signals, signal), (*layout.offsets, layout.size), layout.size + size)


#: A segment's buffer starts with its recent model load (``LOAD_MEMORY`` runs of window
#: end and ``MODEL_FIGURES``; an end of -inf is an empty run), then its ``Baseline``; its
#: models' numbers follow, where its ``Layout`` says. Its ``Capacity`` (arrivals of its
#: model, what the model's engines have served) comes between the two.
_LOAD_RUN = 1 + len(MODEL_FIGURES)
_USUAL_AT = LOAD_MEMORY * _LOAD_RUN
_NO_LOAD = [-math.inf] + [0.0] * len(MODEL_FIGURES)
_BASELINE = Baseline()
_CAPACITY = Capacity()
_CAPACITY_AT = _USUAL_AT + Baseline.STATE_SIZE
_FRESH = array("d", _NO_LOAD * LOAD_MEMORY + _BASELINE.numbers + _CAPACITY.numbers)
_NO_MODELS = Layout(size=len(_FRESH))


@functools.lru_cache(maxsize=256)
def _template(signal: Signal, grace_windows: int, source: str = "requests") -> Any:
    """A model of ``signal`` whose constructor arguments every segment's views share."""
    return SPEC_SETS[source][signal].build(grace_windows)


@functools.cache
def _judging_specs(source: str, signals: tuple[str, ...]) -> tuple[SignalSpec, ...]:
    """``source``'s specs of ``signals`` in the order a window judges them: the prefix-cache hit
    rate first and queue time next, so that the latencies that include prefill know whether
    the cache is failing, and those that include the queue whether it pages (``_corroborate``)."""
    first = (Signal.CACHE_HIT_RATE.value, Signal.QUEUE_TIME.value)
    order = sorted(signals, key=lambda name: first.index(name) if name in first else len(first))
    return tuple(SPEC_SETS[source][Signal(name)] for name in order)


def _corroborate(verdict: Verdict, reading: Reading, config: DetectorConfig, cause: str | None = "cache") -> None:
    """A prefill latency judged while the segment's prefix cache is failing; with ``cause``
    None, a latency that includes the queue (TTFT, end-to-end) judged while the segment's
    queue pages as a fault (slots lost, not load) and makes up a good part of it (``QUEUE_SHARE``).

    The cache's own test already holds evidence at the paging bar (1 in 10,000) that prompts
    are recomputed; a rise of TTFT or prefill time in the same window is the effect that
    evidence predicts. So the latency needs only to be unusual on its own (half the
    threshold: 1 in 100, the bar a rise under saturation is reported at), not a second
    1-in-10,000 surprise, and its incident fires at once, as a rate's CUSUM does: the
    evidence spans the cache's windows already. The cache asks one question of the window,
    whether it is slower than predicted at this load, so that look is taken alone, without
    the cost of looking two ways (``Judgement.alone``). A rise load explains stays explained.
    The queue's page is such evidence too: TTFT five times its usual where the queue makes up
    a good part of it is the queue's effect, not a second surprise, though TTFT's own heavy tails
    (bursts queue now and then) leave it short of paging alone."""
    if verdict.explained or reading.value <= verdict.expected or max(verdict.score, verdict.alone) < config.unusual:
        return
    verdict.pages, verdict.sustained, verdict.learnable = True, True, False
    if cause is not None:  # the cache: its hints lead with it (``models.explain.hints.latency_hints``)
        verdict.cause = cause


def _demand_ratio(detector: SignalDetector, reading: Reading) -> float:
    """A window's demand against the usual, as a latency model reads it (NaN before it learned)."""
    model = detector.model
    return math.exp(model.demand_index(reading.x)) if model.n_learned else math.nan


@dataclass(slots=True)
class _Demand:
    """A window's demand against the usual, as TTFT's model reads it (NaN where TTFT is not
    judged in it): set as TTFT is judged, or read when a signal judged before it asks (queue
    time, judged first, when it tells an event or pages)."""

    read: Callable[[], float]
    ratio: float | None = None

    def __call__(self) -> float:
        if self.ratio is None:
            self.ratio = self.read()
        return self.ratio


#: The cache's events are told before TTFT's model is read: "demand as usual".
_NO_DEMAND = _Demand(read=lambda: math.nan, ratio=math.nan)


@dataclass(slots=True)
class SegmentDetectors:
    """Every signal's detector for one segment, created as the signal first shows data."""

    key: str
    config: DetectorConfig = field(default_factory=DetectorConfig)
    # Recent load, the baseline and every model's learned numbers, one after another
    # (``_FRESH``, ``models.stats.compact``); models are made as views when a window is judged.
    # The load is kept for ``LOAD_MEMORY`` windows: a request finishing now was queued and
    # prefilled up to a few windows ago, under the load of then; judged against the load of
    # now alone, the end of a surge looks like a fault.
    numbers: array[float] = field(default_factory=lambda: array("d", _FRESH))
    layout: Layout = _NO_MODELS
    # Signals with an incident in progress or a run of anomalous windows: few at any time,
    # so their lifecycle costs nothing per segment the rest of the time.
    active: dict[Signal, SignalDetector] | None = None
    last_window_end: float = -math.inf
    # Windows judged since ``state()`` was last taken for storage (below 0: windows before
    # its first turn, see ``DetectorBank.segment``), and whether an incident or a run of
    # anomalous windows moved since: that is stored at once, whatever the cadence.
    unsaved: int = 0
    transitioned: bool = False
    # Start of the first window judged since ``state()`` was last taken (inf: none): what a
    # crash now would have to judge again (``DetectorBank.stored_until``).
    unsaved_from: float = math.inf

    @property
    def usual(self) -> Baseline:
        """The segment's normal figures (a view on ``numbers``)."""
        return _BASELINE.view(self.numbers, _USUAL_AT)

    @property
    def capacity(self) -> Capacity:
        """Arrivals of the segment's model and what its engines can serve (a view on ``numbers``)."""
        return _CAPACITY.view(self.numbers, _CAPACITY_AT)

    @property
    def recent_load(self) -> list[list[float]]:
        """The model load of recent windows, oldest first, as [window end, *MODEL_FIGURES]."""
        runs = [self.numbers[i : i + _LOAD_RUN].tolist() for i in range(0, _USUAL_AT, _LOAD_RUN)]
        return [run for run in runs if run[0] > -math.inf]

    def _keep_load(self, runs: list[list[float]]) -> None:
        runs = runs[-LOAD_MEMORY:]
        padded = [_NO_LOAD] * (LOAD_MEMORY - len(runs)) + runs
        self.numbers[0:_USUAL_AT] = array("d", [value for run in padded for value in run])

    def model(self, spec: SignalSpec, borrow: BetaBinomialRate | None = None) -> Any:
        """The segment's model of ``spec``'s signal (a view on ``numbers``), built the first
        time the signal shows data."""
        at = self.layout.offset(spec.signal)
        if at is not None:
            model = _template(spec.signal, self.config.grace_windows, self.config.source).view(self.numbers, at)
        else:
            fresh = spec.build(self.config.grace_windows)
            at = fresh.append_to(self.numbers)
            self.layout = self.layout.extended(spec.signal, fresh.STATE_SIZE)
            model = fresh.view(self.numbers, at)
        if borrow is not None and borrow.n_learned >= self.config.grace_windows:
            # A segment's rate is judged with its model's beside its own (a prior that stays,
            # ``BetaBinomialRate.borrow``): a new segment starts from it, not a generic prior,
            # and one that never saw a bad request is not sure it never will. Taken again every
            # window: it follows the model's rate as that moves.
            model.borrow(borrow.expected_rate, borrow.strength)
        return model

    def detector(self, spec: SignalSpec, borrow: BetaBinomialRate | None = None) -> SignalDetector:
        """The signal in judgement: its active state if it has one, else a fresh, idle one."""
        active = self.active.get(spec.signal) if self.active else None
        return active if active is not None else SignalDetector(spec, self.model(spec, borrow))

    def keep(self, detector: SignalDetector) -> None:
        """Remember ``detector`` while it is active; forget it once idle."""
        signal = detector.spec.signal
        if detector.tracker is not None or detector.run or detector.shortfall:
            if self.active is None:
                self.active = {}
            self.active[signal] = detector
        elif self.active is not None and self.active.pop(signal, None) is not None and not self.active:
            self.active = None

    def judged(self, window: WindowStats) -> bool:
        """Whether ``window`` ends no later than the last one judged here: a replay after a
        crash, or a backlog older than this segment's state."""
        return window.end <= self.last_window_end

    def observe(
        self,
        window: WindowStats,
        pooled: dict[tuple[str, Signal], BetaBinomialRate],
        templates: dict[tuple[str, Any], Any] | None = None,
        series: list[SeriesPoint] | None = None,
        tolerances: Tolerances | None = None,
    ) -> list[AnomalyEvent]:
        """Judge one window (latency against its model's load, ``WindowStats.load``); with
        ``series``, append what each signal showed against its expected band (for charts)."""
        if self.judged(window):
            return []  # a replayed window changes nothing (idempotent)
        self.last_window_end = window.end
        self.unsaved += 1
        if self.unsaved_from == math.inf:
            self.unsaved_from = window.start
        templates = {} if templates is None else templates
        config = self.config
        load = window.load()
        self._with_recent_load(load, window)
        model_name = window.labels.get("model", "other")
        capacity = self.capacity
        self._borrow_or_lend_capacity(capacity, model_name, templates)
        capacity.observe(window, load)
        events: list[AnomalyEvent] = []
        points: dict[str, SignalPoint] | None = {} if series is not None else None
        any_page = False
        usual = self.usual  # one view for the whole window
        usual_requests = usual.requests_per_s * window.length
        sparse = usual.windows >= config.grace_windows and window.requests < config.min_share_of_usual * usual_requests
        cache_failing = False  # the segment's prefix cache pages (this window, or its incident does)
        queue_paging = False  # the segment's queue pages this window, as a fault (not load)
        demand = _Demand(functools.partial(self._ttft_demand_ratio, window, load, sparse))
        for spec in _judging_specs(config.source, config.signals):
            if sparse and spec.kind == "latency":
                continue
            reading = spec.read(window, load)
            if reading is None or (spec.kind != "rate" and reading.n < config.min_requests):
                continue
            pool_key = (model_name, spec.signal)
            pool = pooled.get(pool_key) if spec.kind == "rate" else None
            detector = self.detector(spec, pool)
            widened = (tolerances.config_for(model_name, spec.signal.value, config, window.end)
                       if tolerances is not None and tolerances.until else None)  # fmt: skip
            verdict = detector.judge(reading, widened or config)
            if spec.signal is Signal.CACHE_HIT_RATE:
                cache_failing = verdict.pages or detector.paging
            elif cache_failing and spec.signal in PREFILL_SIGNALS:
                _corroborate(verdict, reading, widened or config)
            elif spec.signal is Signal.QUEUE_TIME and verdict.pages and not verdict.explained:
                # A queue that a surge or saturated engines built is the load group's story,
                # however its capacity reads: TTFT then judges itself.
                queue_paging = not demand_explains({**load, "demand_vs_usual": demand()}, window.length)
            elif (
                queue_paging
                and spec.signal in (Signal.TTFT, Signal.E2E)
                and queue_makes_up(spec.signal, reading.x, reading.value)
            ):
                _corroborate(verdict, reading, widened or config, cause=None)
            any_page |= verdict.pages
            if spec.signal is Signal.TTFT:  # read here anyway: the signals after it need no second look
                demand.ratio = _demand_ratio(detector, reading)
            if spec.signal in (Signal.TTFT, Signal.QUEUE_TIME) and verdict.score < config.unusual:
                capacity.settle()  # no queue to speak of (not merely below paging): none to explain
            if detector.learn_if_normal(reading, verdict):
                if spec.kind == "rate":
                    pool = pooled.get(pool_key) or pooled.setdefault(pool_key, BetaBinomialRate(grace_windows=0))
                    pool.learn_one(reading.x, reading.bad)
                elif spec.kind == "latency":
                    self._borrow_or_lend(detector.model, pool_key, templates)
            adopted = detector.note_run(verdict.pages, reading, config.adopt_after)
            told = _NO_DEMAND if spec.signal is Signal.CACHE_HIT_RATE else demand
            # ``usual`` learns this window only after the loop: hints compare against the past.
            event = self._transition(detector, window, reading, verdict, load, usual, told, adopted)
            if adopted:
                detector.adopt(reading)
            if points is not None:
                # model_construct: built per segment window on the hot path, from numbers the
                # detector made; validation would cost more than the judging.
                low, high = band(spec.kind, verdict, reading, (widened or config).threshold)
                points[spec.signal.value] = SignalPoint.model_construct(
                    observed=reading.value, expected=verdict.expected, low=low, high=high,
                    score=verdict.score, anomalous=verdict.pages, firing=detector.firing,
                )  # fmt: skip
            self.keep(detector)
            if event is not None:
                events.append(event)
        if series is not None and points:
            series.append(SeriesPoint.model_construct(
                schema_version=SCHEMA_VERSION, kind="series", key=self.key, segment=dict(window.labels),
                window_start=window.start, window_end=window.end, load=dict(load), signals=points,
            ))  # fmt: skip
        if not any_page:
            usual.learn(load, window.start)
            capacity.learn(load)
        if events or self.active:
            self.transitioned = True
        return events

    def _ttft_demand_ratio(self, window: WindowStats, load: dict[str, float], sparse: bool) -> float:
        """This window's demand against the usual, as TTFT's model reads it (NaN where TTFT is
        not judged in it, or its model has learned nothing yet)."""
        config = self.config
        if Signal.TTFT.value not in config.signals or sparse:
            return math.nan
        spec = SPEC_SETS[config.source][Signal.TTFT]
        reading = spec.read(window, load)
        if reading is None or reading.n < config.min_requests:
            return math.nan
        return _demand_ratio(self.detector(spec, None), reading)

    @staticmethod
    def _borrow_or_lend_capacity(capacity: Capacity, model_name: str, templates: dict[tuple[str, Any], Any]) -> None:
        """Capacity is the model's, not the segment's: a segment that has seen too few windows
        to know it (a rare prompt band) takes the best-known segment's of its model."""
        key = (model_name, "capacity")
        best = templates.get(key)
        if best is not None and capacity.borrow(best):
            return
        if best is None or capacity.windows > best.windows:
            templates[key] = capacity

    @staticmethod
    def _borrow_or_lend(model: Any, key: tuple[str, Any], templates: dict[tuple[str, Any], Any]) -> None:
        """Latency cold start: a segment's first window borrows the response to load of the
        best-known segment of its model; the best-known one is remembered (a reference,
        one per model and signal)."""
        best = templates.get(key)
        if model.n_learned == 1 and best is not None:
            model.borrow(best)
        elif best is None or model.n_learned > best.n_learned:
            templates[key] = model

    def _with_recent_load(self, load: dict[str, float], window: WindowStats) -> None:
        """Set ``load``'s model figures to their peak over this window and the recent ones."""
        names = [f"model_{name}" for name in MODEL_FIGURES]
        horizon = window.start - LOAD_MEMORY * window.length
        kept = [run for run in self.recent_load if run[0] > horizon]
        now = [load[name] for name in names]
        for _end, *figures in kept:
            for name, value in zip(names, figures, strict=True):
                load[name] = max(load[name], value)
        self._keep_load([*kept, [window.end, *now]])

    def _transition(
        self,
        detector: SignalDetector,
        window: WindowStats,
        reading: Reading,
        verdict: Verdict,
        load: dict[str, float],
        usual: Baseline,
        demand: Callable[[], float],
        adopted: bool,
    ) -> AnomalyEvent | None:
        config, spec = self.config, detector.spec
        anomalous, level = detector.for_lifecycle(verdict, config)
        if detector.tracker is None:
            if not anomalous:
                return None
            detector.tracker = config.tracker()
        elif anomalous and detector.tracker.reopens(paging=verdict.pages) is False:
            # Back soon after resolving, but the other kind (a page after load's info event, or
            # the reverse): a new incident, not the old one reopened under its fingerprint.
            detector.tracker = config.tracker()
        tracker = detector.tracker
        severity = Severity(level)
        if adopted and tracker.firing:
            transition: Transition | None = Transition.RESOLVED
            tracker.end_by_adoption()
        else:
            transition = tracker.step(
                anomalous, window_start=window.start, severity=severity.value, sustained=verdict.sustained
            )
        incident_start = tracker.incident_start or window.start
        if tracker.idle:
            detector.tracker = None  # most signals are normal most of the time: keep nothing
        if transition is None:
            return None
        demand_ratio = demand()
        labels = window.labels
        who = f"{spec.what} for {segment_phrase(labels)}"
        observed, expected = with_unit(reading.value, spec.unit), with_unit(verdict.expected, spec.unit)
        hints: list[Hint] = []
        explained = verdict.explained
        if transition is Transition.RESOLVED:
            severity = Severity(tracker.severity or Severity.INFO.value)
            explained = False
            if adopted:
                hints = [
                    Hint(
                        code="level_shift",
                        message=f"the new level held for {config.adopt_after} windows and is now the baseline",
                    )
                ]
                summary = f"Level change: {who} has stayed at {observed}; adopted as the new normal."
            else:
                summary = f"Resolved: {who} is back to {observed} against {expected} expected."
        else:
            if spec.kind == "latency":
                hints = latency_hints(load, usual, explained_by_load=explained, signal=spec.signal,
                                      cause=verdict.cause)  # fmt: skip
            if not explained:  # explained by load: the load is the cause, not the signal's own fault
                known = {hint.code for hint in hints}  # the load-side reading of a cause ranks first
                hints += [h for h in signal_hints(spec.signal, window, reading.value, verdict.expected)
                          if h.code not in known]  # fmt: skip
            if not hints and spec.kind == "latency":
                hints.append(fallback_hint(spec.what))  # every event names a likely cause
            learned = detector.model.n_learned
            if learned < config.young_windows and not explained:
                hints.append(
                    Hint(
                        code="new_segment",
                        message=f"this segment's baseline has {learned} windows behind it (young below "
                        f"{config.young_windows}): a new workload, or one judged against its model's usual",
                    )
                )
            summary = window_summary(spec, who, observed, expected, reading, verdict, load, demand_ratio, hints)
        return incident_event(
            key=self.key,
            signal=spec.signal,
            incident_start=incident_start,
            transition=transition,
            labels=labels,
            window=(window.start, window.end),
            observed=reading.value,
            expected=verdict.expected,
            score=verdict.score,
            severity=severity,
            load={
                **{k: round(v, 4) for k, v in load.items() if math.isfinite(v)},  # NaN: not measured
                "demand_vs_usual": round(demand_ratio if math.isfinite(demand_ratio) else 1.0, 3),
            },
            explained_by_load=explained,
            hints=hints,
            pointers=self._evidence(window, spec, usual) if transition is not Transition.RESOLVED else (),
            summary=summary,
            baseline_young=detector.model.n_learned < config.young_windows,
        )

    @staticmethod
    def _evidence(window: WindowStats, spec: SignalSpec, usual: Baseline) -> tuple[EvidencePointer, ...]:
        """Pointers that ``pipeline.worker.evidence`` fills in: a sample of the window and one of the
        segment's latest normal window (``models.explain.evidence_sample``; stage 2 adds the ranges of
        the latter, ``RecentSources``), and the worst requests by the event's signal: TTFT's
        slowest, kept by the fold; the sample's slowest by another phase; or, for a rate
        event, the sample's requests it counted as bad."""
        sources = getattr(window, "sources", None)  # an engine's window has no requests
        if not sources:
            return window.kept_requests() if spec.kind == "latency" else ()
        pointers: list[EvidencePointer] = []
        if spec.signal is Signal.TTFT:
            pointers.extend(window.kept_requests())
        elif spec.signal in SLOWNESS:  # the window sample's slowest by the signal's own measure
            pointers.append(WorstBy(signal=spec.signal))
        if spec.signal in FAULT_SIGNALS:
            pointers.append(FaultScan(signal=spec.signal))
        pointers.append(WindowSample(sample="anomalous", segment=window.key, window_start=window.start,
                                     window_end=window.end, sources=tuple(tuple(s) for s in sources)))  # fmt: skip
        before = usual.last_window_start
        if math.isfinite(before) and before < window.start:
            pointers.append(WindowSample(sample="baseline", segment=window.key, window_start=before,
                                         window_end=before + window.length))  # fmt: skip
        return tuple(pointers)

    # -- compact state -------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """JSON-ready, versioned: what a changelog-backed table keeps per segment."""
        specs = SPEC_SETS[self.config.source]
        models = {signal: self.model(specs[signal]) for signal in self.layout.signals}
        return {
            "v": STATE_VERSION,
            "last_window_end": self.last_window_end if math.isfinite(self.last_window_end) else None,
            # NaN (not seen yet) as null: strict JSON, as Kafka tooling expects
            "usual": self.usual.state(),
            "capacity": self.capacity.state(),
            "recent_load": [value for run in self.recent_load for value in run],
            "signals": {
                signal.value: {
                    "model": model.state(),
                    "tracker": None
                    if (d := (self.active or {}).get(signal)) is None or d.tracker is None
                    else d.tracker.state(),
                    "run": [d.run, d.run_total, d.shortfall] if d is not None else [0, 0.0, 0.0],
                }
                for signal, model in models.items()
            },
        }

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("v") not in READABLE_VERSIONS:
            raise ValueError(f"detector state version {state.get('v')!r}, this build reads {READABLE_VERSIONS}")
        end = state["last_window_end"]
        self.last_window_end = -math.inf if end is None else float(end)
        self.usual.load_state(state["usual"])
        self.capacity.load_state(state["capacity"])
        flat = [float(value) for value in state["recent_load"]]
        if len(flat) % _LOAD_RUN or len(flat) > _USUAL_AT:
            raise ValueError(f"recent load of {len(flat)} numbers")
        self._keep_load([flat[i : i + _LOAD_RUN] for i in range(0, len(flat), _LOAD_RUN)])
        specs = SPEC_SETS[self.config.source]
        for name, saved in state["signals"].items():
            spec = specs[Signal(name)]
            detector = self.detector(spec)
            detector.model.load_state(saved["model"])
            if saved["tracker"] is not None:
                detector.tracker = self.config.tracker()
                detector.tracker.load_state(saved["tracker"])
            detector.run, detector.run_total = int(saved["run"][0]), float(saved["run"][1])
            detector.shortfall = float(saved["run"][2]) if len(saved["run"]) > 2 else 0.0
            self.keep(detector)
