"""A discrete-event simulation of an LLM engine fleet with hard slot limits, driven by real arrival traces.

``pipeline/dev/simulator.py`` draws Poisson arrivals and models queueing as ``rho / (1 - rho)``
with ``rho`` capped, so it never saturates: queue time is a smooth function of load. Real
fleets are not like that. Arrivals come in bursts (the Mooncake chat trace has 10-second
counts up to twice their mean; the Azure code trace is silent for minutes, then sends 30
requests a second), and an engine runs at most ``max_num_seqs`` requests at once: when a
burst fills the slots, requests wait in a FIFO queue, and queue time jumps from zero to
seconds. This module replays the public traces bundled in ``pipeline/dev/trace_samples/``
(arrival times, prompt and output lengths, reusable prefixes) through such engines, so the
detection scenarios can include what the simple generator cannot produce: brief
saturation in normal traffic, a surge that overloads the fleet, lost capacity.

The physics, per model (its own trace, ``instances`` engines of ``max_num_seqs`` slots):

* an arrival goes to the engine with the fewest requests in the system (ties in turn)
  and waits there, FIFO, until a slot is free and, where the engine has a KV-cache budget
  (``ModelSpec.kv_tokens``), until its prompt and answer tokens fit in it: ``queue_s``. A
  burst of long prompts thus fills the engine with fewer busy slots than ``max_num_seqs``,
  as a real engine's KV cache does (what a detector estimating busy slots from logs sees);
* prefill costs time per *uncached* prompt token (plus an overhead, log-normal jitter,
  and a contention factor: a busy engine interleaves prefill with everyone's decode);
* decode costs ``itl * (output - 1)``, the inter-token latency growing with the number of
  busy slots when the request starts (the batch it joins);
* the prefix cache serves the reusable prefix: Mooncake's own ``reused_prefix_tokens``
  (what an unbounded cache shared by the engines would hit, as in Mooncake's KV store),
  or for the Azure traces, which have no prefix information, a shared system prompt for a
  share of the requests; in 16-token blocks, and nothing when the phase turns caching off;
* normal traffic is not spotless: a model's clients see a background of failed requests
  (``ModelSpec.error_rate``) and of answers cut by a ``max_tokens`` set too low
  (``ModelSpec.truncation_rate``), as any real fleet's logs show.

Traffic is scaled by playing the trace on its own clock: at ``rate_scale`` 2 the trace
plays twice as fast (and loops when it runs out), so bursts keep their shape and the mix
of prompts is the trace's own; a phase's ``traffic`` speeds that clock up further (a daily
cycle is a list of phases: ``pipeline/dev/traffic_cycles.py``).
``ModelSpec.utilisation`` picks the scale from a target slot occupancy instead.

Deterministic for a seed (which also picks where in the trace each model starts). An hour
of the default fleet (~20,000 requests) simulates in under half a second.
"""

from __future__ import annotations

import bisect
import csv
import functools
import gzip
import heapq
import io
import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

import numpy as np

from servewatch.pipeline.dev.simulator import EPOCH, NOTICEABLE, phase_at

#: vLLM's KV-cache block: a prefix is cached in whole blocks.
CACHE_BLOCK_TOKENS = 16
#: Seconds at the start of a trace with reusable prefixes during which its (replayed) cache
#: fills from empty; left out (``load_trace``).
CACHE_WARMUP_S = 300.0
#: The arrival traces in ``pipeline/dev/trace_samples/`` (``<name>.csv.gz``).
TRACES = ("mooncake_conversation", "azure_conv", "azure_code")


def read_sample(filename: str) -> tuple[str, dict[str, list[str]]]:
    """(source line, columns by name) of a bundled sample in ``pipeline/dev/trace_samples/``.

    Each sample is a gzip CSV whose first line is a ``#`` comment naming its source and licence.
    """
    data = (resources.files("servewatch.pipeline.dev") / "trace_samples" / filename).read_bytes()
    comment, _, body = gzip.decompress(data).decode().partition("\n")
    rows = csv.reader(io.StringIO(body))
    header = next(rows)
    columns = list(zip(*rows, strict=True))
    return comment.lstrip("# "), {name: list(values) for name, values in zip(header, columns, strict=True)}


def per_second(
    records: Sequence[dict[str, Any]], start: float, duration_s: float
) -> Iterator[tuple[float, list[dict[str, Any]]]]:
    """(second's end, the records that finished in it) for every second from ``start``, until
    ``duration_s`` is over and every record was given. ``records`` sorted by ``timestamp``."""
    finishes = [r["timestamp"] for r in records]
    last = max(duration_s, (finishes[-1] - start) if finishes else 0.0)
    taken = 0
    for second in range(math.ceil(last) + 1):
        now = start + second + 1
        upto = bisect.bisect_left(finishes, now, lo=taken)
        yield now, list(records[taken:upto])
        taken = upto


