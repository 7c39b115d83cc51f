"""The load generator: a profile's requests at a rate (open loop), or at rising concurrency
(a ramp that finds the knee), each request logged as a ``RequestLog``.

Open loop: arrival times are drawn up front (``WorkloadSampler.arrivals``) and each request
is sent at its time whatever happened to the ones before, so a slow server meets the same
arrivals a fast one does, as in production (a closed loop would wait for the server and hide
its queueing). ``max_in_flight`` bounds the client: an arrival that finds that many requests
still open is not sent but counted (``shed``), so the schedule never slips.

Ramp: a closed loop per step, ``c`` clients each sending the next request when their last
one ends, so the server holds ``c`` requests for the step's duration; ``models.workload.knee``
says where latency bent.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

import httpx
import numpy as np

from servewatch.models.workload.knee import DEFAULT_LEVELS, KNEE_FACTOR, StepSummary, find_knee, summarise_step
from servewatch.models.workload.sample import RequestSpec, WorkloadSampler
from servewatch.pipeline.loadgen.client import Outcome, Target, send
from servewatch.pipeline.loadgen.prompts import PromptBuilder

logger = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RunSummary:
    """An open-loop run: its requests' figures (``stats.concurrency``: the most requests open
    at once), arrivals not sent, and how late sends were against their schedule (seconds;
    the client's own event loop falling behind): the worst, and the 90th percentile (one
    hiccup, a collection or another process's burst, moves the first but not the second)."""

    stats: StepSummary
    shed: int
    late_s: float
    late_p90_s: float = 0.0


@dataclass(frozen=True)
class RampReport:
    steps: list[StepSummary]
    knee: int | None
    factor: float


class _Tally:
    """Outcomes of a run or step, reduced as they come (a long run keeps no request)."""

    def __init__(self) -> None:
        self.ttfts, self.gaps = array("d"), array("d")
        self.tokens = self.errors = 0

    def add(self, outcome: Outcome) -> None:
        log = outcome.log
        self.tokens += log.completion_tokens
        if log.finish_reason == "error":
            self.errors += 1
        elif log.ttft_s is not None:
            self.ttfts.append(log.ttft_s)
        self.gaps.extend(outcome.gaps)

    def summary(self, concurrency: int, seconds: float) -> StepSummary:
        return summarise_step(concurrency, seconds, np.array(self.ttfts), np.array(self.gaps),
                              self.tokens, self.errors)  # fmt: skip


class LoadGenerator:
    """Sends ``sampler``'s requests to ``target``; ``on_outcome`` sees each finished one.

    ``async with`` opens (and closes) the HTTP client; ``seed`` fixes the requests, their
    arrival times and their prompts' text.
    """

    def __init__(
        self,
        target: Target,
        sampler: WorkloadSampler,
        *,
        seed: int = 0,
        max_in_flight: int = 256,
        timeout_s: float = 600.0,
        on_outcome: Callable[[Outcome], None] | None = None,
    ) -> None:
        self.target = target
        self.sampler = sampler
        self.seed = seed
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.on_outcome = on_outcome
        self.prompts = PromptBuilder(seed)
        self.run_id = uuid.uuid4().hex[:8]
        self.sent = self.done = 0
        self._specs: Iterator[RequestSpec] = iter(())
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> LoadGenerator:
        limits = httpx.Limits(max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight)
        timeout = httpx.Timeout(self.timeout_s, connect=_CONNECT_TIMEOUT_S)
        self._client = httpx.AsyncClient(limits=limits, timeout=timeout)
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _next_spec(self) -> RequestSpec:
        spec = next(self._specs, None)
        if spec is None:
            self._specs = iter(self.sampler.requests(256))
            spec = next(self._specs)
        return spec

    async def _one(self, spec: RequestSpec, tally: _Tally) -> None:
        if self._client is None:
            raise RuntimeError("use the load generator as `async with LoadGenerator(...)`")
        self.sent += 1
        request_id = f"loadgen-{self.run_id}-{self.sent:07d}"
        prefix = None if spec.prefix is None else f"loadgen-{self.seed}-prefix-{spec.prefix}"
        outcome = await send(self._client, self.target, spec, self.prompts.text(spec), request_id, prefix)
        self.done += 1
        tally.add(outcome)
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    async def open_loop(self, rate: float, duration_s: float, bursty: bool = True) -> RunSummary:
        """``rate`` requests/s for ``duration_s`` seconds (then wait for the last answers)."""
        arrivals = self.sampler.arrivals(rate, duration_s, bursty=bursty)
        tally, tasks, shed, peak = _Tally(), set[asyncio.Task[None]](), 0, 0
        late = np.zeros(len(arrivals))  # as long as the schedule, which is in memory already
        started = time.perf_counter()
        for i, offset in enumerate(arrivals):
            delay = started + float(offset) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late[i] = max(-delay, 0.0)
            spec = self._next_spec()  # drawn even when shed: the same seed sends the same requests
            if len(tasks) >= self.max_in_flight:
                shed += 1
                continue
            task = asyncio.create_task(self._one(spec, tally))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            peak = max(peak, len(tasks))
        if tasks:
            await asyncio.gather(*tasks)
        if shed:
            logger.warning("%d arrivals not sent: %d requests were open (max in flight)", shed, self.max_in_flight)
        worst, p90 = (float(late.max()), float(np.quantile(late, 0.9))) if len(late) else (0.0, 0.0)
        return RunSummary(tally.summary(peak, time.perf_counter() - started), shed, worst, p90)

    async def step(self, concurrency: int, seconds: float) -> StepSummary:
        """``concurrency`` clients in a closed loop for ``seconds`` (requests open at the end
        finish and count)."""
        tally, deadline = _Tally(), time.perf_counter() + seconds
        started = time.perf_counter()

        async def client() -> None:
            while time.perf_counter() < deadline:
                await self._one(self._next_spec(), tally)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return tally.summary(concurrency, time.perf_counter() - started)

    async def ramp(
        self,
        levels: Sequence[int] = DEFAULT_LEVELS,
        step_s: float = 30.0,
        factor: float = KNEE_FACTOR,
        on_step: Callable[[StepSummary], None] | None = None,
    ) -> RampReport:
        """Each level in turn for ``step_s``; the knee of the steps (``models.workload.knee``)."""
        steps = []
        for level in levels:
            steps.append(summary := await self.step(level, step_s))
            logger.debug("concurrency %d: %d requests, p95 TTFT %s", level, summary.requests, summary.ttft_p95)
            if on_step is not None:
                on_step(summary)
        return RampReport(steps, find_knee(steps, factor), factor)
