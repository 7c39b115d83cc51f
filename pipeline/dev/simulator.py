"""A synthetic but physically sensible LLM serving workload, for the demo, tests and benchmarks.

Arrivals are Poisson; prompt and output lengths are log-normal per route (chat turns vs
RAG prompts), close to the shapes of public traces (Mooncake, Azure LLM 2023). Timings come
from a small serving model: prefill costs time per *uncached* prompt token, decode costs
time per output token, and queueing grows as ``rho / (1 - rho)`` with utilisation ``rho``.
So a traffic surge raises TTFT through queueing, while turning prefix caching off at flat
traffic raises it through prefill: the two situations servewatch must tell apart.

Deterministic for a given seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import numpy as np

#: 2026-01-01T00:00:00Z, a fixed start so scenarios are reproducible.
EPOCH = 1_767_225_600.0

#: A request's latency changed by a fault when it moved by more than this (in log terms, 10 %):
#: the simulated prefill's own jitter per request (``lognormal(0, 0.1)``), which no single
#: request's log can tell from a fault.
NOTICEABLE = 0.1
#: The ways a request can show an injected fault, each first seen once such a request is
#: logged: an answer cut by the length limit, a failure, a leaked reasoning marker, and any
#: change to its service or answer at all (``served``).
FAULT_SHOWS = ("cut", "failed", "leaked", "served")


@dataclass(frozen=True)
class Route:
    name: str
    share: float  # of the model's traffic
    prompt_median: float
    prompt_sigma: float
    output_median: float
    output_sigma: float
    shared_prefix: float  # fraction of the prompt that is a shared prefix (cacheable)


DEFAULT_ROUTES = (
    Route("chat", 0.7, prompt_median=1800, prompt_sigma=0.6, output_median=300, output_sigma=0.7, shared_prefix=0.6),
    Route("rag", 0.3, prompt_median=12000, prompt_sigma=0.4, output_median=350, output_sigma=0.5, shared_prefix=0.9),
)


@dataclass(frozen=True)
class Phase:
    """A stretch of simulated time with constant conditions."""

    name: str
    duration_s: float
    traffic: float = 1.0  # multiplier on the base request rate
    prefix_caching: bool = True
    decode_slowdown: float = 1.0
    max_tokens: int = 4096
    error_rate: float = 0.0  # share of requests that fail (finish_reason=error, HTTP 500)
    leak_rate: float = 0.0  # share of answers with the reasoning end marker in the text
    long_prompt_slowdown: float = 1.0  # prefill slower by this factor for long prompts only
    long_prompt_tokens: int = 4096  # what counts as long


#: What a phase without an injected condition serves like.
HEALTHY = Phase("healthy", 0.0)


def serves_differently(phase: Phase, *, prompt: int, wanted: int, shared_prefix: float) -> bool:
    """Whether ``phase`` serves a request of these lengths noticeably unlike a healthy phase
    would (the random failures and leaks it draws aside): answers cut shorter, cached tokens
    gone, a prefill or decode slower by more than ``NOTICEABLE``.

    >>> serves_differently(Phase("cut", 1.0, max_tokens=1000), prompt=800, wanted=300, shared_prefix=0.5)
    False
    >>> serves_differently(Phase("cut", 1.0, max_tokens=1000), prompt=800, wanted=1300, shared_prefix=0.5)
    True
    """
    if min(wanted, phase.max_tokens) != min(wanted, HEALTHY.max_tokens):
        return True
    if not phase.prefix_caching and shared_prefix > 0:
        return True
    slower = abs(math.log(phase.long_prompt_slowdown)) if prompt >= phase.long_prompt_tokens else 0.0
    if wanted > 1:
        slower = max(slower, abs(math.log(phase.decode_slowdown)))
    return slower > NOTICEABLE


class _Timed(Protocol):
    @property
    def duration_s(self) -> float: ...


TimedPhase = TypeVar("TimedPhase", bound=_Timed)


def phase_at(phases: Sequence[TimedPhase], offset_s: float) -> TimedPhase:
    """The phase in force ``offset_s`` seconds from the start (the last one after the end).

    >>> phase_at((Phase("a", 10.0), Phase("b", 5.0)), 12.0).name
    'b'
    """
    elapsed = 0.0
    for phase in phases:
        elapsed += phase.duration_s
        if offset_s < elapsed:
            return phase
    return phases[-1]


@dataclass
class Workload:
    """Generates request-log dicts (``RequestLog`` JSON) in finish-time order."""

    phases: tuple[Phase, ...]
    models: tuple[str, ...] = ("llama-3.1-70b", "qwen3-32b")
    routes: tuple[Route, ...] = DEFAULT_ROUTES
    base_rate: float = 15.0  # requests/s per model at traffic 1.0
    base_utilisation: float = 0.25  # rho at traffic 1.0
    prefill_s_per_token: float = 1.2e-4
    itl_s: float = 0.02
    instances: tuple[str, ...] = ("10.0.0.7:8000", "10.0.0.8:8000")
    daily_amplitude: float = 0.0  # traffic swings by this share around its mean over a day
    day_s: float = 86_400.0  # length of that day (shorter: a compressed cycle)
    log_content: bool = False  # add answer and reasoning text (a reasoning model's logs)
    seed: int = 42
    fault_phase: int = 1  # the index of a scenario's injected phase (``first_faulty_log_s``)
    start: float = EPOCH
    _rng: np.random.Generator = field(init=False, repr=False)
    _first_faulty: dict[str, float] = field(init=False, repr=False, default_factory=dict)
    _read_to_end: bool = field(init=False, repr=False, default=False)

    def __post_init__(self) -> None:
        self._rng = np.random.default_rng(self.seed)

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def phase_at(self, offset_s: float) -> Phase:
        return phase_at(self.phases, offset_s)

    @property
    def first_faulty_log_s(self) -> float | None:
        """When (event time) the first request the injected phase (``fault_phase``, the second
        by default) changed was logged: a detector cannot know of a fault before."""
        return min(self.first_faulty_logs.values(), default=None)

    @property
    def first_faulty_logs(self) -> dict[str, float]:
        """Per way a request can show the fault (``FAULT_SHOWS``), when the first request that
        shows it was logged. Requests are logged when they end, so a lowered ``max_tokens``
        shows once an answer has decoded that many tokens, tens of seconds into the phase.
        Noted as the requests are generated: once this workload was read to its end, or else
        from a fresh copy of it (the same seed, the same requests)."""
        if len(self.phases) <= self.fault_phase:
            return {}
        if self._read_to_end:
            return dict(self._first_faulty)
        fresh = replace(self)
        for _ in fresh.seconds():
            pass
        return fresh._first_faulty

    def _second(self, second: int, phase: Phase) -> list[dict[str, Any]]:
        """Requests arriving during one simulated second."""
        rng = self._rng
        traffic = phase.traffic * (1.0 + self.daily_amplitude * math.sin(2 * math.pi * second / self.day_s))
        rho = min(self.base_utilisation * traffic, 0.93)
        injected = len(self.phases) > self.fault_phase and phase is self.phases[self.fault_phase]
        records: list[dict[str, Any]] = []
        for model in self.models:
            n = int(rng.poisson(self.base_rate * traffic))
            if n == 0:
                continue
            shares = np.array([r.share for r in self.routes])
            route_idx = rng.choice(len(self.routes), size=n, p=shares / shares.sum())
            arrivals = self.start + second + np.sort(rng.random(n))
            for i in range(n):
                route = self.routes[route_idx[i]]
                prompt = int(max(16, rng.lognormal(math.log(route.prompt_median), route.prompt_sigma)))
                wanted = int(max(1, rng.lognormal(math.log(route.output_median), route.output_sigma)))
                output = min(wanted, phase.max_tokens)
                cached = int(prompt * route.shared_prefix * rng.uniform(0.85, 1.0)) if phase.prefix_caching else 0
                cached = (cached // 16) * 16  # block granularity
                uncached = prompt - cached
                prefill = 0.02 + uncached * self.prefill_s_per_token * rng.lognormal(0.0, 0.1)
                if prompt >= phase.long_prompt_tokens:
                    prefill *= phase.long_prompt_slowdown
                queue = rng.exponential(0.15 * rho / (1.0 - rho))
                ttft = queue + prefill
                itl = self.itl_s * phase.decode_slowdown * (1.0 + 0.5 * rho) * rng.lognormal(0.0, 0.05)
                decode = itl * max(output - 1, 0)
                e2e = ttft + decode
                finish = "length" if wanted > phase.max_tokens else "stop"
                status = 200
                # Extra draws only when a fault is switched on: default scenarios stay as they were.
                if phase.error_rate and rng.random() < phase.error_rate:
                    finish, status, output, decode = "error", 500, 0, 0.0
                    e2e = ttft
                text: dict[str, str] = {}
                leaked = False
                if self.log_content:
                    leaked = bool(phase.leak_rate) and rng.random() < phase.leak_rate
                    text = {
                        "reasoning_content": "Let me work through this step by step.",
                        "content": ("Step 3 done.</think>The answer is 42." if leaked else "The answer is 42."),
                    }
                records.append(
                    {
                        "request_id": f"req-{model}-{route.name}-{second}-{i}",
                        "timestamp": round(float(arrivals[i]) + e2e, 4),
                        "model": model,
                        "route": route.name,
                        "instance": self.instances[int(rng.integers(len(self.instances)))],
                        "engine": "vllm",
                        "engine_version": "0.11.0",
                        "prompt_tokens": prompt,
                        "cached_tokens": cached,
                        "completion_tokens": output,
                        "max_tokens": phase.max_tokens,
                        "ttft_s": round(ttft, 5),
                        "queue_s": round(queue, 5),
                        "prefill_s": round(prefill, 5),
                        "decode_s": round(decode, 5),
                        "e2e_s": round(e2e, 5),
                        "finish_reason": finish,
                        "status_code": status,
                        "prefix_hash": f"{model}:{route.name}:sys-v1",
                        **text,
                    }
                )
                if injected:
                    shows = {
                        "cut": finish == "length" and wanted <= HEALTHY.max_tokens,
                        "failed": status != 200,
                        "leaked": leaked,
                        "served": serves_differently(
                            phase, prompt=prompt, wanted=wanted, shared_prefix=route.shared_prefix
                        ),
                    }
                    logged = records[-1]["timestamp"]
                    for way in (way for way, shown in shows.items() if shown):
                        self._first_faulty[way] = min(self._first_faulty.get(way, logged), logged)
        return records

    def records(self) -> Iterator[dict[str, Any]]:
        """All records, ordered by finish time (as a log shipper would see them)."""
        yield from (record for _, batch in self.seconds() for record in batch)

    def seconds(self) -> Iterator[tuple[float, list[dict[str, Any]]]]:
        """Per simulated second: (sim time, records that *finished* by then), in order.

        Records finish after they arrive, so each is held back until its finish time: the
        stream is in event-time order, the way a shipper tails a log.
        """
        pending: list[dict[str, Any]] = []
        total = int(self.duration_s)
        for second in range(total + 60):
            if second < total:
                pending.extend(self._second(second, self.phase_at(second)))
            now = self.start + second + 1
            ready = [r for r in pending if r["timestamp"] < now]
            if ready:
                pending = [r for r in pending if r["timestamp"] >= now]
                ready.sort(key=lambda r: r["timestamp"])
            yield now, ready
            if second >= total and not pending:
                break
        self._read_to_end = True


def demo_phases(scale: float = 1.0) -> tuple[Phase, ...]:
    """Normal traffic, a 3x surge, recovery, then prefix caching off at flat traffic."""
    return (
        Phase("normal", 360 * scale),
        Phase("surge", 240 * scale, traffic=3.0),
        Phase("recovery", 180 * scale),
        Phase("cache_off", 240 * scale, prefix_caching=False),
    )
