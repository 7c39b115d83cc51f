"""The detection scenario suite: injected faults the detector must catch, and changes it must not page on.

Three families, so that the simulator servewatch was built with is one voice among several:

* ``synthetic``: the bundled generator (``pipeline.dev.simulator``: Poisson arrivals, smooth
  queueing). Each fault there is one the detector was designed around.
* ``real arrivals``: public arrival traces (Mooncake conversations, Azure code; bundled
  samples) played through engines with a hard slot limit and a FIFO queue
  (``pipeline.dev.serving_sim``): natural bursts that fill every slot for a while, a 2.5x surge
  that overloads the fleet, a low-volume model, and faults placed away from the detector's
  band edges (prompts above 16k tokens, inside the 4k-32k band).
* ``real GPU runs``: real per-request latencies of load tests on a real server
  (``pipeline.dev.real_runs``), healthy, with TTFT x4 and the prefix cache gone injected in the
  middle third at the same concurrency, and one run's own real degradation late on.
* ``pager day``: what on-call lives with. Both models on their real traces through
  engines with a KV-cache budget (``serving_sim.PAGER_FLEET``), with the background of failed
  and cut requests every real fleet has: a simulated day with its daily cycle, three busy
  hours of it (judged after three hours of history: a deployed detector has some), the same
  hours with a 20-minute 2.5x surge, none of which may page; and two faults on the same
  traffic that must (an error burst in one segment, half the slots lost). A week
  with its daily and weekly cycle is there too (``PAGER_WEEK``), not in the default suite:
  it is slow. Not in ``SCENARIOS`` (whose cases the tests assert pass): this family is the
  bench's record of the false pages still to fix, counted as a pager receives them
  (``ScenarioResult.group_pages``: incident groups starting to page).

Each ``Scenario`` is a workload (normal traffic, then one injected condition, then normal
traffic again) with the signals that must page during the injected phase and the likely
cause each must name first. ``run_scenario`` replays it through the code the worker runs
(``Replay``: windows, detectors, lifecycle) and reports what paged, when and where.
``tests/test_scenarios.py`` and ``tests/test_real_traffic.py`` assert the cases;
``bench/detection.py`` prints the whole table, per family, beside naive detectors.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.dev.real_runs import HEALTHY_S, Injection, RealRunWorkload
from servewatch.pipeline.dev.serving_sim import (
    CHAT_MODEL,
    LOW_VOLUME_MODEL,
    PAGER_CHAT_MODEL,
    PAGER_FLEET,
    SimPhase,
    TraceWorkload,
)
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.dev.traffic_cycles import DAY_S, WEEK_S, cycle_phases, splice
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.pipeline.settings import Settings
from servewatch.schemas.anomaly import AnomalyEvent, Severity, Signal, Status
from servewatch.schemas.incident_group import IncidentGroup

#: Normal traffic before each injected condition: enough windows for every baseline.
WARMUP_S = 600.0
INJECTED_S = 300.0
#: Normal traffic after the fault: incidents resolve, and nothing else may page.
RECOVERY_S = 180.0
#: Event seconds after the fault ends during which its pages still count as its own; on real
#: arrivals through slot-limited engines, a fault that let a queue build leaves a backlog
#: that takes minutes to drain, and its pages then are still the fault's.
AFTERMATH_S = 60.0
TRACE_AFTERMATH_S = 300.0
#: On real arrivals the detector has run for half an hour before the fault (a deployment's
#: detector has history), and the recovery is long enough for a surge's backlog to drain.
TRACE_WARMUP_S = 1800.0
TRACE_RECOVERY_S = 1200.0

FAMILIES = ("synthetic", "real arrivals", "real GPU runs", "pager day")


@dataclass(frozen=True)
class Scenario:
    name: str
    injected: Phase | None  # the synthetic generator's injected phase (None: ``make`` builds it all)
    must_page: frozenset[Signal]  # each of these pages during the injected phase
    workload: dict[str, Any] = field(default_factory=dict)  # extra ``Workload`` arguments
    warmup_s: float = WARMUP_S  # seconds of normal traffic before the injected phase
    description: str = ""
    family: str = "synthetic"
    make: Callable[[int], Any] | None = None  # seed -> a workload (``seconds()``, ``start``, ``duration_s``)
    injected_s: float | None = None  # the injected phase's length, when ``make`` builds the workload
    #: The likely cause the first page of a signal names first (hint code), where it matters.
    top_hint: tuple[tuple[Signal, str], ...] = ()
    #: Signals that may page outside the injected phase (a run's own real degradation).
    after_fault: bool = False
    aftermath_s: float = AFTERMATH_S
    #: Seconds from the start that are the detector's history, not judged: a deployed detector
    #: has run for hours before any stretch on-call counts pages in (its rate models have
    #: learned a background error rate of 0.05 %, not their 0.5 % prior).
    judged_from_s: float = 0.0

    def build(self, seed: int = 7) -> Any:
        if self.make is not None:
            return self.make(seed)
        assert self.injected is not None, "a scenario needs an injected phase or a workload maker"
        phases: tuple[Phase, ...] = (Phase("normal", self.warmup_s),)
        if self.injected.duration_s:
            phases += (self.injected, Phase("recovery", RECOVERY_S))
        return Workload(phases, seed=seed, **self.workload)

    @property
    def injected_duration_s(self) -> float:
        if self.injected_s is not None:
            return self.injected_s
        return self.injected.duration_s if self.injected is not None else 0.0


def _on_traces(
    name: str, injected: SimPhase, must_page: frozenset[Signal], description: str, *,
    low_volume: bool = False, top_hint: tuple[tuple[Signal, str], ...] = (), recovery_s: float = TRACE_RECOVERY_S,
) -> Scenario:  # fmt: skip
    """A scenario on real arrival traces: the chat model (Mooncake) alone, or the low-volume one."""
    model = LOW_VOLUME_MODEL if low_volume else CHAT_MODEL
    phases = (SimPhase("normal", TRACE_WARMUP_S), injected, SimPhase("recovery", recovery_s))

    def make(seed: int) -> TraceWorkload:
        return TraceWorkload(phases, models=(model,), seed=seed)

    return Scenario(
        name, None, must_page, warmup_s=TRACE_WARMUP_S, description=description, family="real arrivals",
        make=make, injected_s=injected.duration_s, top_hint=top_hint, aftermath_s=TRACE_AFTERMATH_S,
    )  # fmt: skip


def _on_real_run(run: str, injected: bool) -> Scenario:
    """A real GPU run's healthy stretch, as recorded or with TTFT x4 and no cached tokens in its middle third."""
    first, last = HEALTHY_S[run]
    injection = Injection.middle_third(run, ttft_factor=4.0, drop_cache=True) if injected else None

    def make(seed: int) -> RealRunWorkload:
        return RealRunWorkload(run, injection=injection, healthy_only=True, seed=seed)

    start = injection.start_s if injection is not None else last
    return Scenario(
        f"{run}{'_ttft_x4' if injected else '_healthy'}", None,
        frozenset({Signal.TTFT, Signal.CACHE_HIT_RATE}) if injected else frozenset(),
        warmup_s=start - first,
        description=("TTFT x4 and cached_tokens 0 in the middle third, same concurrency" if injected
                     else "the healthy stretch as recorded (concurrency stepped up and down)"),
        family="real GPU runs", make=make,
        injected_s=(injection.end_s - injection.start_s) if injection is not None else 0.0,
        top_hint=((Signal.TTFT, "prefix_cache_ineffective"), (Signal.CACHE_HIT_RATE, "prefix_cache_ineffective"))
        if injected else (),
    )  # fmt: skip