@dataclass(frozen=True, eq=False)
class Trace:
    """An arrival trace: per request, arrival offset, prompt and output lengths."""

    name: str
    source: str
    t_s: np.ndarray  # arrival seconds from the trace's start, sorted
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    reused_prefix_tokens: np.ndarray | None  # what a prefix cache could serve; None: unknown
    first_block_id: np.ndarray | None  # requests with the same id share a leading prompt block

    @property
    def period_s(self) -> float:
        """Length of one play of the trace: the last arrival plus a mean gap, so a loop has no hole."""
        n = len(self.t_s)
        return float(self.t_s[-1] + (self.t_s[-1] - self.t_s[0]) / max(n - 1, 1))

    @property
    def rate(self) -> float:
        """Mean requests/s over one play."""
        return len(self.t_s) / self.period_s


@functools.cache
def load_trace(name: str) -> Trace:
    """A bundled trace by name (one of ``TRACES``); read once per process."""
    source, columns = read_sample(f"{name}.csv.gz")

    def ints(column: str) -> np.ndarray | None:
        return np.array(columns[column], dtype=np.int64) if column in columns else None

    prompt, output = ints("prompt_tokens"), ints("output_tokens")
    assert prompt is not None and output is not None
    t_s, reused, blocks = (
        np.array(columns["t_s"], dtype=np.float64),
        ints("reused_prefix_tokens"),
        ints("first_block_id"),
    )
    keep = np.ones(len(t_s), dtype=bool)
    if reused is not None:
        # The reusable prefixes were found by replaying the trace through a cache that starts
        # empty: its first minutes reuse half as much as the rest (21 % of prompt tokens, then
        # 35-41 %). A fleet that runs for hours never sees a cold cache again, and a looped
        # trace must not replay one: the trace starts once the cache is warm.
        keep = t_s >= CACHE_WARMUP_S
        t_s = t_s[keep] - CACHE_WARMUP_S
    return Trace(
        name,
        source,
        t_s,
        prompt[keep],
        np.maximum(output, 1)[keep],
        None if reused is None else reused[keep],
        None if blocks is None else blocks[keep],
    )


