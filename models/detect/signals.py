"""What each signal reads from a closed window, and which model judges it.

A ``SignalSpec`` names a signal, how to read its observation from a ``WindowStats``
(``Reading``: the value, how many requests stand behind it, and the model's inputs) and
how to build the per-segment model that judges it. Three kinds of model cover them all:

* latency-like values judged *at the current load* (``LoadConditionedLatency``): TTFT,
  queue, prefill, inter-token and end-to-end time (geometric means), decode throughput;
* rates of bad outcomes, count-aware (``BetaBinomialRate``): truncation by the length
  limit, leaked reasoning markers, empty answers, errors;
* shares that should hold (``ShareLevel``): the prefix-cache hit rate, which request logs
  also judge request by request (``CacheHitRate``: requests reusing a prompt prefix seen
  before that got no cached token).

Every model's score is the same surprise (``-log10`` of a tail probability), so one
threshold and one severity mapping serve all signals.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from servewatch.models.stats.cache_hits import CacheHitRate
from servewatch.models.stats.capacity import ARRIVAL_FIGURES
from servewatch.models.stats.latency import LoadConditionedLatency
from servewatch.models.stats.rates import BetaBinomialRate
from servewatch.models.stats.share import ShareLevel, shortfall_surprise
from servewatch.models.windows.window import WindowStats
from servewatch.schemas.anomaly import Signal

Kind = Literal["latency", "rate", "share"]

# Latency is conditioned on the load of the segment's *model* (every segment it serves
# shares its engines' batches and queues), not on the segment's own traffic: a rare
# segment's own rate is a noisy proxy, and a surge on one route slows all of them.
# Prefill and queueing answer to what *arrived* (``models.stats.capacity``): a slowing server
# finishes fewer requests and must not lower its own expectation. Decode answers to the
# batch it runs, which the requests and output tokens it finishes measure.
DECODE_DEMAND = ("model_requests_per_s", "model_output_tokens_per_s")
PREFILL_DEMAND = ARRIVAL_FIGURES
#: Load figures of a window's model (``WindowStats.load``: ``model_<figure>``).
MODEL_FIGURES = ("requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s")


@dataclass(frozen=True, slots=True)
class Reading:
    """One window's observation of one signal."""

    value: float  # seconds, tokens/s or a share
    n: int  # requests behind it (the denominator of a rate)
    x: dict[Any, Any]  # the model's inputs: load figures, sampling variance or trials
    bad: int = 0  # rates: the numerator


@dataclass(frozen=True)
class SignalSpec:
    signal: Signal
    kind: Kind
    read: Callable[[Any, dict[str, float]], Reading | None]  # a WindowStats or an EngineWindow
    build: Callable[[int], Any]  # grace windows -> a fresh model
    unit: str = "s"
    what: str = ""  # how a person says it: "TTFT p95", "share of answers cut by the length limit"
    #: Whether a window's reading is of the requests that finished in it, each measured over
    #: its whole life (a request log; an engine's per-request histograms): a fault's first
    #: window then holds requests it reached part-way. Not an engine's gauges (its state at
    #: the scrape), nor its TTFT and inter-token histograms (observed as each token comes).
    at_finish: bool = True


def _ttft(window: WindowStats, load: dict[str, float]) -> Reading | None:
    """The geometric mean of the window's TTFTs (from its histogram): a mean of logs has a
    third of the sampling noise of a p95 over the same requests, so a 2x slowdown shows in a
    window of a few dozen requests, and it moves smoothly where a quantile jumps a bucket."""
    n, mean_log, var_log = window.ttft.log_moments()
    if n == 0:
        return None
    x: dict[Any, Any] = {**load, "sampling_var": max(var_log, 0.01) / n}
    return Reading(math.exp(mean_log), n, x)


def _phase(
    name: str, floor_s: float, usual_spread: bool = False
) -> Callable[[WindowStats, dict[str, float]], Reading | None]:
    """Geometric mean of a phase; below ``floor_s`` differences are noise, not signal. With
    ``usual_spread`` its sampling noise is judged from the segment's usual spread within a
    window, not this window's (``LoadConditionedLatency._sampling_var``)."""

    def read(window: WindowStats, load: dict[str, float]) -> Reading | None:
        phase = window.phase(name)
        if phase.n == 0:
            return None
        if usual_spread:
            x: dict[Any, Any] = {**load, "n": phase.n, "within_var": phase.var_log}
        else:  # a mean of logs' sampling variance, floored: identical values claim no certainty
            x = {**load, "sampling_var": max(phase.var_log, 0.01) / phase.n}
        return Reading(max(phase.geometric_mean, floor_s), phase.n, x)

    return read


