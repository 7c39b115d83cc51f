"""Likely causes, from the same window statistics the detectors read.

Each rule is a pure function of the window, the segment's recent normal figures and the
verdict; it returns a ``Hint`` or ``None``. Rules are ranked by how far their evidence
moved, so the first hint is the best guess. Codes are a documented, stable set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from servewatch.models.stats.baseline import Baseline
from servewatch.models.windows.window import WindowStats
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Signal

#: The documented set of hint codes: what each likely cause means. Codes are stable (alert
#: routing and runbooks key on them); messages say the figures behind each one.
HINT_CODES: dict[str, str] = {
    "prefix_cache_ineffective": "shared prompt prefixes are common but the prefix-cache hit rate collapsed",
    "prefix_cache_disabled": "the engine's own metrics report enable_prefix_caching=False",
    "prefill_bound": "more prefill work per request (uncached prompt tokens) or slower prefill per token",
    "traffic_shift": "the request mix moved to longer prompts or outputs",
    "queueing": "the latency rise is in line with the load: capacity, not a fault",
    "decode_slowdown": "decode is slower per output token at this load",
    "output_truncated": "answers cut by the length limit (finish_reason=length); names the max_tokens seen",
    "reasoning_marker_in_content": "the reasoning end marker shows in the answer; names the engine version seen",
    "kv_cache_pressure": "the KV cache is fuller than usual at this load",
    "queue_building": "more requests wait for a slot than usual at this load",
    "kv_cache_exhausted": "requests are preempted for want of KV-cache blocks",
    "capacity_headroom": "high prefix-cache hit rate, low KV usage and a waiting queue: max_num_seqs can go up",
    "error_burst": "requests fail (error, abort or HTTP 5xx)",
    "new_segment": "the segment's baseline is young: a new workload, judged against its model's usual",
    "level_shift": "a lasting change was adopted as the new normal",
    "capacity_saturated": "arrivals far above usual while the engines serve flat out: the queue is load, not a fault",
    "capacity_lost": "the engines serve well below the capacity they have shown while requests queue, "
    "or requests queue while far fewer slots are busy than ever (slots lost)",
    "latency_drift": "latency crept up over hours at the same demand (the level left its slow anchor)",
    "latency_rise": "latency rose while demand, mix, cache, prefill per token and queue stayed usual",
    "traffic_drop": "a model's requests fell to a small share of its usual for the hour (it went dark)",
    "replica_outlier": "one serving instance is slower or fails more than the other instances of its model on the "
    "same request mix (drain it)",
    "no_data": "the segment sent nothing for a while: its open incident ended without evidence it recovered",
    "change_marker": "the incident started soon after a change marked on its model (servewatch mark): suspect "
    "the change first",
    "rollback_condition_met": "a declared rollback condition holds on the requests after a change, against "
    "those before it on the same mix",
}


#: Tokens per request (prompt or output) this many times the usual: the mix moved.
TRAFFIC_SHIFT_RATIO = 1.5


def _ratio(now: float, usual: float) -> float:
    if math.isnan(now) or math.isnan(usual) or usual <= 0:
        return math.nan
    return now / usual


#: Signals whose time includes prefill: only for these can the prefix cache be the cause.
PREFILL_SIGNALS = frozenset({Signal.TTFT, Signal.PREFILL_TIME, Signal.E2E, Signal.PREFILL_PER_TOKEN})
#: Signals whose time includes waiting for a slot.
QUEUE_SIGNALS = frozenset({Signal.TTFT, Signal.QUEUE_TIME, Signal.E2E, Signal.WAITING_REQUESTS})
#: Slots kept busy over a window, as a share of the most ever, at which the engines count as
#: full for much of it (a burst of seconds straddles windows, so its average is below the
#: most). The detectors judge saturation with it too (``SignalDetector._saturated``).
MOMENTARY_BUSY = 0.7
#: Served throughput below this share of capacity while requests queue: capacity was lost.
CAPACITY_LOST_SHARE = 0.75
#: Queue time (or prefill time per token) this many times the usual is a cause worth naming.
QUEUE_RATIO = 3.0
PREFILL_SLOWER_RATIO = 1.5


def latency_hints(
    load: dict[str, float],
    usual: Baseline,
    *,
    explained_by_load: bool,
    signal: Signal = Signal.TTFT,
    cause: str | None = None,
) -> list[Hint]:
    """Hints for a latency anomaly of ``signal``, best first; ``cause`` is the verdict's
    (``"saturated"``, ``"drift"``; see ``SignalDetector.judge``).

    Longer prompts mean more uncached tokens too: prefill work that grew *per prompt token*
    points at the cache (``prefill_bound``), prefill work that grew with the prompts at the
    mix of requests (``traffic_shift``). The cache and prefill are named only for signals
    whose time includes prefill; queueing and lost capacity only for those that include
    the queue.
    """
    ranked: list[tuple[float, Hint]] = []

    def rank(score: float, code: str, message: str) -> None:
        ranked.append((score, Hint(code=code, message=message)))

    requests_per_s = load.get("requests_per_s", 0.0)

    def per_request(name: str) -> float:
        return load.get(name, math.nan) / requests_per_s if requests_per_s > 0 else math.nan

    prompt_now, output_now = per_request("prompt_tokens_per_s"), per_request("output_tokens_per_s")
    prompt_ratio = _ratio(prompt_now, usual.prompt_tokens_per_request)
    output_ratio = _ratio(output_now, usual.output_tokens_per_request)
    traffic_ratio = _ratio(requests_per_s, usual.requests_per_s)
    saturated = load.get("saturated", 0.0) > 0 and not engine_slots_idle(load)
    if cause == "saturated" or (explained_by_load and saturated and signal in QUEUE_SIGNALS):
        rank(9.0, "capacity_saturated", _saturated(load))
    if cause == "cache" and signal in PREFILL_SIGNALS:
        # Judged beside the segment's failing prefix cache (``models.detect.detector``): the rise
        # is what that failure predicts, whatever the hit rate's dip in this window alone.
        hit_now = load.get("cache_hit_rate", math.nan)
        seen = f" ({hit_now:.0%} of prompt tokens cached against a usual {usual.cache_hit_rate:.0%})" if (
            not math.isnan(hit_now)) else ""  # fmt: skip
        failing = f"the segment's prefix-cache hit rate is failing{seen}{_reuse_missed(load)}"
        rank(12.0, "prefix_cache_ineffective", f"{failing}: prompts are computed again; check that prefix "
             "caching is enabled (enable_prefix_caching) on the serving instances")  # fmt: skip
    if signal in PREFILL_SIGNALS:
        _prefill_hints(load, usual, prompt_ratio, per_request("uncached_prompt_tokens_per_s"), rank)
    longer = [
        (ratio, what, now, before)
        for ratio, what, now, before in (
            (prompt_ratio, "prompts", prompt_now, usual.prompt_tokens_per_request),
            (output_ratio, "outputs", output_now, usual.output_tokens_per_request),
        )
        if not math.isnan(ratio) and ratio >= TRAFFIC_SHIFT_RATIO
    ]
    if longer:
        ratio, what, now, before = max(longer)
        rate = f"{traffic_ratio:.1f}x" if not math.isnan(traffic_ratio) else "an unknown share of"
        rank(
            5.5 + math.log(ratio),
            "traffic_shift",
            f"the request mix moved to longer {what}: {now:,.0f} tokens per request against "
            f"{before:,.0f} usual ({ratio:.1f}x) at {rate} the usual requests/s",
        )
    if signal in QUEUE_SIGNALS and not explained_by_load:  # a queue that load explains is no fault
        _queue_hints(load, usual, rank)
    if cause == "drift":
        rank(
            3.5,
            "latency_drift",
            "latency has crept up over the last hours at the same demand, a little every window: "
            "look for what accumulates (memory fragmentation, a growing KV-cache offload tier, "
            "a leak in the serving process, thermal throttling)",
        )
    if explained_by_load and not ranked and not math.isnan(traffic_ratio):
        rank(
            4.0 + abs(math.log(max(traffic_ratio, 1e-9))),
            "queueing",
            f"requests/s is {traffic_ratio:.1f}x its usual level; the rise is in line with load "
            "(capacity, not a fault)",
        )
    ranked.sort(key=lambda item: item[0], reverse=True)
    best: dict[str, Hint] = {}
    for _, hint in ranked:
        best.setdefault(hint.code, hint)  # a cause named twice: its best-ranked reading
    return list(best.values())


def _saturated(load: dict[str, float]) -> str:
    if load.get("running_measured", 0.0) > 0:
        return _engine_saturated(load)
    served, capacity = load.get("model_requests_per_s", math.nan), load.get("capacity_requests_per_s", math.nan)
    surge = load.get("arrivals_vs_usual", math.nan)
    return (
        f"requests arrive at {surge:.1f}x their usual rate while the model's engines serve "
        f"{served:.1f} req/s, as much as they have ever served ({capacity:.1f}): requests queue for "
        "a slot; capacity, not a fault (add engines or raise max_num_seqs if memory allows)"
    )


def slots_short_now(load: Mapping[str, float]) -> bool:
    """Whether a queue at no more than the usual demand met engines that kept well fewer
    slots busy in this window than they ever have (``running_now_vs_most`` below
    ``MOMENTARY_BUSY``): a burst too short to lift a window's arrivals fills every slot in the
    window that holds it, while slots lost show in the window's own figure before the smoothed
    one (``running_vs_most``) lets go of the full windows before them. Not where the queue is
    older than the arrivals the demand figure sees (``arrivals_seen_s``): a past surge's
    backlog, whose demand is not in that figure, drains through windows that read low."""
    return (
        load.get("arrivals_vs_usual", math.inf) <= 1.0
        and load.get("running_now_vs_most", math.nan) < MOMENTARY_BUSY
        and load.get("queue_s", math.inf) < load.get("arrivals_seen_s", math.nan)
    )


def slots_kept_full(load: Mapping[str, float], *, unknown: bool) -> bool:
    """Whether the model's engines kept nearly as many slots busy as they ever have while a
    queue formed (``running_vs_most`` at least ``MOMENTARY_BUSY``), and, at no more than the
    usual demand, in the window itself too (``slots_short_now``); ``unknown`` before the most
    they keep is learned."""
    busy = load.get("running_vs_most")
    if busy is None:
        return unknown
    return busy >= MOMENTARY_BUSY and not slots_short_now(load)


def engine_slots_idle(load: dict[str, float]) -> bool:
    """An engine's gauges say it ran well below the most it has (its KV cache not full) when
    its queue formed: whatever demand did, that queue is not saturation
    (``SignalDetector._saturated``)."""
    if not load.get("running_measured", 0.0) or "running_vs_most" not in load:
        return False  # nothing measured, or no "most" learned yet to be below
    return load["running_vs_most"] < MOMENTARY_BUSY and not load.get("kv_full", 0.0) > 0


def _engine_saturated(load: dict[str, float]) -> str:
    """An engine's own figures (``EngineWindow.load``): what arrived, what it served, and the
    slots it ran when its queue formed against the most it has run."""
    arrived, served = load.get("arrived_per_s", math.nan), load.get("model_requests_per_s", math.nan)
    running, most = load.get("model_running", math.nan), load.get("most_running", math.nan)
    kv_full = load.get("kv_full", 0.0)
    full = " with its KV cache full" if kv_full >= 1 else " with its KV cache perhaps full" if kv_full > 0 else ""
    arrivals = f"{arrived:.1f} req/s arrive" if not math.isnan(arrived) else "requests arrive"
    surge = load.get("arrivals_vs_usual", math.nan)
    if surge > 0:
        arrivals += f" (up to {surge:.1f}x the usual in the last windows)"
    return (
        f"{arrivals} against {served:.1f} req/s served while the engine runs {running:.0f} requests, as many "
        f"as it ever has ({most:.0f}){full}: requests queue for a slot; capacity, not a fault (add engines, or raise "
        "max_num_seqs if memory allows)"
    )


def _prefill_hints(
    load: dict[str, float], usual: Baseline, prompt_ratio: float, uncached_now: float, rank: Callable[..., None]
) -> None:
    hit_now = load.get("cache_hit_rate", math.nan)
    uncached_ratio = _ratio(uncached_now, usual.uncached_tokens_per_request)
    per_1k, usual_per_1k = Baseline.prefill_per_1k(load), usual.prefill_s_per_1k_tokens
    slower = _ratio(per_1k, usual_per_1k)
    # Prefill seconds per request against the usual (NaN where prefill is not logged): a cache
    # that serves less leads only where prefill itself grew; a window's low hit rate beside a
    # queue that makes the whole rise (lost slots) is a coincidence, named last.
    prefill_growth = slower * uncached_ratio
    if not math.isnan(hit_now) and usual.cache_hit_rate >= 0.2 and hit_now < usual.cache_hit_rate / 2:
        leads = math.isnan(prefill_growth) or prefill_growth >= PREFILL_SLOWER_RATIO
        rank(
            (10.0 if leads else 3.0) + (usual.cache_hit_rate - hit_now) * 10,
            "prefix_cache_ineffective",
            f"prefix-cache hit rate fell to {hit_now:.0%} from a usual {usual.cache_hit_rate:.0%}"
            f"{_reuse_missed(load)}; check that prefix caching is enabled (enable_prefix_caching) on the "
            "serving instances",
        )
    # The rise in uncached tokens that longer prompts do not account for.
    beyond_prompts = uncached_ratio / max(prompt_ratio, 1.0) if not math.isnan(prompt_ratio) else uncached_ratio
    if not math.isnan(beyond_prompts) and beyond_prompts >= 2.0:
        rank(
            5.0 + math.log(beyond_prompts),
            "prefill_bound",
            f"uncached prompt tokens per request rose {uncached_ratio:.1f}x "
            f"({uncached_now:,.0f} vs {usual.uncached_tokens_per_request:,.0f}): prefill work grew",
        )
        return
    if not math.isnan(slower) and slower >= PREFILL_SLOWER_RATIO:
        rank(
            6.0 + math.log(slower),
            "prefill_bound",
            f"prefill takes {per_1k:.2f} s per 1,000 uncached prompt tokens against {usual_per_1k:.2f} s "
            f"usually ({slower:.1f}x slower per token, at the same cache hit rate): slower prefill kernels, "
            "chunked-prefill settings, or long prompts on a busier GPU",
        )


def _reuse_missed(load: dict[str, float]) -> str:
    """The requests that reused a prompt prefix seen before yet got no cached token, if logged."""
    reused = load.get("reused_prefix_requests", 0.0)
    if reused <= 0:
        return ""
    missed = load.get("reused_prefix_missed", 0.0)
    return f" ({missed:.0f} of {reused:.0f} requests reusing a prompt prefix seen before got no cached token)"


def _queue_hints(load: dict[str, float], usual: Baseline, rank: Callable[..., None]) -> None:
    served, capacity = load.get("model_requests_per_s", math.nan), load.get("capacity_requests_per_s", math.nan)
    share = load.get("served_vs_capacity", math.nan)
    queue_now, queue_usual = load.get("queue_s", math.nan), usual.queue_s
    queue_ratio = _ratio(queue_now, queue_usual)
    queued = not math.isnan(queue_ratio) and queue_ratio >= QUEUE_RATIO
    demand = load.get("arrivals_vs_usual", math.nan)
    at_demand = f" at {demand:.1f}x the usual arrivals" if not math.isnan(demand) and demand > 0 else ""
    # A queue forms only when every slot is busy: one that forms while the engines keep far
    # fewer slots busy than they have before means slots (or KV-cache memory) were lost.
    busy = load.get("running_vs_most", math.nan)
    if slots_short_now(load):  # the figure that judged the queue a fault is the one to show
        busy = min(busy, load["running_now_vs_most"])
    if queued and not math.isnan(busy) and busy < CAPACITY_LOST_SHARE:
        rank(  # the cause, ahead of the queue it leaves (``queue_building`` ranks at most 9)
            9.5 + (1.0 - busy),
            "capacity_lost",
            f"requests queue while the model's engines keep {busy:.0%} of the slots busy that they have kept"
            f"{at_demand}: slots were lost (an engine down or restarted, a lower max_num_seqs, less KV-cache "
            "memory per engine)",
        )
    elif not math.isnan(share) and share < CAPACITY_LOST_SHARE and (queued or math.isnan(queue_ratio)):
        rank(
            9.5 + (1.0 - share),
            "capacity_lost",
            f"the model's engines serve {served:.1f} req/s against {capacity:.1f} they have served{at_demand}, "
            "and requests queue: capacity was lost (an engine down or restarted, fewer slots or less KV-cache "
            "memory, slower kernels)",
        )
    if queued:
        rank(
            7.0 + min(math.log(queue_ratio), 2.0),
            "queue_building",
            f"requests wait {queue_now:.2f} s for a slot against {queue_usual:.2f} s usually "
            f"({queue_ratio:.0f}x): the engines are short of batch slots or KV blocks for this demand",
        )


def fallback_hint(what: str) -> Hint:
    """The hint a latency event names when nothing it measures points at a cause: demand,
    the request mix, the cache, prefill per token and the queue are all as usual."""
    return Hint(
        code="latency_rise",
        message=f"{what} rose with demand, request mix, prefix cache and queue as usual: look at the serving "
        "instances themselves (GPU health, a noisy neighbour, a recent deploy or config change)",
    )


def signal_hints(signal: Signal, window: WindowStats, observed: float, expected: float) -> list[Hint]:
    """The likely cause that goes with each non-latency signal."""
    if signal is Signal.PREFILL_PER_TOKEN:
        return [
            Hint(
                code="prefill_bound",
                message=f"prefill takes {observed / expected:.1f}x its expected time per uncached prompt token: "
                "slower prefill for some or all prompts (long prompts on a busier GPU, chunked-prefill or "
                "attention-kernel settings, a slower engine version)",
            )
        ]
    if signal is Signal.PREFILL_TIME:
        return [
            Hint(
                code="prefill_bound",
                message=f"prefill takes {observed / expected:.1f}x its expected time at this load: the rise is "
                "in prefill per uncached token, not in queueing (slower prefill kernels, chunked-prefill "
                "settings, or long prompts on a busier GPU)",
            )
        ]
    if signal in (Signal.ITL, Signal.THROUGHPUT):
        # Throughput falls as decode slows, inter-token latency rises: either way, this many times slower.
        slower = observed / expected if signal is Signal.ITL else expected / observed
        return [
            Hint(
                code="decode_slowdown",
                message=f"decode is {slower:.1f}x slower per token than expected at this demand (requests and output "
                "tokens/s), so not from bigger batches: look at the GPUs, the engine version or its decode "
                "settings (speculative decoding, CUDA graphs)",
            )
        ]
    if signal is Signal.LENGTH_TRUNCATION:
        return [
            Hint(
                code="output_truncated",
                message=f"{window.truncated:,} answers ended at the length limit "
                "(finish_reason=length): check max_tokens",
            )
        ]
    if signal is Signal.REASONING_LEAK:
        return [
            Hint(
                code="reasoning_marker_in_content",
                message=f"{window.reasoning_leaks:,} answers contain the reasoning end marker: check the "
                "engine's reasoning parser",
            )
        ]
    if signal is Signal.KV_CACHE_USAGE:
        return [
            Hint(
                code="kv_cache_pressure",
                message=f"the KV cache is {observed:.0%} full against {expected:.0%} usual at this load: longer "
                "contexts pile up, or the engine has less memory for it (gpu_memory_utilization, max_num_seqs)",
            )
        ]
    if signal is Signal.WAITING_REQUESTS:
        return [
            Hint(
                code="queue_building",
                message=f"{observed:,.0f} requests wait for a slot against {expected:,.0f} usual at this load: "
                "the engine is short of KV blocks or batch slots",
            )
        ]
    if signal is Signal.PREEMPTIONS:
        return [
            Hint(
                code="kv_cache_exhausted",
                message="requests are preempted for want of KV-cache blocks: lower max_num_seqs or "
                "max_model_len, or give the cache more memory",
            )
        ]
    if signal is Signal.ERROR_RATE:
        return [Hint(code="error_burst", message=f"{window.errors:,} requests failed (error, abort or 5xx)")]
    if signal is Signal.CACHE_HIT_RATE:
        shared, hashed = window.prefix_shared, window.prefix_reported
        reuse = f"{shared / hashed:.0%} of requests reuse a prompt prefix seen before, yet " if hashed else ""
        if shared and (missed := getattr(window, "prefix_shared_missed", 0)):
            reuse += f"{missed:,} of those {shared:,} got no cached token and "
        if getattr(window, "prefix_caching", None) == "False":  # an engine's metrics say it outright
            return [
                Hint(
                    code="prefix_cache_disabled",
                    message=f"the cache serves {observed:.0%} of prompt tokens (usually {expected:.0%}) and the "
                    "engine reports enable_prefix_caching=False: turn prefix caching on",
                )
            ]
        return [
            Hint(
                code="prefix_cache_ineffective",
                message=f"{reuse}the cache serves {observed:.0%} of prompt tokens (usually {expected:.0%}): "
                "check that prefix caching is enabled (enable_prefix_caching)",
            )
        ]
    return []


def mention_engine_config(event: AnomalyEvent, prefix_caching: Mapping[str, str]) -> AnomalyEvent:
    """Name the engines whose metrics say prefix caching is off (``enable_prefix_caching``,
    by instance, for the event's model) in its ``prefix_cache_ineffective`` hint:
    request logs show the symptom, the engines' own config the likely cause."""
    off = sorted(instance for instance, enabled in prefix_caching.items() if enabled == "False")
    if off:
        shown = ", ".join(off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else "")
        return _amend(event, "prefix_cache_ineffective", f"; the engines report enable_prefix_caching=False on {shown}")
    return event


def mention_max_tokens(event: AnomalyEvent) -> AnomalyEvent:
    """Name the ``max_tokens`` the truncated requests of the evidence asked for in the event's
    ``output_truncated`` hint: the limit to raise, or the client that set it."""
    cut = [r for r in event.evidence if r.get("finish_reason") == "length" and r.get("sample") != "baseline"]
    limits = sorted({int(r["max_tokens"]) for r in cut if r.get("max_tokens") is not None})
    if limits:
        shown = ", ".join(f"{limit:,}" for limit in limits[:5]) + (", ..." if len(limits) > 5 else "")
        return _amend(event, "output_truncated", f" (max_tokens of the requests cut: {shown})")
    return event


def mention_engine_versions(event: AnomalyEvent) -> AnomalyEvent:
    """Name the engines (and versions) that served the leaking answers of the evidence in the
    event's ``reasoning_marker_in_content`` hint: marker leaks are parser bugs of
    particular engine releases, so the version is what a person checks first."""
    served = sorted(
        {
            " ".join(str(r[field]) for field in ("engine", "engine_version") if r.get(field))
            for r in event.evidence
            if r.get("sample") == "faulty" and (r.get("engine") or r.get("engine_version"))
        }
    )
    if served:
        shown = ", ".join(served[:3]) + (f" and {len(served) - 3} more" if len(served) > 3 else "")
        return _amend(event, "reasoning_marker_in_content", f" (the leaking answers shown were served by {shown})")
    return event


def _amend(event: AnomalyEvent, code: str, addition: str) -> AnomalyEvent:
    """The event with ``addition`` appended to its ``code`` hint, and to its summary, which quotes it."""
    for i, hint in enumerate(event.hints):
        if hint.code == code:
            told = Hint(code=code, message=hint.message + addition)
            hints = [*event.hints[:i], told, *event.hints[i + 1 :]]
            return event.model_copy(
                update={"hints": hints, "summary": event.summary.replace(hint.message, told.message)}
            )
    return event
