"""The detection scenario suite: injected faults the detector must catch, and changes it must not page on.

Each ``Scenario`` is a ``Workload`` (normal traffic, then one injected condition) with the
signals that must page during the injected phase. ``run_scenario`` replays it through the
same code the worker runs (``Replay``: windows, detectors, lifecycle) and reports what
paged, when, and where. ``tests/test_scenarios.py`` asserts each case; ``bench/detection.py``
prints the whole table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.replay import Replay
from pipeline.settings import Settings
from pipeline.workload import Phase, Workload
from schemas.anomaly import AnomalyEvent, Signal

#: Normal traffic before each injected condition: enough windows for every baseline.
WARMUP_S = 600.0
INJECTED_S = 300.0
#: Normal traffic after the fault: incidents resolve, and nothing else may page.
RECOVERY_S = 180.0
#: Event seconds after the fault ends during which its pages still count as its own.
AFTERMATH_S = 60.0


@dataclass(frozen=True)
class Scenario:
    name: str
    injected: Phase
    must_page: frozenset[Signal]  # each of these pages during the injected phase
    workload: dict[str, Any] = field(default_factory=dict)  # extra ``Workload`` arguments
    warmup_s: float = WARMUP_S
    description: str = ""

    def build(self, seed: int = 7) -> Workload:
        phases: tuple[Phase, ...] = (Phase("normal", self.warmup_s),)
        if self.injected.duration_s:
            phases += (self.injected, Phase("recovery", RECOVERY_S))
        return Workload(phases, seed=seed, **self.workload)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "cache_off",
        Phase("cache_off", INJECTED_S, prefix_caching=False),
        frozenset({Signal.TTFT, Signal.PREFILL_TIME, Signal.CACHE_HIT_RATE}),
        description="prefix caching switched off at flat traffic",
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
    ),
    Scenario(
        "decode_slow",
        Phase("decode_slow", INJECTED_S, decode_slowdown=2.0),
        frozenset({Signal.ITL, Signal.THROUGHPUT}),
        description="decode 2x slower at equal traffic",
    ),
    Scenario(
        "errors",
        Phase("errors", INJECTED_S, error_rate=0.05),
        frozenset({Signal.ERROR_RATE}),
        description="5 % of requests fail",
    ),
    Scenario(
        "long_prompts_slow",
        Phase("long_prompts_slow", INJECTED_S, long_prompt_slowdown=3.0),
        frozenset({Signal.PREFILL_TIME}),
        description="prefill 3x slower for prompts of 4k tokens and more only",
    ),
    Scenario(
        "daily_cycle",
        Phase("normal", 0.0),
        frozenset(),
        workload={"daily_amplitude": 0.5, "day_s": 7200.0, "base_rate": 4.0},
        warmup_s=4 * 3600.0,
        description="two compressed days (2 h each) of traffic swinging ±50 %: nothing pages",
    ),
)

BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}


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

    @property
    def pages(self) -> list[AnomalyEvent]:
        return [e for e in self.events if e.pages and e.window_end <= self.stream_end]

    def _in_fault(self, event: AnomalyEvent) -> bool:
        return event.window_end > self.injected_at and event.window_start < self.injected_end + AFTERMATH_S

    @property
    def false_pages(self) -> list[AnomalyEvent]:
        """Pages outside the injected phase (and its aftermath)."""
        return [e for e in self.pages if not self._in_fault(e)]

    @property
    def paged_signals(self) -> frozenset[Signal]:
        return frozenset(e.signal for e in self.pages if self._in_fault(e))

    def first_page_delay(self, signal: Signal) -> float | None:
        """Event seconds from the start of the injected phase to the end of the first paging window."""
        ends = [e.window_end for e in self.pages if e.signal is signal and e.window_end > self.injected_at]
        return min(ends) - self.injected_at if ends else None

    @property
    def caught(self) -> bool:
        return self.scenario.must_page <= self.paged_signals and not self.false_pages


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
        scenario, events, injected_at, injected_at + scenario.injected.duration_s, workload.start + workload.duration_s,
        engine.stats.records, elapsed,
    )  # fmt: skip