def _decode_throughput(window: WindowStats, load: dict[str, float]) -> Reading | None:
    """Output tokens/s per running request: decoded tokens over decode seconds (token-weighted)."""
    seconds, itl = window.decode_s, window.phase("itl")
    if seconds <= 0 or itl.n == 0:
        return None
    x: dict[Any, Any] = {**load, "sampling_var": max(itl.var_log, 0.01) / itl.n}
    return Reading(window.decode_tokens / seconds, itl.n, x)


def _rate(numerator: str, denominator: str) -> Callable[[WindowStats, dict[str, float]], Reading | None]:
    def read(window: WindowStats, load: dict[str, float]) -> Reading | None:
        bad = int(getattr(window, numerator))
        trials = int(getattr(window, denominator))
        if trials <= 0:
            return None
        # The window's seconds: how many bad requests a minute, for a page's severity.
        return Reading(bad / trials, trials, {"trials": trials, "seconds": window.length}, bad)

    return read


#: Share of requests reusing a prefix seen before from which the cache *must* hit, and the
#: hit rate it must then reach at least, per unit of that share: a shared prefix may be a
#: small part of a prompt, so only a near-zero hit rate is judged this way.
SHARED_PREFIX_SHARE = 0.5
HIT_RATE_PER_SHARED_REQUEST = 0.1


def _cache_hit_rate(window: WindowStats, load: dict[str, float]) -> Reading | None:
    rate = window.cache_hit_rate
    if math.isnan(rate):
        return None
    n = window.requests
    hashed = window.prefix_reported
    if hashed >= n > 0 and not window.prefix_shared:
        # Every request says what its prompt starts with and none starts as one seen before:
        # there was nothing for the cache to serve, so its hit rate says nothing of it (a few
        # one-off prompts in a quiet window of a segment that usually shares a system prompt).
        return None
    shared = window.prefix_shared / hashed if hashed else 0.0
    x = {"trials": n, "prefix_shared_share": shared}
    if window.prefix_shared:
        x.update(reused=window.prefix_shared, reused_missed=window.prefix_shared_missed)
    return Reading(rate, n, x)


def structural_cache_surprise(reading: Reading, spread_var: float = 0.15**2) -> tuple[float, float]:
    """(surprise, expected hit rate) from prefix sharing alone: many requests reuse a prefix
    seen before, yet the cache serves almost nothing. Needs no history, so it also catches
    a segment whose caching was never on. (0, 0) when too few requests share a prefix."""
    shared = float(reading.x.get("prefix_shared_share", 0.0))
    if shared < SHARED_PREFIX_SHARE:
        return 0.0, 0.0
    expected = HIT_RATE_PER_SHARED_REQUEST * shared
    return shortfall_surprise(reading.value, expected, reading.n, spread_var), expected


def _latency(features: tuple[str, str] = PREFILL_DEMAND, **kwargs: Any) -> Callable[[int], LoadConditionedLatency]:
    return lambda grace: LoadConditionedLatency(grace_windows=grace, features=features, **kwargs)


def _rate_spec(signal: Signal, numerator: str, denominator: str, what: str, prior_rate: float = 0.005) -> SignalSpec:
    """A count-aware rate: ``numerator`` bad requests out of ``denominator``."""

    def build(grace: int) -> BetaBinomialRate:
        return BetaBinomialRate(prior_rate=prior_rate, grace_windows=grace)

    return SignalSpec(signal, "rate", _rate(numerator, denominator), build, unit="", what=what)


#: Queue-like figures: steep with demand near capacity, and no drift check (spiky).
_QUEUE_LIKE: dict[str, Any] = {"elasticity": 0.5, "surge_elasticity": 3.0, "elasticity_sd": 1.5, "drift_after": 0}

