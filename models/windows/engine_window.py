"""One engine's ``/metrics`` between two scrapes, as a window the segment detectors judge.

Request logs say how each request went; an engine's metrics say how close it is to its
limits: how full its KV cache is, how many requests wait for a slot, how many it had to
preempt. ``EngineWindow`` carries those figures for one (instance, model) interval
(``schemas.EngineInterval``) with the same surface as ``WindowStats`` where the detectors
read it (``start``/``end``/``length``, ``labels``, ``requests``, ``load()``), so the
capacity signals get the load conditioning, lifecycle, state and wording of every other
signal. Its load is the interval's finished requests and tokens per second, and what its
gauges measure (``EngineMemory``, from the scrapes before): the requests that *arrived*
(finished plus the change of running and waiting), the slots busy when its queue formed
against the most it has run, and the tokens its running requests hold. A queue beside every
slot busy is load; the same queue beside half of them idle is slots lost. A KV cache that
fills because more or longer requests run is load; one fuller for the same tokens is not.

>>> from servewatch.schemas.engine_interval import EngineInterval, LatencySummary
>>> interval = EngineInterval(instance="gpu-1:8000", model="qwen", engine="vllm", start=0.0, end=10.0,
...     prompt_tokens_per_s=20_000.0, generation_tokens_per_s=3_000.0, kv_cache_usage=0.62,
...     running=24.0, waiting=0.0, preemptions_per_s=0.2, finished={"stop": 95.0, "length": 5.0})
>>> window = EngineWindow.from_interval(interval)
>>> window.key, window.requests, window.preempted, window.preemption_trials
('gpu-1:8000|qwen', 100.0, 2, 102)
>>> round(window.load()["model_requests_per_s"], 1)
10.0
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from servewatch.schemas.engine_interval import EngineInterval, LatencySummary
from servewatch.schemas.evidence_pointer import KeptRequest

#: Queue times below this are no queue (the floor of the queue-time signal, ``models.detect.signals``).
QUEUE_FLOOR_S = 0.02


def engine_key(instance: str, model: str) -> str:
    """The detectors' key of one engine: the same bytes the scraper keys its messages with,
    so an engine's intervals and its stored state share a partition."""
    return f"{instance}|{model}"


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