def _real_degradation() -> Scenario:
    """The dram_only run whole: its offload tier thrashes from launch 779 s on (TTFT 4x at the
    same concurrency, fewer completions), a real fault nobody injected."""
    first, last = HEALTHY_S["dram_only"]
    return Scenario(
        "dram_only_degrades", None, frozenset({Signal.TTFT}), warmup_s=last - first,
        description="the run's own degradation: DRAM offload thrashing from 779 s on", family="real GPU runs",
        make=lambda seed: RealRunWorkload("dram_only", seed=seed), injected_s=1800.0 - last, after_fault=True,
    )  # fmt: skip


_PREFIX = "prefix_cache_ineffective"
#: The real GPU runs replayed: each healthy, and with TTFT x4 and no cached tokens injected.
REAL_RUNS = ("gds_dram", "dram_only", "cacherate_sustained")

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "cache_off",
        Phase("cache_off", INJECTED_S, prefix_caching=False),
        frozenset({Signal.TTFT, Signal.PREFILL_TIME, Signal.CACHE_HIT_RATE}),
        description="prefix caching switched off at flat traffic",
        top_hint=((Signal.TTFT, _PREFIX), (Signal.PREFILL_TIME, _PREFIX), (Signal.CACHE_HIT_RATE, _PREFIX)),
    ),
    Scenario(
        "traffic_tripled",
        Phase("surge", INJECTED_S, traffic=3.0),
        frozenset(),
        description="traffic tripled: latency rises with load, nothing pages",
    ),
    Scenario(
        "truncation",
        Phase("truncation", INJECTED_S, max_tokens=1000, leak_rate=0.03),
        frozenset({Signal.LENGTH_TRUNCATION, Signal.REASONING_LEAK}),
        workload={"log_content": True},
        description="max_tokens lowered (~3 % of answers cut) and a reasoning marker leaking",
        top_hint=(
            (Signal.LENGTH_TRUNCATION, "output_truncated"),
            (Signal.REASONING_LEAK, "reasoning_marker_in_content"),
        ),
    ),
    Scenario(
        "decode_slow",
        Phase("decode_slow", INJECTED_S, decode_slowdown=2.0),
        frozenset({Signal.ITL, Signal.THROUGHPUT}),
        description="decode 2x slower at equal traffic",
        top_hint=((Signal.ITL, "decode_slowdown"), (Signal.THROUGHPUT, "decode_slowdown")),
    ),
    Scenario(
        "errors",
        Phase("errors", INJECTED_S, error_rate=0.05),
        frozenset({Signal.ERROR_RATE}),
        description="5 % of requests fail",
        top_hint=((Signal.ERROR_RATE, "error_burst"),),
    ),
    Scenario(
        "long_prompts_slow",
        Phase("long_prompts_slow", INJECTED_S, long_prompt_slowdown=3.0),
        frozenset({Signal.PREFILL_TIME}),
        description="prefill 3x slower for prompts of 4k tokens and more only",
        top_hint=((Signal.PREFILL_TIME, "prefill_bound"),),
    ),
    Scenario(
        "daily_cycle",
        Phase("normal", 0.0),
        frozenset(),
        workload={"daily_amplitude": 0.5, "day_s": 7200.0, "base_rate": 4.0},
        warmup_s=4 * 3600.0,
        description="two compressed days (2 h each) of traffic swinging ±50 %: nothing pages",
    ),
    # -- real arrivals through slot-limited engines -------------------------------------
    _on_traces(
        "bursty_normal",
        SimPhase("normal", 3600.0),
        frozenset(),
        "two and a half hours of Mooncake traffic at 60 % of the slots: its bursts fill them now and then",
        recovery_s=0.0,
    ),
    _on_traces(
        "saturating_surge",
        SimPhase("surge", INJECTED_S, traffic=2.5),
        frozenset(),
        "a 2.5x surge that overloads every slot (minutes of queue): explained by load, no page",
    ),
    _on_traces(
        "trace_cache_off",
        SimPhase("cache_off", INJECTED_S, prefix_caching=False),
        frozenset({Signal.TTFT, Signal.CACHE_HIT_RATE}),
        "prefix caching off on Mooncake traffic (~37 % reusable)",
        top_hint=((Signal.TTFT, _PREFIX), (Signal.CACHE_HIT_RATE, _PREFIX)),
    ),
    _on_traces(
        "long_prompts_4x",
        SimPhase("long_slow", INJECTED_S, prefill_slowdown=4.0, slow_prompt_tokens=16_000),
        frozenset({Signal.PREFILL_PER_TOKEN}),
        "prefill 4x slower above 16k prompt tokens only (inside the 4k-32k band)",
        top_hint=((Signal.PREFILL_PER_TOKEN, "prefill_bound"),),
    ),
    _on_traces(
        "trace_decode_slow",
        SimPhase("decode_slow", INJECTED_S, decode_slowdown=2.0),
        frozenset({Signal.ITL, Signal.THROUGHPUT}),
        "decode 2x slower on Mooncake traffic",
        top_hint=((Signal.ITL, "decode_slowdown"), (Signal.THROUGHPUT, "decode_slowdown")),
    ),
    _on_traces(
        "capacity_halved",
        SimPhase("half_slots", INJECTED_S, capacity_factor=0.5),
        frozenset({Signal.TTFT, Signal.QUEUE_TIME}),
        "half of every engine's slots lost at usual demand",
        top_hint=((Signal.QUEUE_TIME, "capacity_lost"), (Signal.TTFT, "capacity_lost")),
    ),
    _on_traces(
        "low_volume_prefill_2x",
        SimPhase("prefill_2x", INJECTED_S, ttft_factor=2.0),
        frozenset({Signal.PREFILL_PER_TOKEN}),
        "prefill 2x slower on a model of 10-30 requests per window",
        low_volume=True,
        top_hint=((Signal.PREFILL_PER_TOKEN, "prefill_bound"),),
    ),
    # -- real GPU load tests ---------------------------------------------------------------
    *(_on_real_run(run, injected) for run in REAL_RUNS for injected in (False, True)),
    _real_degradation(),
)