# fmt: off
SPECS: tuple[SignalSpec, ...] = (
    SignalSpec(Signal.TTFT, "latency", _ttft, _latency(), what="TTFT (geometric mean)"),
    # Queueing grows like rho / (1 - rho), with an elasticity of 1 / (1 - rho): 4 at 75 %
    # utilisation. Steeper with demand than any other phase, and less predictable.
    SignalSpec(Signal.QUEUE_TIME, "latency", _phase("queue", 0.02),
               _latency(**_QUEUE_LIKE), what="queue time"),
    SignalSpec(Signal.PREFILL_TIME, "latency", _phase("prefill", 0.005), _latency(), what="prefill time"),
    # Conditioned per request on prompt length: the per-token cost barely varies within a
    # band, so a slowdown of a subset (the longest prompts) moves it where the time does not.
    SignalSpec(Signal.PREFILL_PER_TOKEN, "latency", _phase("prefill_token", 0.001, usual_spread=True), _latency(),
               what="prefill time per 1,000 uncached prompt tokens"),
    SignalSpec(
        Signal.ITL, "latency", _phase("itl", 0.001), _latency(DECODE_DEMAND, elasticity=0.1), what="inter-token latency"
    ),
    # Queue time is mostly zero with bursts, end-to-end time follows the output lengths asked
    # for: neither has a level whose slow creep means a fault (drift_after=0). TTFT, prefill
    # per token and decode do.
    SignalSpec(Signal.E2E, "latency", _phase("e2e", 0.05), _latency(drift_after=0), what="end-to-end time"),
    SignalSpec(
        Signal.THROUGHPUT,
        "latency",
        _decode_throughput,
        _latency(DECODE_DEMAND, elasticity=-0.1, surge_elasticity=-0.3, tail="lower"),
        unit="tokens/s",
        what="decode tokens/s per request",
    ),
    _rate_spec(Signal.LENGTH_TRUNCATION, "truncated", "requests", "share of answers cut by the length limit"),
    _rate_spec(Signal.REASONING_LEAK, "reasoning_leaks", "content_reported",
               "share of answers with a reasoning end marker in the text", prior_rate=0.001),
    _rate_spec(Signal.EMPTY_RESPONSE, "empty_answers", "content_reported",
               "share of empty answers with reasoning text present", prior_rate=0.001),
    _rate_spec(Signal.ERROR_RATE, "errors", "requests", "error rate"),
    SignalSpec(
        Signal.CACHE_HIT_RATE,
        "share",
        _cache_hit_rate,
        lambda grace: CacheHitRate(grace_windows=grace),
        unit="",
        what="prefix-cache hit rate",
    ),
)

# fmt: on


# -- capacity, from engine metrics (``models.windows.engine_window.EngineWindow``) ----------------
#: Readings below this are floored: an idle engine's KV cache at 0.2 % and at 0.5 % are the same.
KV_USAGE_FLOOR = 0.02
#: A queue of none and a queue of one are both "no queue" to a log-scale model.
WAITING_FLOOR = 1.0
#: The squared coefficient of variation of one request's context (prompt plus answer tokens):
#: 0.7-1.6 in the public serving traces (Mooncake conversation 1.6, Azure code 0.9, Azure chat
#: 0.7). The KV cache holds the running requests' contexts, so its usage over ``k`` of them
#: varies by about this over ``k`` (log scale) from which requests happen to run.
CONTEXT_CV2 = 1.0
#: KV usage is judged at the tokens the engine's running requests hold at the recent mix
#: (``EngineWindow.load``: running x tokens per request): the cache fills in proportion to it
#: at the same memory, whether more requests run (a surge, a slower engine holding them
#: longer) or longer ones (a burst of long prompts).
KV_DEMAND = ("kv_demand_tokens", "kv_demand_tokens")
#: An engine's inter-token latency is judged at the batch it decodes (the requests running
#: over the interval, which its scrapes measure at both ends) and the output tokens/s it
#: serves. Each decode step reads every running request's KV, so a burst that fills the batch
#: slows every token, however few requests arrived (long answers hold their slots): arrivals
#: under-predict it. The figures' mean still shows a slowdown: output tokens/s are the batch
#: over the inter-token latency, so a decode s times slower raises the batch (Little's law,
#: where slots are free) by as much as it lowers tokens/s per running request, and moves the
#: index by half of log s at most.
ENGINE_DECODE_DEMAND = ("decode_batch", "model_output_tokens_per_s")


def _kv_usage(window: Any, load: dict[str, float]) -> Reading | None:
    """KV usage at the tokens the running requests hold (``KV_DEMAND``): a cache that fills
    because more requests run, or longer ones, is load; one fuller at the same tokens (less
    memory after a restart, blocks not freed) is not.

    Its noise: the model learns the engine's churn where it usually runs; a reading over fewer
    contexts varies more, by the sums' variance over ``n`` contexts against over the most it
    runs (``CONTEXT_CV2``): two long prompts fill a quarter of an otherwise idle code engine's
    cache, which says nothing of its memory."""
    usage, running = window.kv_cache_usage, window.running
    if usage is None or running <= 0 or not load.get("kv_demand_tokens", math.nan) > 0:
        return None  # an idle engine's cache says nothing about its capacity, nor one whose mix is unknown
    n = max(round(running), 1)  # contexts behind the reading: few running, no verdict (min_requests)
    most = getattr(window, "most_running", math.nan)
    extra = CONTEXT_CV2 * max(1.0 / n - (1.0 / most if most >= 1 else 0.0), 0.0)
    return Reading(max(usage, KV_USAGE_FLOOR), n, {**load, "sampling_var": extra})