@dataclass(frozen=True)
class ModelSpec:
    """One model of the fleet: the trace that drives it, its engines and their speed."""

    name: str
    trace: str  # one of TRACES
    route: str
    instances: int = 2
    max_num_seqs: int = 48  # slots per engine: the hard concurrency limit
    #: Mean slot occupancy wanted at traffic 1.0; sets the trace's speed (``rate_scale`` is then ignored).
    utilisation: float | None = None
    rate_scale: float = 1.0  # trace played this many times faster (when ``utilisation`` is None)
    prefill_overhead_s: float = 0.02
    prefill_s_per_token: float = 1.2e-4
    prefill_contention: float = 0.5  # prefill slower by this share when every slot is busy
    itl_s: float = 0.02  # inter-token latency of a lone request
    batch_factor: float = 1.0  # ITL grows by this share when every slot is busy
    #: Traces without prefix information: a system prompt of this length, shared by this share of requests.
    system_prompt_tokens: int = 512
    system_prompt_share: float = 0.8
    engine_version: str = "0.11.0"
    trace_offset_s: float | None = None  # where in the trace to start; None: picked by the seed
    #: KV-cache tokens per engine: a running request holds its prompt and answer tokens, and a
    #: waiting one starts only when they fit. None: the slots are the only limit.
    kv_tokens: int | None = None
    #: Background share of requests that fail (HTTP 500) in normal traffic, on every phase.
    error_rate: float = 0.0
    #: Background share of requests whose client set ``max_tokens`` below what the answer
    #: needed (cut at 20-90 % of it, ``finish_reason=length``), on every phase.
    truncation_rate: float = 0.0

    def cacheable_tokens(self, prompt: np.ndarray, reusable: np.ndarray) -> np.ndarray:
        """The part of each prompt a prefix cache can serve: whole blocks of the reusable
        prefix, never the whole prompt (the engine always computes the last token)."""
        reusable = np.minimum(reusable, prompt - 1)
        return np.maximum(reusable // CACHE_BLOCK_TOKENS * CACHE_BLOCK_TOKENS, 0)

    def system_prompt(self, prompt: np.ndarray) -> np.ndarray:
        """The reusable prefix of prompts that carry the system prompt (longer ones only)."""
        return np.where(prompt > self.system_prompt_tokens, self.system_prompt_tokens, 0)

    def trace_scale(self, trace: Trace) -> float:
        """How many times faster than recorded the trace plays at traffic 1.0.

        From a target occupancy ``u``: busy slots = arrival rate x mean service time at that
        occupancy (Little's law), so rate = u x slots / service(u). Queueing adds no busy slots.
        """
        if self.utilisation is None:
            return self.rate_scale
        u = self.utilisation
        prompt = trace.prompt_tokens
        if trace.reused_prefix_tokens is not None:
            cached = self.cacheable_tokens(prompt, trace.reused_prefix_tokens)
        else:
            cached = self.cacheable_tokens(prompt, self.system_prompt(prompt)) * self.system_prompt_share
        uncached = float(np.mean(prompt - cached))
        decode_tokens = float(np.mean(trace.output_tokens - 1))
        service = (
            self.prefill_overhead_s
            + uncached * self.prefill_s_per_token * (1 + self.prefill_contention * u)
            + self.itl_s * (1 + self.batch_factor * u) * decode_tokens
        )
        return u * self.instances * self.max_num_seqs / (trace.rate * service)


#: A chat model on the Mooncake conversation trace (long prompts, ~37 % of prompt tokens
#: reusable): four engines of 16 slots at 60 % occupancy, ~3.2 requests/s. The trace's
#: bursts fill every slot in ~2 % of seconds, and ~1.5 % of requests wait for one.
CHAT_MODEL = ModelSpec("llama-3.1-70b", "mooncake_conversation", "chat", instances=4, max_num_seqs=16, utilisation=0.6)
#: A code model on the Azure code trace at its recorded rate (2.6 requests/s on average, but
#: minutes of silence and bursts of up to 60/s): short answers, fast engines, two of 12 slots,
#: ~6 % busy on average, full in ~1 % of seconds.
CODE_MODEL = ModelSpec(
    "qwen2.5-coder-32b", "azure_code", "code", instances=2, max_num_seqs=12,
    prefill_s_per_token=6e-5, itl_s=0.012, system_prompt_tokens=1024, system_prompt_share=0.7,
)  # fmt: skip
#: A low-volume model: the Azure chat trace at a third of its rate (~2 requests/s, nearly all
#: in one segment: 10-30 requests per 10 s window) on one engine of 12 slots, ~50 % busy.
LOW_VOLUME_MODEL = ModelSpec(
    "qwen3-8b", "azure_conv", "chat", instances=1, max_num_seqs=12, rate_scale=1 / 3,
    prefill_s_per_token=4e-5, itl_s=0.01, system_prompt_tokens=384, system_prompt_share=0.8,
)  # fmt: skip
DEFAULT_FLEET = (CHAT_MODEL, CODE_MODEL)
#: Background failures and cut answers of a healthy fleet's logs: ~0.05 % of requests fail
#: (timeouts, client disconnects, the odd engine error), ~0.15 % are cut by a ``max_tokens``
#: their client set too low. Enough that a day holds a few hundred of each per model.
BACKGROUND_ERROR_RATE = 5e-4
BACKGROUND_TRUNCATION_RATE = 1.5e-3
#: The same two models as a pager sees them: what real engines and clients add to the plain
#: specs. The chat model's engines hold 360k KV tokens each (a 70B model in bf16 on four
#: 80 GB GPUs): normal traffic fills 40 % of it on average, but a burst of long prompts fills
#: it with slots still free, and then requests wait (2.5 % of them, against 1.8 % on slots
#: alone; 6 % of seconds see one waiting, against 3 %). The code model's 48k tokens per
#: engine bind only in its largest bursts. The default specs have no KV budget and no
#: background, so the scenarios measured on them keep their numbers.
PAGER_CHAT_MODEL = replace(
    CHAT_MODEL, kv_tokens=360_000, error_rate=BACKGROUND_ERROR_RATE, truncation_rate=BACKGROUND_TRUNCATION_RATE
)
PAGER_CODE_MODEL = replace(
    CODE_MODEL, kv_tokens=48_000, error_rate=BACKGROUND_ERROR_RATE, truncation_rate=BACKGROUND_TRUNCATION_RATE
)
PAGER_FLEET = (PAGER_CHAT_MODEL, PAGER_CODE_MODEL)


@dataclass(frozen=True)
class SimPhase:
    """A stretch of simulated time with constant conditions, for every model or only ``models``.

    Engine faults (caching, slowdowns, capacity) apply when a request *starts* service;
    client-side ones (``max_tokens``, errors, leaks) to the requests that *arrive* in the phase.
    """

    name: str
    duration_s: float
    traffic: float = 1.0  # multiplier on the arrival rate (2.5: a surge that overloads the slots)
    prefix_caching: bool = True
    prefill_slowdown: float = 1.0  # prefill slower by this factor for long prompts only
    #: What counts as long: away from the detector's prompt-band edges (4096, 32768) on purpose,
    #: so a slowdown hits part of a segment, not a whole one.
    slow_prompt_tokens: int = 16_000
    decode_slowdown: float = 1.0
    capacity_factor: float = 1.0  # share of each engine's slots usable (0.5: half the KV memory)
    max_tokens: int = 4096  # longer answers are cut (finish_reason "length")
    error_rate: float = 0.0  # share of requests that fail (HTTP 500) after their prefill, beyond the model's background
    #: Besides ``error_rate``: this many requests arriving in the phase fail, spread evenly
    #: over its arrivals (an error burst of a known size, whatever the trace's bursts do).
    error_count: int = 0
    #: Prompt lengths [low, high) the phase's errors hit; None: every prompt. Keeps an error
    #: burst inside one segment (away from the prompt-band edges 4096 and 32768).
    error_prompt_tokens: tuple[int, int] | None = None
    leak_rate: float = 0.0  # share of answers with "</think>" in the text (with ``log_content``)
    ttft_factor: float = 1.0  # prefill slower by this factor for every prompt
    models: tuple[str, ...] | None = None  # the models the phase's conditions apply to; None: all
    #: A replica fault: the engines (by index) it hits prefill and decode slower by these
    #: factors, and fail this share of the requests they serve.
    fault_instances: tuple[int, ...] = ()
    instance_prefill_factor: float = 1.0
    instance_decode_factor: float = 1.0
    instance_error_rate: float = 0.0
    #: Engines the load balancer sends new requests to (an autoscaler's count: the first
    #: ones of the model's ``instances``); None: all. The others finish what they hold.
    serving_instances: int | None = None
    #: Engines taken out of rotation for the phase (a rolling restart's current one), and
    #: engines whose prefix cache starts the phase empty (just restarted): a prompt prefix
    #: hits there once the engine has prefilled it since, as a real cache fills.
    down_instances: tuple[int, ...] = ()
    cold_instances: tuple[int, ...] = ()

    def for_model(self, model: str) -> SimPhase:
        """This phase as ``model`` sees it: its conditions, or plain normal ones."""
        if self.models is None or model in self.models:
            return self
        return SimPhase(self.name, self.duration_s)


@dataclass(frozen=True, eq=False)
class Occupancy:
    """Per simulated second, the time-averaged busy slots and waiting requests of one model."""

    slots: int  # nominal slots over all engines
    busy: np.ndarray
    waiting: np.ndarray
    kv_tokens: int | None = None  # nominal KV-cache tokens over all engines; None: no budget
    kv_held: np.ndarray | None = None  # time-averaged KV tokens held per second

    def kv_share(self, first_s: float = 0.0, last_s: float | None = None) -> float:
        """Mean KV tokens held over the nominal budget, for the seconds in [first_s, last_s)."""
        assert self.kv_tokens is not None and self.kv_held is not None, "the model has no KV budget"
        return float(np.mean(self.kv_held[int(first_s) : None if last_s is None else int(last_s)])) / self.kv_tokens

    def share(self, first_s: float = 0.0, last_s: float | None = None) -> float:
        """Mean busy slots over nominal slots, for the seconds in [first_s, last_s)."""
        return float(np.mean(self.busy[int(first_s) : None if last_s is None else int(last_s)])) / self.slots

    def saturated_share(self, first_s: float = 0.0, last_s: float | None = None) -> float:
        """Share of seconds in [first_s, last_s) in which some request waited for a slot."""
        return float(np.mean(self.waiting[int(first_s) : None if last_s is None else int(last_s)] > 0))


def _integral_per_second(
    starts: np.ndarray, ends: np.ndarray, seconds: int, weights: np.ndarray | None = None
) -> np.ndarray:
    """For intervals [start, end), the time they cover within each second [k, k + 1), summed
    (each interval counted ``weights`` times: tokens held, say).

    The covered time up to x is sum(w (x - start) over starts < x) - sum(w (x - end) over
    ends < x): two sorted prefix sums, no loop over intervals.
    """
    grid = np.arange(seconds + 1, dtype=np.float64)
    w = np.ones(len(starts)) if weights is None else weights.astype(np.float64)

    def covered(points: np.ndarray) -> np.ndarray:
        order = np.argsort(points, kind="stable")
        ordered, weight = points[order], w[order]
        prefix = np.concatenate([[0.0], np.cumsum(ordered * weight)])
        mass = np.concatenate([[0.0], np.cumsum(weight)])
        count = np.searchsorted(ordered, grid, side="left")
        return mass[count] * grid - prefix[count]

    total = covered(starts) - covered(ends)
    return np.diff(total)


@dataclass
class _ModelRun:
    """One model's simulated requests, as arrays indexed by arrival."""

    spec: ModelSpec
    arrival: np.ndarray
    start: np.ndarray
    prefill: np.ndarray
    decode: np.ndarray
    instance: np.ndarray
    prompt: np.ndarray
    cached: np.ndarray
    output: np.ndarray
    max_tokens: np.ndarray
    finish: list[str]
    prefix_hash: list[str]
    leaked: np.ndarray
    kv_held: np.ndarray  # KV tokens each request held while it ran


@dataclass
class TraceWorkload:
    """Request-log dicts (``RequestLog`` JSON) from the fleet simulation, in finish-time order.

    The same interface as ``pipeline.dev.workload.Workload``: ``start``, ``duration_s``,
    ``seconds()`` and ``records()``; requests still running when the last phase ends are
    emitted as they finish, in a drain after it.
    """

    phases: tuple[SimPhase, ...]
    models: tuple[ModelSpec, ...] = DEFAULT_FLEET
    log_content: bool = False  # add answer and reasoning text (a reasoning model's logs)
    seed: int = 42
    fault_phase: int = 1  # the index of a scenario's injected phase (``first_faulty_log_s``)
    start: float = EPOCH
    _runs: dict[str, _ModelRun] = field(init=False, repr=False, default_factory=dict)
    _records: list[dict[str, Any]] | None = field(init=False, repr=False, default=None)

    @property
    def duration_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def phase_at(self, offset_s: float) -> SimPhase:
        return phase_at(self.phases, offset_s)

    def records(self) -> Iterator[dict[str, Any]]:
        """All records, ordered by finish time (as a log shipper would see them)."""
        yield from self._simulated()

    def seconds(self) -> Iterator[tuple[float, list[dict[str, Any]]]]:
        """Per simulated second: (sim time, records that *finished* in it), in finish order,
        until the phases are over and every request has finished."""
        return per_second(self._simulated(), self.start, self.duration_s)

    @property
    def first_faulty_log_s(self) -> float | None:
        """When (event time) the first request the injected phase (``fault_phase``, the second
        by default) changed was logged. A detector cannot know of a fault before: requests are
        logged when they end, so half the slots lost shows once a request that queued for one
        has finished, and a slower prefill of long prompts once a long prompt has (not when a
        short one decoded 3 % slower beside it)."""
        return min(self.first_faulty_logs.values(), default=None)

    @functools.cached_property
    def first_faulty_logs(self) -> dict[str, float]:
        """Per way a request can show the fault (``FAULT_SHOWS``), when the first request that
        shows it was logged. The same fleet is simulated again with the injected phase healthy
        (its traffic kept): the random draws are the same, so a request whose service (time to
        first token or end to end, by more than ``NOTICEABLE``) or answer (tokens, finish
        reason, leak) differs is one the fault touched."""
        if len(self.phases) <= self.fault_phase:
            return {}
        self._simulated()
        fault = self.phases[self.fault_phase]
        healthy_phase = SimPhase(fault.name, fault.duration_s, traffic=fault.traffic, models=fault.models)
        phases = (*self.phases[: self.fault_phase], healthy_phase, *self.phases[self.fault_phase + 1 :])
        healthy = replace(self, phases=phases)
        healthy._simulated()
        firsts: dict[str, float] = {}
        for name, run in self._runs.items():
            other = healthy._runs[name]
            ttft, healthy_ttft = run.start - run.arrival + run.prefill, other.start - other.arrival + other.prefill
            slower = np.abs(np.log(ttft / healthy_ttft)) > NOTICEABLE
            slower |= np.abs(np.log((ttft + run.decode) / (healthy_ttft + other.decode))) > NOTICEABLE
            finish, healthy_finish = np.array(run.finish), np.array(other.finish)
            shows = {
                "cut": (finish == "length") & (healthy_finish != "length"),
                "failed": (finish == "error") & (healthy_finish != "error"),
                "leaked": run.leaked != other.leaked,
                "served": slower | (run.output != other.output) | (finish != healthy_finish),
            }
            ends = run.start + run.prefill + run.decode
            for way, changed in shows.items():
                if changed.any():
                    first = self.start + float(np.min(ends[changed]))
                    firsts[way] = min(firsts.get(way, first), first)
        return firsts

    def occupancy(self, model: str) -> Occupancy:
        """Busy slots and waiting requests of ``model`` per simulated second (after the run)."""
        self._simulated()
        run = self._runs[model]
        seconds = math.ceil(float(np.max(run.start + run.prefill + run.decode, initial=self.duration_s)))
        end = run.start + run.prefill + run.decode
        kv = run.spec.kv_tokens
        return Occupancy(
            run.spec.instances * run.spec.max_num_seqs,
            _integral_per_second(run.start, end, seconds),
            _integral_per_second(run.arrival, run.start, seconds),
            None if kv is None else kv * run.spec.instances,
            None if kv is None else _integral_per_second(run.start, end, seconds, run.kv_held),
        )

    def rate_scale(self, model: str) -> float:
        """How many times faster than recorded ``model``'s trace plays at traffic 1.0."""
        spec = next(m for m in self.models if m.name == model)
        return spec.trace_scale(load_trace(spec.trace))

    # -- the simulation -------------------------------------------------------------------

    def _simulated(self) -> list[dict[str, Any]]:
        if self._records is None:
            records: list[dict[str, Any]] = []
            for index, spec in enumerate(self.models):
                run = self._simulate(index, spec)
                self._runs[spec.name] = run
                records.extend(self._to_records(index, run))
            records.sort(key=lambda r: r["timestamp"])
            self._records = records
        return self._records

    def _arrivals(self, spec: ModelSpec, trace: Trace, offset_s: float) -> tuple[np.ndarray, np.ndarray]:
        """(arrival second, trace row) of each request, in arrival order.

        The trace runs on its own clock, which advances ``scale x traffic`` trace seconds per
        simulated second; a request arrives when the trace clock passes its recorded time.
        """
        phases = [p.for_model(spec.name) for p in self.phases]
        durations = np.array([p.duration_s for p in phases], dtype=np.float64)
        speeds = spec.trace_scale(trace) * np.array([p.traffic for p in phases], dtype=np.float64)
        sim_bounds = np.concatenate([[0.0], np.cumsum(durations)])
        clock_bounds = offset_s + np.concatenate([[0.0], np.cumsum(durations * speeds)])
        period = trace.period_s
        clocks, rows = [], []
        for loop in range(int(clock_bounds[0] // period), int(clock_bounds[-1] // period) + 1):
            clock = trace.t_s + loop * period
            keep = (clock >= clock_bounds[0]) & (clock < clock_bounds[-1])
            clocks.append(clock[keep])
            rows.append(np.flatnonzero(keep))
        clock = np.concatenate(clocks)
        # Phases whose clock does not move (traffic 0) hold no arrival: "right" skips them.
        phase = np.searchsorted(clock_bounds, clock, side="right") - 1
        arrival = sim_bounds[phase] + (clock - clock_bounds[phase]) / speeds[phase]
        return arrival, np.concatenate(rows)

    def _simulate(self, index: int, spec: ModelSpec) -> _ModelRun:
        rng = np.random.default_rng([self.seed, index])
        trace = load_trace(spec.trace)
        offset = spec.trace_offset_s if spec.trace_offset_s is not None else float(rng.uniform(0.0, trace.period_s))
        arrival, row = self._arrivals(spec, trace, offset)
        n = len(arrival)
        prompt = trace.prompt_tokens[row]
        wanted = trace.output_tokens[row]
        # All random draws up front, one array each: the same seed gives the same requests
        # whatever the phases switch on.
        shared = rng.random(n) < spec.system_prompt_share
        prefill_jitter = rng.lognormal(0.0, 0.1, n)
        itl_jitter = rng.lognormal(0.0, 0.05, n)
        fails = rng.random(n)
        leaks = rng.random(n)
        # (drawn after the others, so adding them left every earlier draw as it was)
        cuts = rng.random(n)
        cut_at = rng.uniform(0.2, 0.9, n)
        replica_fails = rng.random(n)

        if trace.reused_prefix_tokens is not None:
            cacheable = spec.cacheable_tokens(prompt, trace.reused_prefix_tokens[row])
            blocks = trace.first_block_id[row] if trace.first_block_id is not None else np.zeros(n, dtype=np.int64)
            # What a shipper hashing the prompt's first ~2,000 characters would send: one
            # hash per leading block (in the Mooncake trace, one system prompt for all).
            prefix_hash = [f"{spec.name}:blk{block}" for block in blocks]
        else:
            shared &= prompt > spec.system_prompt_tokens
            cacheable = spec.cacheable_tokens(prompt, np.where(shared, spec.system_prompt(prompt), 0))
            prefix_hash = [
                f"{spec.name}:{spec.route}:sys-v1" if s else f"{spec.name}:{spec.route}:user-{i}"
                for i, s in enumerate(shared)
            ]

        phases = [p.for_model(spec.name) for p in self.phases]
        bounds = list(np.cumsum([p.duration_s for p in phases]))

        def phase_at(t: float) -> SimPhase:
            return phases[min(bisect.bisect_right(bounds, t), len(phases) - 1)]

        output, max_tokens, finish = self._client_side(
            spec, phases, bounds, arrival, prompt, wanted, fails, cuts, cut_at
        )
        leak_rate = np.array([p.leak_rate for p in phases])[self._phase_index(bounds, arrival)]
        leaked = leaks < leak_rate

        start = np.zeros(n)
        prefill = np.zeros(n)
        decode = np.zeros(n)
        instance = np.zeros(n, dtype=np.int64)
        cached = np.zeros(n, dtype=np.int64)

        engines = spec.instances
        slots = spec.max_num_seqs
        kv_budget = spec.kv_tokens
        # What a running request holds in the KV cache: its prompt and the answer it will write.
        needs = prompt + output
        kv_held = np.zeros(n, dtype=np.int64)
        busy = [0] * engines
        held = [0] * engines
        # Per (phase, engine) that restarted at the phase's start: the prefixes prefilled since.
        warmed: dict[tuple[int, int], set[str]] = {}
        queues: list[deque[int]] = [deque() for _ in range(engines)]
        # Departures (time, engine, KV tokens freed) and capacity changes at phase boundaries (time, -1, 0).
        events: list[tuple[float, int, int]] = [(b, -1, 0) for b in bounds[:-1]]
        heapq.heapify(events)
        next_engine = 0

        def limit(t: float) -> int:
            return max(1, int(slots * phase_at(t).capacity_factor))

        def kv_limit(t: float) -> float:
            """The engine's KV tokens usable at ``t`` (lost capacity is lost KV memory too)."""
            return math.inf if kv_budget is None else max(1, int(kv_budget * phase_at(t).capacity_factor))

        def fits(i: int, engine: int, now: float) -> bool:
            """A free slot, and room for the request's tokens (one too large for the whole cache runs alone)."""
            if busy[engine] >= limit(now):
                return False
            room = kv_limit(now)
            return held[engine] + min(int(needs[i]), room) <= room

        def begin(i: int, engine: int, now: float) -> None:
            busy[engine] += 1
            tokens = int(min(needs[i], kv_limit(now)))
            held[engine] += tokens
            load = busy[engine] / slots  # the batch this request joins, itself included
            engine_phase = phase_at(now)
            hit = int(cacheable[i]) if engine_phase.prefix_caching else 0
            if engine in engine_phase.cold_instances:
                since_restart = warmed.setdefault((id(engine_phase), engine), set())
                if prefix_hash[i] not in since_restart:  # its first since the restart: prefilled whole, then cached
                    hit = 0
                    since_restart.add(prefix_hash[i])
            p = (spec.prefill_overhead_s + (prompt[i] - hit) * spec.prefill_s_per_token * prefill_jitter[i]) * (
                1.0 + spec.prefill_contention * load
            )
            p *= engine_phase.ttft_factor
            if prompt[i] > engine_phase.slow_prompt_tokens:
                p *= engine_phase.prefill_slowdown
            itl = spec.itl_s * engine_phase.decode_slowdown * (1.0 + spec.batch_factor * load) * itl_jitter[i]
            if engine in engine_phase.fault_instances:
                p *= engine_phase.instance_prefill_factor
                itl *= engine_phase.instance_decode_factor
            d = itl * max(int(output[i]) - 1, 0)
            start[i], prefill[i], decode[i], instance[i] = now, p, d, engine
            cached[i], kv_held[i] = hit, tokens
            heapq.heappush(events, (now + p + d, engine, tokens))

        def fill(engine: int, now: float) -> None:
            queue = queues[engine]
            while queue and fits(queue[0], engine, now):
                begin(queue.popleft(), engine, now)

        def advance(until: float) -> None:
            """Process every departure and phase change up to ``until``, in time order."""
            while events and events[0][0] <= until:
                now, engine, tokens = heapq.heappop(events)
                if engine < 0:  # a phase boundary: capacity may have come back
                    for e in range(engines):
                        fill(e, now)
                else:
                    busy[engine] -= 1
                    held[engine] -= tokens
                    fill(engine, now)

        for i in range(n):
            now = float(arrival[i])
            advance(now)
            # Fewest requests in the system wins; ties go round-robin, so idle engines share work.
            routed = phase_at(now)
            serving = [
                e for e in range(min(routed.serving_instances or engines, engines)) if e not in routed.down_instances
            ] or [0]
            best = min(
                (serving[(next_engine + k) % len(serving)] for k in range(len(serving))),
                key=lambda e: busy[e] + len(queues[e]),
            )
            next_engine = (serving.index(best) + 1) % len(serving)
            if queues[best] or not fits(i, best, now):
                queues[best].append(i)
            else:
                begin(i, best, now)
        advance(math.inf)
        # A faulty replica's failures: decided where the request was served (after its prefill).
        for k, p in enumerate(phases):
            if not p.instance_error_rate or not p.fault_instances:
                continue
            hit = (self._phase_index(bounds, start) == k) & np.isin(instance, p.fault_instances)
            for i in np.flatnonzero(hit & (replica_fails < p.instance_error_rate)).tolist():
                finish[i], output[i], decode[i] = "error", 0, 0.0

        return _ModelRun(
            spec, arrival, start, prefill, decode, instance, prompt, cached, output, max_tokens, finish,
            prefix_hash, leaked, kv_held,
        )  # fmt: skip

    @staticmethod
    def _phase_index(bounds: list[float], t: np.ndarray) -> np.ndarray:
        """The phase each time falls in (the last one after the end), as ``phase_at`` says."""
        return np.minimum(np.searchsorted(np.asarray(bounds), t, side="right"), len(bounds) - 1)

    def _client_side(
        self, spec: ModelSpec, phases: list[SimPhase], bounds: list[float], arrival: np.ndarray, prompt: np.ndarray,
        wanted: np.ndarray, fails: np.ndarray, cuts: np.ndarray, cut_at: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:  # fmt: skip
        """(answer tokens, ``max_tokens``, finish reason) of each request: decided by the client
        when it sends the request (the phase it arrives in), before any engine sees it, so an
        engine knows the tokens a request will hold."""
        phase = self._phase_index(bounds, arrival)
        limit = np.array([p.max_tokens for p in phases], dtype=np.int64)[phase]
        # A background share of clients asks for less than the answer needs.
        cut = (cuts < spec.truncation_rate) & (wanted >= 2)
        limit = np.where(cut, np.minimum(limit, np.maximum(1, (wanted * cut_at).astype(np.int64))), limit)
        output = np.minimum(wanted, limit)
        length = wanted > limit
        error_rate = np.full(len(arrival), spec.error_rate)
        counted = np.zeros(len(arrival), dtype=bool)
        for k, p in enumerate(phases):
            if p.error_rate or p.error_count:
                low, high = p.error_prompt_tokens or (0, math.inf)
                hit = (phase == k) & (prompt >= low) & (prompt < high)
                error_rate[hit] += p.error_rate
                candidates = np.flatnonzero(hit)
                if p.error_count and len(candidates):
                    counted[candidates[np.linspace(0, len(candidates) - 1, p.error_count).round().astype(int)]] = True
        error = (fails < error_rate) | counted
        output = np.where(error, 0, output)
        finish = ["error" if e else "length" if cut_ else "stop" for e, cut_ in zip(error, length, strict=True)]
        return output.astype(np.int64), limit, finish

    def _to_records(self, index: int, run: _ModelRun) -> Iterator[dict[str, Any]]:
        spec = run.spec
        hosts = [f"10.0.{index}.{10 + e}:8000" for e in range(spec.instances)]
        for i in range(len(run.arrival)):
            queue = float(run.start[i] - run.arrival[i])
            prefill, decode = float(run.prefill[i]), float(run.decode[i])
            ttft = queue + prefill
            e2e = ttft + decode
            finish = run.finish[i]
            record: dict[str, Any] = {
                "request_id": f"{spec.name}-{i}",
                "timestamp": round(self.start + float(run.arrival[i]) + e2e, 4),
                "model": spec.name,
                "route": spec.route,
                "instance": hosts[run.instance[i]],
                "engine": "vllm",
                "engine_version": spec.engine_version,
                "prompt_tokens": int(run.prompt[i]),
                "cached_tokens": int(run.cached[i]),
                "completion_tokens": int(run.output[i]),
                "max_tokens": int(run.max_tokens[i]),
                "ttft_s": round(ttft, 5),
                "queue_s": round(queue, 5),
                "prefill_s": round(prefill, 5),
                "decode_s": round(decode, 5),
                "e2e_s": round(e2e, 5),
                "finish_reason": finish,
                "status_code": 500 if finish == "error" else 200,
                "prefix_hash": run.prefix_hash[i],
            }
            if self.log_content and finish != "error":
                record["reasoning_content"] = "Let me work through this step by step."
                record["content"] = "Step 3 done.</think>The answer is 42." if run.leaked[i] else "The answer is 42."
            yield record


def scenario_phases(injected: SimPhase, warmup_s: float = 600.0, recovery_s: float = 180.0) -> tuple[SimPhase, ...]:
    """Normal traffic, one injected condition, normal traffic again (a scenario's shape)."""
    return (SimPhase("normal", warmup_s), injected, SimPhase("recovery", recovery_s))