@dataclass(frozen=True, slots=True)
class EngineWindow:
    key: str
    labels: dict[str, str]
    start: float
    end: float
    requests: float  # finished in the interval
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    running: float
    waiting: float | None
    kv_cache_usage: float | None
    cache_hit_rate: float  # NaN when the engine reports no prefix-cache counters
    preempted: int  # preemptions in the interval
    errors: float = 0.0  # requests finished as "error" or "abort" in the interval
    prefix_caching: str | None = None  # the engine's enable_prefix_caching (cache_config_info), as it says it
    # Latency histograms over the interval by canonical name (ttft, itl, queue_time,
    # prefill_time, ...): what the engine's own metrics say of its phases, from bucket deltas.
    latency: dict[str, LatencySummary] = field(default_factory=dict)
    # Prompt tokens per request of the requests that finished in the interval, the ones its
    # latency histograms observed (NaN where the engine does not say: vLLM's request_prompt_tokens).
    prompt_per_finished: float = math.nan
    uncached_per_finished: float = math.nan  # of those, the tokens the prefix cache did not serve
    # What the engine's earlier scrapes add (``EngineMemory``; NaN without them): requests
    # that arrived and that were scheduled in the interval, from the running and waiting
    # gauges at both ends; the slots busy when the queue these requests report formed; and
    # per-request tokens and the hit rate pooled over enough requests to mean something.
    arrived: float = math.nan
    scheduled: float = math.nan
    busy: float = math.nan
    prompt_per_request: float = math.nan
    output_per_request: float = math.nan
    pooled_hit_rate: float = math.nan
    most_running: float = math.nan  # the most requests the engine has run at a scrape (forgetting slowly)
    # Requests running on average over the interval (the mean of the gauge at its two ends):
    # the batch its decode steps ran at, where one scrape's reading is a moment of it.
    decode_batch: float = math.nan
    # 1.0 when, at the scrape ``busy`` was read at, the KV cache had no room for another
    # context of the size its running ones hold on average: full, though slots were free;
    # ``PERHAPS_FULL`` when no scrape saw a queue (the gauges cannot tell).
    kv_full: float = math.nan

    @classmethod
    def from_interval(cls, interval: EngineInterval) -> EngineWindow | None:
        """None for an interval that says nothing about capacity (no length, or a server
        restart inside it: its deltas start from zero and its gauges from an empty engine)."""
        length = interval.end - interval.start
        if length <= 0 or interval.counter_reset:
            return None
        return cls(
            key=engine_key(interval.instance, interval.model),
            labels={"model": interval.model, "instance": interval.instance, "engine": interval.engine},
            start=interval.start,
            end=interval.end,
            requests=float(sum(interval.finished.values())),
            prompt_tokens_per_s=interval.prompt_tokens_per_s or 0.0,
            output_tokens_per_s=interval.generation_tokens_per_s or 0.0,
            running=interval.running or 0.0,
            waiting=interval.waiting,
            kv_cache_usage=interval.kv_cache_usage,
            cache_hit_rate=math.nan if interval.prefix_cache_hit_rate is None else interval.prefix_cache_hit_rate,
            preempted=round((interval.preemptions_per_s or 0.0) * length),
            errors=float(interval.finished.get("error", 0.0) + interval.finished.get("abort", 0.0)),
            prefix_caching=interval.cache_config.get("enable_prefix_caching"),
            latency=interval.latency,
            prompt_per_finished=_or_nan(interval.finished_prompt_tokens),
            uncached_per_finished=_or_nan(interval.finished_uncached_prompt_tokens),
        )

    @property
    def length(self) -> float:
        return self.end - self.start

    #: Its running requests are a gauge read at the scrapes (``models.stats.capacity`` takes
    #: them as they are), not estimated from finished requests' service times.
    running_measured = True

    @property
    def preemption_trials(self) -> int:
        """Requests that could have been preempted: those finished plus those preempted."""
        return round(self.requests) + self.preempted

    # Metrics do not say which requests reuse a prefix (request logs' ``prefix_hash`` do).
    prefix_shared = 0
    prefix_reported = 0

    def load(self) -> dict[str, float]:
        """Requests and tokens per second, and concurrency (running requests); the engine is
        its own model-level load (``model_*``), as a window built on its own is.

        The per-request figures (``prompt_tokens_per_s`` and ``output_tokens_per_s`` over
        ``requests_per_s``) are pooled tokens per request times the finished requests: vLLM
        counts prompt tokens when prefill ends and a request when it finishes, so one
        interval's ratio of the two jumps whenever few requests finish (a saturated engine
        finishes at a flat rate while it prefills a burst), which is no change of mix. The
        ``model_*`` figures stay the throughput the engine served."""
        requests_per_s = self.requests / self.length
        prompt, output = self.prompt_tokens_per_s, self.output_tokens_per_s
        if not math.isnan(self.prompt_per_request):
            prompt = self.prompt_per_request * requests_per_s
        if not math.isnan(self.output_per_request):
            output = self.output_per_request * requests_per_s
        hit = self.cache_hit_rate if math.isnan(self.pooled_hit_rate) else self.pooled_hit_rate
        figures = {
            "requests": self.requests,
            "requests_per_s": requests_per_s,
            "prompt_tokens_per_s": prompt,
            "uncached_prompt_tokens_per_s": math.nan,  # scrapes give hit rates, not per-request tokens
            "output_tokens_per_s": output,
            "concurrency": self.running,
            "cache_hit_rate": hit,
            "model_requests_per_s": requests_per_s,
            "model_prompt_tokens_per_s": self.prompt_tokens_per_s,
            "model_output_tokens_per_s": self.output_tokens_per_s,
            # Slots busy, measured: what ``models.stats.capacity`` compares with the most the
            # engine has run (a queue beside far fewer busy slots than that: slots lost).
            "model_running": self.running if math.isnan(self.busy) else self.busy,
            "running_measured": 1.0,
            "most_running": self.most_running,
            "decode_batch": self.running if math.isnan(self.decode_batch) else self.decode_batch,
            "kv_full": self.kv_full,
            "arrived_per_s": self.arrived / self.length,
            "preempted": float(self.preempted),
            # The tokens its running requests hold at the recent mix: each its prompt and, half
            # way through its answer on average, half its output. KV usage follows this at the
            # same memory, so a burst of long prompts is load; NaN until the mix is known.
            "kv_demand_tokens": self.running * (self.prompt_per_request + 0.5 * self.output_per_request),
        }
        queue = self.latency.get("queue_time")
        if queue is not None and queue.count >= 1 and queue.mean_s is not None:
            # Floored as the queue-time signal is (``models.detect.signals``): below it, no queue.
            figures["queue_s"] = max(queue.mean_s, QUEUE_FLOOR_S)
        return figures

    def arrival_counts(self) -> list[tuple[float, float]] | None:
        """Requests that arrived in the interval and their prompt tokens (pooled tokens per
        request), for ``models.stats.capacity``'s demand; None when the gauges before it are
        not known (that module then takes what was served)."""
        if math.isnan(self.arrived):
            return None
        per_request = self.prompt_per_request
        if math.isnan(per_request):
            per_request = self.prompt_tokens_per_s * self.length / self.requests if self.requests > 0 else 0.0
        return [(self.arrived, self.arrived * per_request)]

    def kept_requests(self) -> tuple[KeptRequest, ...]:
        """Metrics carry no requests: the evidence of a capacity event is its figures."""
        return ()


