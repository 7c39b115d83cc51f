"""Replica scenarios: one serving instance of a model going bad among healthy peers, and
replicas coming and going with nothing wrong.

The chat model's real arrival trace (Mooncake) through ``instances`` engines behind a
least-loaded balancer (``pipeline.dev.serving_sim``), the fleet sized so that every engine is
busy about 60 % of the time: with 16 replicas the model takes four times the traffic of 4, and
each replica serves about as many requests. A fault hits engine 1 for 20 minutes after half
an hour of history. The real GPU load tests give the same faults on a real server's own
per-request latencies (``RealRunReplicas``). ``bench/replicas.py`` prints the table; ``tests/test_replicas.py`` asserts
a few cases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewatch.pipeline.dev.real_runs import HEALTHY_S, RealRunWorkload
from servewatch.pipeline.dev.scenarios import TRACE_AFTERMATH_S, TRACE_WARMUP_S, Scenario
from servewatch.pipeline.dev.serving_sim import CHAT_MODEL, SimPhase, TraceWorkload, per_second
from servewatch.pipeline.dev.simulator import EPOCH
from servewatch.schemas.anomaly import Signal

FAULT_S = 1200.0
RECOVERY_S = 600.0
#: The engine a fault hits (its host in the records: ``10.0.0.11:8000``).
FAULTY = 1
FAULTY_HOST = "10.0.0.11:8000"

#: What each kind of slowdown slows: (prefill factor, decode factor) per unit of slowdown.
KINDS = {"prefill": (True, False), "decode": (False, True), "both": (True, True)}


def _scenario(
    name: str, instances: int, phases: tuple[SimPhase, ...], must_page: frozenset[Signal], description: str,
    utilisation: float = 0.6,
) -> Scenario:  # fmt: skip
    model = dataclasses.replace(CHAT_MODEL, instances=instances, utilisation=utilisation)

    def make(seed: int) -> TraceWorkload:
        return TraceWorkload(phases, models=(model,), seed=seed)

    injected_s = sum(p.duration_s for p in phases[1:-1])
    return Scenario(
        name, None, must_page, warmup_s=phases[0].duration_s, description=description, family="replicas",
        make=make, injected_s=injected_s, aftermath_s=TRACE_AFTERMATH_S,
    )  # fmt: skip


def slow_replica(instances: int, factor: float, kind: str) -> Scenario:
    """One of ``instances`` replicas prefilling and/or decoding ``factor`` times slower."""
    prefill, decode = KINDS[kind]
    fault = SimPhase(
        "slow_replica", FAULT_S, fault_instances=(FAULTY,),
        instance_prefill_factor=factor if prefill else 1.0, instance_decode_factor=factor if decode else 1.0,
    )  # fmt: skip
    signals = ({Signal.PREFILL_PER_TOKEN} if prefill else set()) | ({Signal.ITL} if decode else set())
    phases = (SimPhase("normal", TRACE_WARMUP_S), fault, SimPhase("recovery", RECOVERY_S))
    return _scenario(
        f"replica_{kind}_{factor:g}x_of_{instances}", instances, phases, frozenset(signals),
        f"one of {instances} replicas {kind} {factor:g}x slower",
    )  # fmt: skip


def failing_replica(instances: int = 4, error_rate: float = 0.05) -> Scenario:
    fault = SimPhase("failing_replica", FAULT_S, fault_instances=(FAULTY,), instance_error_rate=error_rate)
    phases = (SimPhase("normal", TRACE_WARMUP_S), fault, SimPhase("recovery", RECOVERY_S))
    return _scenario(
        f"replica_errors_{error_rate:.0%}_of_{instances}", instances, phases, frozenset({Signal.ERROR_RATE}),
        f"one of {instances} replicas failing {error_rate:.0%} of its requests",
    )  # fmt: skip


def autoscaler(scale_in_traffic: float = 0.6) -> Scenario:
    """An autoscaler following demand: 4 replicas, then 6 as traffic grows 1.5x, then 3 once
    it has fallen to ``scale_in_traffic`` (0.6: each of the 3 about 50 % busy; scaling in
    waits for the load to fall below what the fewer replicas carry at the usual 60 %, as a
    scaler's hysteresis does): nothing wrong. At 0.75 the 3 replicas, as busy as the 4 were,
    queue requests for seconds in the trace's bursts (fewer slots absorb a burst worse):
    that is capacity short, and pages as such."""
    phases = (
        SimPhase("four", TRACE_WARMUP_S, serving_instances=4),
        SimPhase("six", 900.0, traffic=1.5, serving_instances=6),
        SimPhase("three", 900.0, traffic=scale_in_traffic, serving_instances=3),
        SimPhase("three_more", RECOVERY_S, traffic=scale_in_traffic, serving_instances=3),
    )
    # Utilisation is over all 6 engines: 0.4 of 6 is 0.6 of each of the 4 serving at first.
    return _scenario("replicas_autoscaled_4_6_3", 6, phases, frozenset(), "4 -> 6 -> 3 replicas", utilisation=0.4)


def rolling_restart(instances: int = 4, step_s: float = 120.0) -> Scenario:
    """A rolling restart with a surge replica: each replica in turn replaced by a fresh one
    (same address) whose prefix cache starts empty, for ``step_s`` each: nothing wrong."""
    steps = [SimPhase(f"restarted_{k}", step_s, cold_instances=(k,)) for k in range(instances)]
    phases = (SimPhase("normal", TRACE_WARMUP_S), *steps, SimPhase("recovery", RECOVERY_S))
    return _scenario(f"replicas_rolling_restart_of_{instances}", instances, phases, frozenset(), "rolling restart")


@dataclass
class RealRunReplicas:
    """A real GPU load test's healthy stretch (``pipeline.dev.real_runs``) as if served by
    ``instances`` replicas: each request's real latencies, sent to a replica picked at random;
    in the middle third of the launches, replica ``FAULTY`` prefills (its TTFT) and/or decodes
    (the rest of its end-to-end time) ``factor`` times slower. The latencies, their heavy tails
    and the load's swings are the real server's, not the simulator's."""

    run: str
    instances: int
    factor: float = 1.0
    kind: str = "both"
    seed: int = 7
    start: float = EPOCH
    _records: list[dict[str, Any]] | None = field(init=False, repr=False, default=None)

    @property
    def duration_s(self) -> float:
        return RealRunWorkload(self.run, healthy_only=True, start=self.start).duration_s

    @property
    def fault_s(self) -> tuple[float, float]:
        first, last = HEALTHY_S[self.run]
        third = (last - first) / 3
        return first + third, first + 2 * third

    def records(self) -> list[dict[str, Any]]:
        if self._records is not None:
            return self._records
        base = RealRunWorkload(self.run, healthy_only=True, seed=self.seed, start=self.start)
        rows = [dict(r) for r in base.records()]
        picks = np.random.default_rng(self.seed).integers(self.instances, size=len(rows))
        prefill, decode = KINDS[self.kind]
        low, high = self.fault_s
        for row, pick in zip(rows, picks.tolist(), strict=True):
            ttft, e2e = row["ttft_s"], row["e2e_s"]
            launch = row["timestamp"] - e2e
            slow = pick == FAULTY and low <= launch - self.start < high
            ttft_now = ttft * (self.factor if slow and prefill else 1.0)
            decode_now = (e2e - ttft) * (self.factor if slow and decode else 1.0)
            row.update(
                instance=f"10.0.0.{10 + pick}:8000", ttft_s=round(ttft_now, 5), decode_s=round(decode_now, 5),
                e2e_s=round(ttft_now + decode_now, 5), timestamp=round(launch + ttft_now + decode_now, 4),
            )  # fmt: skip
        rows.sort(key=lambda r: r["timestamp"])
        self._records = rows
        return rows

    def seconds(self) -> Iterator[tuple[float, list[dict[str, Any]]]]:
        return per_second(self.records(), self.start, self.duration_s)


def real_run_replicas(run: str, instances: int = 4, factor: float = 1.0, kind: str = "both") -> Scenario:
    """``RealRunReplicas`` as a scenario: a fault (``factor`` > 1) must page naming engine 1."""
    probe = RealRunReplicas(run, instances, factor, kind)
    low, high = probe.fault_s
    prefill, decode = KINDS[kind]
    signals = ({Signal.PREFILL_PER_TOKEN} if prefill else set()) | ({Signal.ITL} if decode else set())
    faulty = factor > 1.0
    name = f"real_{run}_{kind}_{factor:g}x_of_{instances}" if faulty else f"real_{run}_healthy_of_{instances}"
    return Scenario(
        name, None, frozenset(signals) if faulty else frozenset(), warmup_s=low, family="replicas",
        description=f"{run}: one of {instances} replicas {kind} {factor:g}x slower" if faulty else f"{run}: healthy",
        make=lambda seed: RealRunReplicas(run, instances, factor, kind, seed), injected_s=high - low,
        aftermath_s=TRACE_AFTERMATH_S,
    )  # fmt: skip


def replica_scenarios() -> list[Scenario]:
    """Every case of the bench's table: slowdowns of 2.5x and 1.5x (prefill, decode, both)
    among 4, 8 and 16 replicas, a failing replica, and the healthy moves."""
    cases = [
        slow_replica(instances, factor, kind)
        for factor in (2.5, 1.5)
        for instances in (4, 8, 16)
        for kind in ("prefill", "decode", "both")
    ]
    real = [
        real_run_replicas(run, 4, factor, "both") for run in ("dram_only", "gds_dram") for factor in (1.0, 2.5, 1.5)
    ]
    return [*cases, failing_replica(), autoscaler(), rolling_restart(), *real]
