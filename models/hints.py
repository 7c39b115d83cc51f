"""Likely causes, from the same window statistics the detectors read.

Each rule is a pure function of the window, the segment's recent normal figures and the
verdict; it returns a ``Hint`` or ``None``. Rules are ranked by how far their evidence
moved, so the first hint is the best guess. Codes are a documented, stable set.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from models.compact import CompactState, count, number
from models.window import WindowStats
from schemas.anomaly import AnomalyEvent, Hint, Signal

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
}


class Baseline(CompactState):
    """Exponentially weighted figures of a segment's normal windows (cheap, O(1)).

    Seven doubles, alone or in the segment's buffer (``models.compact``); ``halflife`` is
    its only constructor argument. ``last_window_start`` is where the latest normal window
    began: a firing event's baseline sample is read from there (``pipeline.evidence``).

    >>> usual = Baseline()
    >>> usual.learn({"requests_per_s": 2.0, "uncached_prompt_tokens_per_s": 500.0, "cache_hit_rate": 0.8,
    ...              "prompt_tokens_per_s": 2500.0, "output_tokens_per_s": 400.0}, window_start=60.0)
    >>> usual.requests_per_s, usual.uncached_tokens_per_request, usual.prompt_tokens_per_request, usual.windows
    (2.0, 250.0, 1250.0, 1)
    >>> usual.last_window_start
    60.0
    """

    __slots__ = ()
    STATE_SIZE = 7
    FIGURES = (
        "cache_hit_rate", "uncached_tokens_per_request", "requests_per_s",
        "prompt_tokens_per_request", "output_tokens_per_request", "last_window_start",
    )  # fmt: skip
    cache_hit_rate = number(0)
    uncached_tokens_per_request = number(1)
    requests_per_s = number(2)
    windows = count(3)
    prompt_tokens_per_request = number(4)
    output_tokens_per_request = number(5)
    last_window_start = number(6)  # not averaged: the latest

    def __init__(
        self,
        halflife: float = 30.0,
        cache_hit_rate: float = math.nan,
        uncached_tokens_per_request: float = math.nan,
        requests_per_s: float = math.nan,
        windows: int = 0,
        prompt_tokens_per_request: float = math.nan,
        output_tokens_per_request: float = math.nan,
        last_window_start: float = math.nan,
    ) -> None:
        self._params = float(halflife)
        self._own(
            [
                cache_hit_rate, uncached_tokens_per_request, requests_per_s, float(windows),
                prompt_tokens_per_request, output_tokens_per_request, last_window_start,
            ]
        )  # fmt: skip

    @property
    def halflife(self) -> float:
        return float(self._params)

    def state(self) -> dict[str, float | None]:
        """Strict JSON: NaN (not seen yet) as null."""
        figures = {name: getattr(self, name) for name in self.FIGURES}
        return {
            "halflife": self.halflife,
            **{name: None if math.isnan(value) else value for name, value in figures.items()},
            "windows": self.windows,
        }

    def load_state(self, state: dict[str, float | None]) -> None:
        """Figures a state lacks (stored before they existed) start unknown."""
        figures = {name: math.nan if (value := state.get(name)) is None else float(value) for name in self.FIGURES}
        self._set_numbers(0, [figures[name] for name in self.FIGURES[:3]])
        self._set_numbers(3, [float(int(state.get("windows") or 0))])
        self._set_numbers(4, [figures[name] for name in self.FIGURES[3:]])

    def learn(self, load: dict[str, float], window_start: float = math.nan) -> None:
        alpha = max(1.0 - 0.5 ** (1.0 / self.halflife), 1.0 / (self.windows + 1))
        rate = load["requests_per_s"]

        def per_request(name: str) -> float:
            return load.get(name, math.nan) / rate if rate > 0 else math.nan

        figures = {
            "cache_hit_rate": load.get("cache_hit_rate", math.nan),
            "uncached_tokens_per_request": per_request("uncached_prompt_tokens_per_s"),
            "requests_per_s": rate,
            "prompt_tokens_per_request": per_request("prompt_tokens_per_s"),
            "output_tokens_per_request": per_request("output_tokens_per_s"),
        }
        for name, value in figures.items():
            if math.isnan(value):
                continue
            old = getattr(self, name)
            setattr(self, name, value if math.isnan(old) else old + alpha * (value - old))
        self.windows += 1
        if not math.isnan(window_start):
            self.last_window_start = window_start


#: Tokens per request (prompt or output) this many times the usual: the mix moved.
TRAFFIC_SHIFT_RATIO = 1.5


def _ratio(now: float, usual: float) -> float:
    if math.isnan(now) or math.isnan(usual) or usual <= 0:
        return math.nan
    return now / usual


def latency_hints(load: dict[str, float], usual: Baseline, *, explained_by_load: bool) -> list[Hint]:
    """Hints for a latency (TTFT) anomaly, best first.

    Longer prompts mean more uncached tokens too: prefill work that grew *per prompt token*
    points at the cache (``prefill_bound``), prefill work that grew with the prompts at the
    mix of requests (``traffic_shift``).
    """
    ranked: list[tuple[float, Hint]] = []

    def rank(score: float, code: str, message: str) -> None:
        ranked.append((score, Hint(code=code, message=message)))

    hit_now = load.get("cache_hit_rate", math.nan)
    requests_per_s = load.get("requests_per_s", 0.0)

    def per_request(name: str) -> float:
        return load.get(name, math.nan) / requests_per_s if requests_per_s > 0 else math.nan

    uncached_now = per_request("uncached_prompt_tokens_per_s")
    uncached_ratio = _ratio(uncached_now, usual.uncached_tokens_per_request)
    prompt_now, output_now = per_request("prompt_tokens_per_s"), per_request("output_tokens_per_s")
    prompt_ratio = _ratio(prompt_now, usual.prompt_tokens_per_request)
    output_ratio = _ratio(output_now, usual.output_tokens_per_request)
    traffic_ratio = _ratio(requests_per_s, usual.requests_per_s)

    if not math.isnan(hit_now) and usual.cache_hit_rate >= 0.2 and hit_now < usual.cache_hit_rate / 2:
        rank(
            10.0 + (usual.cache_hit_rate - hit_now) * 10,
            "prefix_cache_ineffective",
            f"prefix-cache hit rate fell to {hit_now:.0%} from a usual {usual.cache_hit_rate:.0%}; "
            "check that prefix caching is enabled (enable_prefix_caching) on the serving instances",
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
    if explained_by_load and not math.isnan(traffic_ratio):
        rank(
            4.0 + abs(math.log(max(traffic_ratio, 1e-9))),
            "queueing",
            f"requests/s is {traffic_ratio:.1f}x its usual level; the rise is in line with load "
            "(capacity, not a fault)",
        )
    ranked.sort(key=lambda item: item[0], reverse=True)
    return [hint for _, hint in ranked]


def signal_hints(signal: Signal, window: WindowStats, observed: float, expected: float) -> list[Hint]:
    """The likely cause that goes with each non-latency signal (issue #5 refines these)."""
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


def mention_engine_config(event: AnomalyEvent, prefix_caching: Mapping[str, str]) -> None:
    """Name the engines whose metrics say prefix caching is off (``enable_prefix_caching``,
    by instance, for the event's model) in a ``prefix_cache_ineffective`` hint, in place:
    request logs show the symptom, the engines' own config the likely cause."""
    off = sorted(instance for instance, enabled in prefix_caching.items() if enabled == "False")
    if off:
        shown = ", ".join(off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else "")
        _amend(event, "prefix_cache_ineffective", f"; the engines report enable_prefix_caching=False on {shown}")


def mention_max_tokens(event: AnomalyEvent) -> None:
    """Name the ``max_tokens`` the truncated requests of the evidence asked for in the event's
    ``output_truncated`` hint (in place): the limit to raise, or the client that set it."""
    cut = [r for r in event.evidence if r.get("finish_reason") == "length" and r.get("sample") != "baseline"]
    limits = sorted({int(r["max_tokens"]) for r in cut if r.get("max_tokens") is not None})
    if limits:
        shown = ", ".join(f"{limit:,}" for limit in limits[:5]) + (", ..." if len(limits) > 5 else "")
        _amend(event, "output_truncated", f" (max_tokens of the requests cut: {shown})")


def mention_engine_versions(event: AnomalyEvent) -> None:
    """Name the engines (and versions) that served the leaking answers of the evidence in the
    event's ``reasoning_marker_in_content`` hint (in place): marker leaks are parser bugs of
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
        _amend(event, "reasoning_marker_in_content", f" (the leaking answers shown were served by {shown})")


def _amend(event: AnomalyEvent, code: str, addition: str) -> None:
    """Append ``addition`` to the event's ``code`` hint, and to its summary, which quotes it."""
    for i, hint in enumerate(event.hints):
        if hint.code == code:
            told = Hint(code=code, message=hint.message + addition)
            event.hints[i] = told
            event.summary = event.summary.replace(hint.message, told.message)
            return