# -- the pager day: normal traffic as on-call lives with it ---------------------------------

#: Three normal hours are the busy afternoon (13:00-16:00) of the daily cycle, judged after
#: three hours of the morning's ramp (from 10:00) that are the detector's history; the
#: faults and the surge sit in them, on the same traffic.
PAGER_FROM_S = 10 * 3600.0  # time of day the hours' runs start
PAGER_HISTORY_S = 3 * 3600.0
PAGER_HOURS_S = 3 * 3600.0
PAGER_FAULT_AT_S = PAGER_HISTORY_S + 5400.0  # 14:30
PAGER_SURGE_AT_S = PAGER_HISTORY_S + 4800.0  # 14:20-14:40
PAGER_SURGE_S = 1200.0
#: The error burst: 10 failed requests in one minute, all in one segment (the chat model's
#: prompts of 1,000-3,000 tokens, ~35 a minute: inside the <4k band, answers under 1k).
ERROR_BURST_S = 60.0
ERROR_BURST_COUNT = 10
ERROR_BURST_PROMPTS = (1000, 3000)
#: The day's first hour: the baselines' fixed threshold learns there (servewatch judges it too).
PAGER_LEARN_S = 3600.0


def _pager(
    name: str, phases: Callable[[], tuple[SimPhase, ...]], description: str, *,
    must_page: frozenset[Signal] = frozenset(), fault_at_s: float = PAGER_HISTORY_S, fault_s: float = 0.0,
    top_hint: tuple[tuple[Signal, str], ...] = (), judged_from_s: float = PAGER_HISTORY_S,
) -> Scenario:  # fmt: skip
    """A pager-day run: the pager fleet (both models, KV budgets, background errors and cut
    answers) on ``phases``, built when the run is (so importing the suite reads no trace); the
    injected phase is the one that starts at ``fault_at_s``, where there is one."""

    def make(seed: int) -> TraceWorkload:
        built = phases()
        starts = [round(sum(p.duration_s for p in built[:k]), 3) for k in range(len(built))]
        fault = starts.index(round(fault_at_s, 3)) if fault_s else 1
        return TraceWorkload(built, models=PAGER_FLEET, seed=seed, fault_phase=fault)

    return Scenario(
        name, None, must_page, warmup_s=fault_at_s, description=description, family="pager day", make=make,
        injected_s=fault_s, top_hint=top_hint, aftermath_s=TRACE_AFTERMATH_S, judged_from_s=judged_from_s,
    )  # fmt: skip