def _waiting(window: Any, load: dict[str, float]) -> Reading | None:
    """The requests waiting at the scrape: a count, whose log has a sampling variance of
    about one over the count (Poisson), so 2 waiting against a usual 1 is no news while 40
    is; the ``+ 1`` keeps a queue of none or one as uncertain as it is."""
    waiting = window.waiting
    if waiting is None or window.requests + window.running <= 0:
        return None
    n = max(round(window.requests + window.running), 1)
    return Reading(max(waiting, WAITING_FLOOR), n, {**load, "sampling_var": 1.0 / (max(waiting, 0.0) + 1.0)})


def _engine_latency(name: str, floor_s: float) -> Callable[[Any, dict[str, float]], Reading | None]:
    """The interval's mean of one of the engine's latency histograms (delta of _sum over
    delta of _count: exact, where its quantiles are interpolated within coarse buckets),
    with the sampling variance of a mean of ``count`` requests whose log spread the
    histogram's p90/p50 gives."""

    def read(window: Any, load: dict[str, float]) -> Reading | None:
        summary = window.latency.get(name)
        if summary is None or summary.count < 1 or summary.mean_s is None:
            return None
        n = round(summary.count)
        spread = 0.5  # log sd when the buckets cannot tell
        if summary.p50_s and summary.p90_s and summary.p90_s > summary.p50_s:
            spread = math.log(summary.p90_s / summary.p50_s) / 1.2816
        return Reading(max(summary.mean_s, floor_s), n, {**load, "sampling_var": max(spread**2, 0.01) / n})

    return read


def _engine_hit_rate(window: Any, load: dict[str, float]) -> Reading | None:
    """Cached over looked-up prompt tokens in the interval, from the engine's own counters,
    over the requests that looked the cache up (scheduled in the interval, where the gauges
    say it; else finished): a token-weighted share of ten requests is ten requests' worth
    of evidence, not thousands of tokens' (a request's blocks hit or miss together)."""
    scheduled = getattr(window, "scheduled", math.nan)
    rate, n = window.cache_hit_rate, round(window.requests if math.isnan(scheduled) else scheduled)
    if math.isnan(rate) or n <= 0:
        return None
    return Reading(rate, n, {"trials": n, "prefix_shared_share": 0.0})


#: The signals of one engine (instance and model), judged on its scrapes: its phases'
#: latency, how full its KV cache is and how long its queue, at the load it serves, how
#: often it preempts requests for want of KV blocks, and its prefix-cache hit rate.
# fmt: off
ENGINE_SPECS: tuple[SignalSpec, ...] = (
    # The phases as the engine measures them, with the request-log phases' models: a server
    # that logs no requests is still judged on its TTFT, queue, prefill and inter-token time.
    SignalSpec(Signal.TTFT, "latency", _engine_latency("ttft", 0.005), _latency(), what="mean TTFT", at_finish=False),
    SignalSpec(Signal.QUEUE_TIME, "latency", _engine_latency("queue_time", 0.02),
               _latency(**_QUEUE_LIKE), what="mean queue time"),
    SignalSpec(Signal.PREFILL_TIME, "latency", _engine_latency("prefill_time", 0.005), _latency(),
               what="mean prefill time"),
    SignalSpec(Signal.ITL, "latency", _engine_latency("itl", 0.001), _latency(ENGINE_DECODE_DEMAND),
               what="mean inter-token latency", at_finish=False),
    # Proportional to the running requests (elasticity 1, no hinge: each holds one context),
    # learned within a physical range (a burst of long prompts runs fewer, fuller contexts).
    SignalSpec(Signal.KV_CACHE_USAGE, "latency", _kv_usage,
               _latency(KV_DEMAND, elasticity=1.0, elasticity_sd=0.3, surge_elasticity=0.0), unit="",
               what="KV-cache usage", at_finish=False),
    SignalSpec(Signal.WAITING_REQUESTS, "latency", _waiting,
               _latency(**_QUEUE_LIKE), unit="requests",
               what="waiting requests", at_finish=False),
    _rate_spec(Signal.PREEMPTIONS, "preempted", "preemption_trials", "share of requests preempted",
               prior_rate=0.001),
    SignalSpec(Signal.CACHE_HIT_RATE, "share", _engine_hit_rate, lambda grace: ShareLevel(tail="lower",
               grace_windows=grace), unit="", what="prefix-cache hit rate"),
)
# fmt: on

#: Each source's signals: request-log windows (``WindowStats``) and engine intervals
#: (``EngineWindow``) read the same signal, e.g. the prefix-cache hit rate, differently.
SPEC_SETS: dict[str, dict[Signal, SignalSpec]] = {
    "requests": {spec.signal: spec for spec in SPECS},
    "engines": {spec.signal: spec for spec in ENGINE_SPECS},
}
#: Every signal's spec, the request-log one where both sources have it.
BY_SIGNAL = {**SPEC_SETS["engines"], **SPEC_SETS["requests"]}