#: Requests a pooled per-request figure (tokens per request, the hit rate) stands on: the
#: mean of 20 requests' prompt lengths, whose coefficient of variation is about 1 in LLM
#: traffic (0.8-1.3 in the public Mooncake and Azure traces), is within +-22 % (one standard
#: error) of the engine's mean, so a mix that moved 1.5x shows and one interval's luck does not.
POOLED_REQUESTS = 20
#: Requests the pooled hit rate stands on. Its hints say "fell below half the usual"; a share
#: over ``n`` requests has a standard error of at most 0.5 / sqrt(n), and weighed by prompt
#: tokens whose coefficient of variation is about 1 (as above), ``n`` requests count as n / 2.
#: Over 100, half a usual 40 % (0.2) is 2.8 standard errors: a collapse, not a few long
#: prompts that missed. (The hit-rate signal itself judges each interval with its own counts.)
POOLED_HIT_REQUESTS = 100
#: Intervals pooled at most (five minutes of 10-second scrapes): an engine too quiet to finish
#: ``POOLED_REQUESTS`` in that time gets no per-request figure (NaN) rather than a stale one.
POOLED_INTERVALS = 30
#: How far back the queue a window's requests report can have formed, at most (10-second
#: scrapes: ten minutes): requests that waited longer are a queue no scrape left unseen.
LOOKBACK_INTERVALS = 60
#: Mean running contexts the request at the head of a memory-blocked queue is taken to need.
#: A size-biased draw from lengths with a coefficient of variation ``c`` averages (1 + c^2)
#: times the mean; with c about 1 in served traffic (as above), two.
HEAD_CONTEXTS = 2.0
#: ``kv_full`` of a queue no scrape saw: the KV cache may have been full when it formed.
PERHAPS_FULL = 0.5
#: Scrapes over which the most requests an engine ran is forgotten by half (a day of 10-second
#: scrapes, as ``models.stats.capacity`` forgets capacity: a quiet night does not shrink it).
MOST_RUNNING_HALFLIFE = 8640.0


@dataclass
class _Interval:
    end: float
    running: float
    waiting: float
    prompt_tokens: float
    prefilled: float  # requests whose prefill ended (TTFT observations): prompt_tokens' clock
    output_tokens: float
    finished: float
    scheduled: float  # requests that looked up the prefix cache
    # The most that can have run at once in the interval: those running at its start plus
    # those scheduled in it (a queue that forms and drains between two scrapes shows only here).
    peak_bound: float
    kv: float  # KV-cache usage at the scrape (NaN: not reported)
    cached: float  # hit rate x prompt tokens: the cache's share, weighed by tokens