def _afternoon(injected: SimPhase | None = None, at_s: float = PAGER_FAULT_AT_S) -> tuple[SimPhase, ...]:
    """10:00-16:00 of the daily cycle (the first three hours the detector's history), with
    ``injected`` in force from ``at_s`` seconds after 10:00."""
    phases = cycle_phases(PAGER_HISTORY_S + PAGER_HOURS_S, start_s=PAGER_FROM_S)
    return phases if injected is None else splice(phases, injected, at_s)


PAGER_SCENARIOS: tuple[Scenario, ...] = (
    _pager(
        "pager_day", lambda: cycle_phases(DAY_S),
        "a day from midnight: traffic 40 % of the busy hour at 03:00, 100 % at 15:00, nothing wrong",
        fault_at_s=PAGER_LEARN_S, judged_from_s=0.0,
    ),
    _pager(
        "pager_three_hours", _afternoon,
        "three busy hours (13:00-16:00, after three hours of history), nothing wrong",
    ),
    _pager(
        "pager_surge", lambda: _afternoon(SimPhase("surge", PAGER_SURGE_S, traffic=2.5), PAGER_SURGE_AT_S),
        "the same three hours with a 20-minute 2.5x surge at 14:20: load, not a fault",
    ),
    _pager(
        "pager_error_burst",
        lambda: _afternoon(SimPhase("error_burst", ERROR_BURST_S, error_count=ERROR_BURST_COUNT,
                                    error_prompt_tokens=ERROR_BURST_PROMPTS, models=(PAGER_CHAT_MODEL.name,))),
        f"{ERROR_BURST_COUNT} failed requests in one minute in one chat segment (prompts 1k-3k tokens), at 14:30",
        must_page=frozenset({Signal.ERROR_RATE}), fault_at_s=PAGER_FAULT_AT_S, fault_s=ERROR_BURST_S,
        top_hint=((Signal.ERROR_RATE, "error_burst"),),
    ),
    _pager(
        "pager_capacity_halved",
        lambda: _afternoon(SimPhase("half_slots", INJECTED_S, capacity_factor=0.5, models=(PAGER_CHAT_MODEL.name,))),
        "half of the chat model's slots (and KV memory) lost at usual demand, at 14:30",
        must_page=frozenset({Signal.TTFT, Signal.QUEUE_TIME}), fault_at_s=PAGER_FAULT_AT_S, fault_s=INJECTED_S,
        top_hint=((Signal.QUEUE_TIME, "capacity_lost"), (Signal.TTFT, "capacity_lost")),
    ),
)  # fmt: skip
#: A week from Thursday midnight with its daily cycle and quieter weekends (30 % less):
#: ~2.5 M requests, tens of minutes to replay, so only on request (``bench.detection --week``).
PAGER_WEEK = _pager(
    "pager_week",
    lambda: cycle_phases(WEEK_S, weekend_dip=0.3),
    "seven days with the daily cycle and weekends 30 % quieter, nothing wrong",
    fault_at_s=PAGER_LEARN_S,
    judged_from_s=0.0,
)

