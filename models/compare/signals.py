"""What a change report measures: its signals, the per-request columns they read, and the
segments that hold what a request asks (``report`` compares them)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servewatch.models.compare import strata
from servewatch.models.compare.mix import number
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.signal_columns import DEFAULT_REASONING_MARKERS, leaked


def _itl(row: Mapping[str, Any]) -> float:
    decode, tokens = row.get("decode_s"), row.get("completion_tokens")
    if isinstance(decode, int | float) and isinstance(tokens, int) and tokens > 1:
        return float(decode) / (tokens - 1)
    return math.nan


def _tokens_per_s(row: Mapping[str, Any]) -> float:
    tokens, e2e = row.get("completion_tokens"), row.get("e2e_s")
    if isinstance(tokens, int) and isinstance(e2e, int | float) and e2e > 0:
        return tokens / float(e2e)
    return math.nan


def _is_error(row: Mapping[str, Any]) -> float:
    status = row.get("status_code")
    return float(row.get("finish_reason") == "error" or (isinstance(status, int) and status >= 500))


def extractors(markers: Sequence[str] = DEFAULT_REASONING_MARKERS) -> dict[str, Callable[[Mapping[str, Any]], float]]:
    """Per-request columns the signals read (NaN where a record lacks what a column needs);
    ``markers``: the reasoning end markers a leaked answer shows (``leak`` is NaN without content)."""

    def leak(row: Mapping[str, Any]) -> float:
        content = row.get("content")
        return float(leaked(content, markers)) if isinstance(content, str) else math.nan

    return {
        "timestamp": number("timestamp"),
        "arrival": strata.arrival_of,
        "ttft": number("ttft_s"),
        "e2e": number("e2e_s"),
        "itl": _itl,
        "tokens_per_s": _tokens_per_s,
        "prompt": number("prompt_tokens"),
        "cached": number("cached_tokens"),
        "length": lambda row: float(row.get("finish_reason") == "length"),
        "leak": leak,
        "error": _is_error,
        "load": number(strata.LOAD),
        "prefix": number(strata.PREFIX),
    }


@dataclass(frozen=True)
class SignalSpec:
    """What a signal measures: a quantile of one column, or a (weighted) ratio of sums.

    ``points``: compared as a difference in percentage points (shares), else as a ratio.
    ``only_ok``: failed requests left out (their timings stop early; ``error_share`` counts them).
    ``by_output``: stratified on the output band as well, for signals that grow with the answer's
    length (e2e, tokens/s per request); the others are stratified on what a request asks (route,
    prompt band) only, since the output band is an outcome: a lower ``max_tokens`` moves requests
    between output bands, and stratifying on it would hide the truncations it causes.
    ``only_eligible``: only requests whose prompt prefix was seen shortly before (the cache
    could hit on nothing else), where the logs carry prefix hashes.
    ``prefill``: includes the prompt's prefill, so it moves with the prompt tokens the prefix
    cache did not serve; while the cache's hit rate holds, a difference in those is the
    traffic's (what its prompts offered the cache), and is weighed as the load is.
    """

    name: str
    numerator: str
    denominator: str | None = None
    quantile: float | None = None
    points: bool = False
    lower_is_better: bool = True
    only_ok: bool = False
    by_output: bool = False
    only_eligible: bool = False
    prefill: bool = False


#: The signal whose verdict says whether the prefix cache itself changed.
CACHE_SIGNAL = "cache_hit_rate"

SIGNALS: tuple[SignalSpec, ...] = (
    SignalSpec("ttft_p50", "ttft", quantile=0.5, only_ok=True, prefill=True),
    SignalSpec("ttft_p95", "ttft", quantile=0.95, only_ok=True, prefill=True),
    SignalSpec("e2e_p95", "e2e", quantile=0.95, only_ok=True, by_output=True, prefill=True),
    SignalSpec("itl_p50", "itl", quantile=0.5, only_ok=True),
    SignalSpec("tokens_per_s_p50", "tokens_per_s", quantile=0.5, lower_is_better=False, only_ok=True, by_output=True),
    SignalSpec(CACHE_SIGNAL, "cached", "prompt", points=True, lower_is_better=False, only_eligible=True),
    SignalSpec("truncation_share", "length", points=True),
    SignalSpec("leak_share", "leak", points=True),
    SignalSpec("error_share", "error", points=True),
)


def default_segment_of(
    prompt_band_edges: tuple[int, ...] = (4096, 32768),
    output_band_edges: tuple[int, ...] = (1024,),
    by_output: bool = False,
) -> Callable[[Mapping[str, Any]], str]:
    """The worker's segments (model, route, prompt band; with ``by_output`` the output band
    too), uncapped: offline, a comparison holds every combination it reads."""
    dimensions = ("model", "route", "prompt_band", "output_band") if by_output else ("model", "route", "prompt_band")
    segmenter = Segmenter(
        dimensions=dimensions, prompt_band_edges=prompt_band_edges, output_band_edges=output_band_edges
    )

    def segment_of(row: Mapping[str, Any]) -> str:
        return segmenter.natural_key(
            model=str(row.get("model", "other")),
            route=row.get("route"),
            prompt_tokens=int(row.get("prompt_tokens") or 0),
            output_tokens=int(row.get("completion_tokens") or 0),
        )

    return segment_of