@dataclass
class EngineMemory:
    """One engine's recent scrapes: what a single interval cannot say.

    * arrivals: an engine counts a request when it finishes, and a saturated engine finishes
      at a flat rate while its queue grows, so finished requests are not demand. Its gauges
      are measured, though: requests that arrived = finished + the change of running plus
      waiting between the two scrapes, and those scheduled = finished + the change of running;
    * busy slots: a request's queue time is recorded when it finishes, up to its end-to-end
      time after it queued. Whether the engine was full *then* is read at the scrapes within
      that time that saw requests waiting, at the fullest of them (a queue forms only when no
      slot or KV block is free: the running count then is the slots the engine had); where
      no scrape saw the queue (it formed and drained between two), the most running then;
    * per-request tokens, pooled over ``POOLED_REQUESTS`` on their own clocks, and the hit rate
      over ``POOLED_HIT_REQUESTS``.
    """

    recent: deque[_Interval] = field(default_factory=lambda: deque(maxlen=LOOKBACK_INTERVALS))
    most_running: float = 0.0

    def window(self, interval: EngineInterval) -> EngineWindow | None:
        """``interval``'s window with what the earlier scrapes add; remembers ``interval``.
        Call once per interval, in order (a replayed one must not be remembered twice)."""
        window = EngineWindow.from_interval(interval)
        if window is None:
            # A restart: the engine's queue and counters start again; so does what we know.
            self.recent.clear()
            return None
        length = window.length
        running, waiting = window.running, window.waiting if window.waiting is not None else math.nan
        before = self.recent[-1] if self.recent else None
        contiguous = before is not None and abs(before.end - window.start) <= 0.5 * length
        arrived = scheduled = math.nan
        if contiguous and before is not None:
            scheduled = max(window.requests + running - before.running, 0.0)
            if not (math.isnan(waiting) or math.isnan(before.waiting)):
                arrived = max(window.requests + running + waiting - before.running - before.waiting, 0.0)
        elif before is not None:
            self.recent.clear()  # a gap: the gauges before it say nothing of this interval
        ttft = window.latency.get("ttft")
        prompt_tokens = window.prompt_tokens_per_s * length
        prefilled = ttft.count if ttft is not None else window.requests
        hit = window.cache_hit_rate
        self.recent.append(_Interval(
            window.end, running, waiting, prompt_tokens, prefilled, window.output_tokens_per_s * length,
            window.requests, window.requests if math.isnan(scheduled) else scheduled,
            running if math.isnan(scheduled) or before is None else before.running + scheduled,
            math.nan if window.kv_cache_usage is None else window.kv_cache_usage,
            math.nan if math.isnan(hit) else hit * prompt_tokens,
        ))  # fmt: skip
        self.most_running = max(self.most_running * 0.5 ** (1.0 / MOST_RUNNING_HALFLIFE), running)
        busy, kv_full = self._busy(window)
        prompt_per_request, output_per_request, pooled_hit_rate = self._pooled()
        return replace(
            window,
            most_running=self.most_running,
            arrived=arrived,
            scheduled=scheduled,
            busy=busy,
            decode_batch=0.5 * (before.running + running) if contiguous and before is not None else running,
            kv_full=kv_full,
            prompt_per_request=prompt_per_request,
            output_per_request=output_per_request,
            pooled_hit_rate=pooled_hit_rate,
        )

    def _busy(self, window: EngineWindow) -> tuple[float, float]:
        """(slots busy when the queue these requests report formed, 1.0 if the KV cache was full
        then, ``PERHAPS_FULL`` if the gauges cannot tell, 0.0 if it was not)."""
        e2e = window.latency.get("e2e")
        horizon = window.length
        if e2e is not None and e2e.count >= 1:
            horizon += max(e2e.p99_s or 0.0, e2e.p90_s or 0.0, e2e.mean_s or 0.0)
        since = window.end - horizon
        seen = [r for r in self.recent if r.end >= since]
        queued = [i for i, r in enumerate(seen) if r.waiting > 0]
        if queued:
            # The requests this window reports may have waited at any scrape that saw a queue,
            # and the gauges cannot tell whose wait was when: the queue is judged at the
            # fullest of them, slots and memory each. Slots lost leave every one of them short
            # of both; a long context waiting for blocks leaves some full and some not (its
            # wait spans scrapes at which decodes free memory a little at a time).
            readings = [self._queue_reading(seen, i) for i in queued]
            return max(running for running, _ in readings), max(full for _, full in readings)
        # No scrape saw the queue: it formed and drained between two, and the engine may have
        # been full then, of slots or of memory. Which the gauges cannot rule out is taken (up
        # to the most it has run, which stays a measured figure; its memory perhaps full, 0.5):
        # slots lost leave a queue the scrapes do see, unless demand fits in what is left, when
        # nobody waits for long, and a wait too short for one scrape to see is, as above, the
        # wait of a long context for blocks at least as likely as of slots that are gone.
        bound = max((r.peak_bound for r in seen), default=window.running)
        busy = max(min(bound, self.most_running), max((r.running for r in seen), default=window.running))
        return busy, PERHAPS_FULL

    @staticmethod
    def _queue_reading(seen: list[_Interval], i: int) -> tuple[float, float]:
        """(slots busy, 1.0 if the KV cache was full) at ``seen[i]``, a scrape that saw a queue."""
        at = seen[i]
        if i + 1 < len(seen) and seen[i + 1].waiting == 0 and (i == 0 or seen[i - 1].waiting == 0):
            # Seen at one scrape and gone by the next: a queue the engine served within
            # one interval with the slots it has. Slots lost leave requests waiting scrape
            # after scrape (demand above what is left); a moment's wait with slots free
            # is memory (a long context at the head, waiting for blocks), as when full.
            return at.running, 1.0
        # No room for the request at the queue's head. Its size is unknown, but the head of
        # a queue blocked on memory is size-biased: a long context waits where a short one
        # would have fitted, and for prompt lengths as spread as served traffic's
        # (coefficient of variation about 1) it averages about twice the running ones' mean
        # context. Full: 1 - u < HEAD_CONTEXTS * u / running.
        full = at.running > 0 and at.kv >= at.running / (at.running + HEAD_CONTEXTS)  # False for NaN
        return at.running, 1.0 if full else 0.0

    def _pooled(self) -> tuple[float, float, float]:
        """(prompt tokens per request, output tokens per request, hit rate), each over the latest
        intervals that hold ``POOLED_REQUESTS`` requests on its own clock; NaN where too few."""
        prompt = prefilled = output = finished = cached = looked_up = scheduled = 0.0
        figures = {"prompt_per_request": math.nan, "output_per_request": math.nan, "pooled_hit_rate": math.nan}
        for r in list(self.recent)[::-1][:POOLED_INTERVALS]:
            if math.isnan(figures["prompt_per_request"]):
                prompt, prefilled = prompt + r.prompt_tokens, prefilled + r.prefilled
                if prefilled >= POOLED_REQUESTS:
                    figures["prompt_per_request"] = prompt / prefilled
            if math.isnan(figures["output_per_request"]):
                output, finished = output + r.output_tokens, finished + r.finished
                if finished >= POOLED_REQUESTS:
                    figures["output_per_request"] = output / finished
            if math.isnan(figures["pooled_hit_rate"]) and not math.isnan(r.cached):
                cached, looked_up, scheduled = cached + r.cached, looked_up + r.prompt_tokens, scheduled + r.scheduled
                if scheduled >= POOLED_HIT_REQUESTS and looked_up > 0:
                    figures["pooled_hit_rate"] = cached / looked_up
        return figures["prompt_per_request"], figures["output_per_request"], figures["pooled_hit_rate"]