#: The signals that see a fault only in requests that show it one way (``simulator.FAULT_SHOWS``).
SHOWN_BY = {Signal.LENGTH_TRUNCATION: "cut", Signal.ERROR_RATE: "failed", Signal.REASONING_LEAK: "leaked"}

BY_NAME = {scenario.name: scenario for scenario in (*SCENARIOS, *PAGER_SCENARIOS, PAGER_WEEK)}


@dataclass(frozen=True)
class GroupPage:
    """An incident group starting to page, as a pager receives it: its first record whose
    severity is above ``info`` (a group that opens as info and steps up to warning pages once,
    when it steps up). On-call counts these, not incidents: one cause on a model is one page,
    however many segments and signals it spans."""

    record: IncidentGroup  # the group record that paged
    event: AnomalyEvent  # the incident event that made the group page
    in_fault: bool  # started paging in the injected fault (or its aftermath)
    #: The group's signals as the window it started paging in closed: incidents of one window
    #: join a group one at a time, and the first to page need not be the one a fault is named by.
    signals: frozenset[Signal] = frozenset()


@dataclass
class ScenarioResult:
    """What a scenario's replay paged. Windows that end after the generated traffic does (the
    stream's drain: a few late, long requests) are left out: real streams do not stop."""

    scenario: Scenario
    events: list[AnomalyEvent]
    injected_at: float  # event time the injected phase starts
    injected_end: float
    stream_end: float
    records: int
    seconds: float  # wall time of the replay
    stream_start: float = 0.0
    #: Per way a request shows the fault (``simulator.FAULT_SHOWS``), when the first such was
    #: logged, where the workload says (``first_faulty_logs``).
    onsets: dict[str, float] = field(default_factory=dict)

    @property
    def first_evidence(self) -> float:
        """Event time from which the fault can be seen in the logs: the injected phase's start,
        or later where the workload knows its first faulty request ended later."""
        return max(self.injected_at, min(self.onsets.values())) if self.onsets else self.injected_at

    def first_evidence_of(self, signal: Signal) -> float:
        """Event time from which ``signal`` can see the fault: a lowered ``max_tokens`` shows
        once a cut answer is logged, however early a leaked marker showed the same fault."""
        way = SHOWN_BY.get(signal)
        if way is None or way not in self.onsets:
            return self.first_evidence
        return max(self.injected_at, self.onsets[way])

    @property
    def judged_from(self) -> float:
        """Event time from which pages count: before it, the detector's history."""
        return self.stream_start + self.scenario.judged_from_s

    @property
    def pages(self) -> list[AnomalyEvent]:
        return [e for e in self.events if e.pages and self.judged_from < e.window_end <= self.stream_end]

    def _in_fault(self, event: AnomalyEvent) -> bool:
        if not self.scenario.must_page:
            return False  # nothing may page: an injected surge is load, not a fault
        if self.scenario.after_fault:
            return event.window_end > self.injected_at
        aftermath_end = self.injected_end + self.scenario.aftermath_s
        return event.window_end > self.injected_at and event.window_start < aftermath_end

    @property
    def false_pages(self) -> list[AnomalyEvent]:
        """Pages of incidents that began outside the injected phase (and its aftermath). An
        incident the fault opened may outlast it: a low-volume segment takes a while to show
        that its rate is back to usual, and its updates until then are the fault's."""
        began: dict[str, AnomalyEvent] = {}
        for event in self.pages:
            began.setdefault(event.fingerprint, event)
        return [e for e in self.pages if not self._in_fault(began[e.fingerprint])]

    @functools.cached_property
    def group_pages(self) -> list[GroupPage]:
        """The run's events through ``IncidentGrouper`` (as the worker's grouping agent and
        ``servewatch replay`` feed it), and each group's start of paging, in order. Records of
        windows after the generated traffic (the drain) are left out, as in ``pages``, and so
        are groups that started paging in the detector's history (``judged_from``)."""
        grouper, paged, pages = IncidentGrouper(), set(), []
        signals: dict[tuple[str, float], set[Signal]] = {}  # (group, window end) -> its signals then
        for event in self.events:
            event, told = grouper.add(event)
            for record in told:
                signals.setdefault((record.group, record.window_end), set()).update(record.signals)
                if record.status is Status.RESOLVED or record.severity is Severity.INFO or record.group in paged:
                    continue
                if record.window_end > self.stream_end:
                    continue
                paged.add(record.group)
                if record.window_end > self.judged_from:
                    pages.append(GroupPage(record, event, self._in_fault(event)))
        return [replace(page, signals=frozenset(signals[page.record.group, page.record.window_end])) for page in pages]

    @property
    def false_group_pages(self) -> list[GroupPage]:
        """Groups that started paging outside the injected fault and its aftermath."""
        return [page for page in self.group_pages if not page.in_fault]

    @property
    def paged_signals(self) -> frozenset[Signal]:
        return frozenset(e.signal for e in self.pages if self._in_fault(e))

    def first_page(self, signal: Signal) -> AnomalyEvent | None:
        pages = [e for e in self.pages if e.signal is signal and self._in_fault(e)]
        return min(pages, key=lambda e: e.window_end) if pages else None

    def first_page_delay(self, signal: Signal) -> float | None:
        """Event seconds from the start of the injected phase to the end of the first paging window."""
        first = self.first_page(signal)
        return None if first is None else first.window_end - self.injected_at

    def windows_to_page(self, signal: Signal, window_s: float = 10.0) -> int | None:
        """Windows from the first that holds a request showing the fault to ``signal`` to the
        first that paged (1: that very window), counting both."""
        first = self.first_page(signal)
        if first is None:
            return None
        return int((first.window_end - window_s * (self.first_evidence_of(signal) // window_s)) // window_s)

    @property
    def caught(self) -> bool:
        return self.scenario.must_page <= self.paged_signals and not self.false_pages

    @property
    def normal_s(self) -> float:
        """Event seconds of normal traffic judged: the stream less the fault and its aftermath."""
        fault = self.stream_end - self.injected_at if self.scenario.after_fault else 0.0
        if self.scenario.must_page and not self.scenario.after_fault:
            fault = self.injected_end + self.scenario.aftermath_s - self.injected_at
        return max(self.stream_end - self.judged_from - fault, 0.0)


def run_scenario(scenario: Scenario, seed: int = 7, settings: Settings | None = None) -> ScenarioResult:
    workload = scenario.build(seed)
    batches = [orjson.dumps(batch) for _, batch in workload.seconds() if batch]
    # The batches stay in memory: evidence (a baseline window's too) is read back from them.
    engine = Replay(settings, reread=lambda n: batches[n] if 0 <= n < len(batches) else None)
    started = time.perf_counter()
    events = list(engine.run(batches))
    elapsed = time.perf_counter() - started
    injected_at = workload.start + scenario.warmup_s
    return ScenarioResult(
        scenario, events, injected_at, injected_at + scenario.injected_duration_s,
        workload.start + workload.duration_s, engine.stats.records, elapsed, workload.start,
        getattr(workload, "first_faulty_logs", {}),
    )  # fmt: skip
