"""Verdicts per signal for a change: the period after a marker against the period before.

Each signal is a statistic of a model's requests (a latency quantile, a token-weighted hit
rate, a share of bad finishes) computed on both periods with the before period's segment mix
(``mix``), with a stratified-bootstrap confidence interval of the ratio (latency,
throughput) or of the difference in points (shares). A verdict needs both: the interval
excludes no change (so it is not noise) *and* the estimate moved past a practical threshold
(so a 0.5 % TTFT shift on a million requests is not called a regression).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from servewatch.models.compare.mix import (
    Columns,
    Mix,
    Segmentation,
    bootstrap,
    columns,
    mix_of,
    number,
    side,
    statistic,
)
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.signal_columns import DEFAULT_REASONING_MARKERS, leaked
from servewatch.schemas.change_report import ChangeReport, Period, SignalChange, Verdict
from servewatch.schemas.request_log import RequestLog

Record = Mapping[str, Any] | RequestLog


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
        "ttft": number("ttft_s"),
        "e2e": number("e2e_s"),
        "itl": _itl,
        "tokens_per_s": _tokens_per_s,
        "prompt": number("prompt_tokens"),
        "cached": number("cached_tokens"),
        "length": lambda row: float(row.get("finish_reason") == "length"),
        "leak": leak,
        "error": _is_error,
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
    """

    name: str
    numerator: str
    denominator: str | None = None
    quantile: float | None = None
    points: bool = False
    lower_is_better: bool = True
    only_ok: bool = False
    by_output: bool = False


SIGNALS: tuple[SignalSpec, ...] = (
    SignalSpec("ttft_p50", "ttft", quantile=0.5, only_ok=True),
    SignalSpec("ttft_p95", "ttft", quantile=0.95, only_ok=True),
    SignalSpec("e2e_p95", "e2e", quantile=0.95, only_ok=True, by_output=True),
    SignalSpec("itl_p50", "itl", quantile=0.5, only_ok=True),
    SignalSpec("tokens_per_s_p50", "tokens_per_s", quantile=0.5, lower_is_better=False, only_ok=True, by_output=True),
    SignalSpec("cache_hit_rate", "cached", "prompt", points=True, lower_is_better=False),
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


def _row(record: Record) -> Mapping[str, Any]:
    return record.to_row() if isinstance(record, RequestLog) else record


def _period(data: Columns) -> Period:
    stamps = data.values["timestamp"]
    stamps = stamps[np.isfinite(stamps)]
    if not len(stamps):
        return Period(requests=len(data))
    return Period(first=float(stamps.min()), last=float(stamps.max()), requests=len(data))


@dataclass
class ChangeVerifier:
    """Compares two periods of request logs per model; ``compare`` returns a ``ChangeReport`` each.

    ``segment_of`` maps a request (a ``RequestLog`` row) to its segment key for most signals
    (default: model, route, prompt band: what a request asks); ``outcome_segment_of`` for the
    signals marked ``by_output`` (default: the output band too). With ``simultaneous`` (the
    default) the intervals hold together over the report's signals (Bonferroni): one report
    reads nine signals, and nine separate 95 % intervals would call one of them changed in
    about one no-change report in three.

    >>> rng = np.random.default_rng(7)
    >>> def logs(n, ttft_mean, t0):
    ...     return [{"request_id": f"r{t0 + i}", "timestamp": 1.77e9 + t0 + i, "model": "m", "route": "chat",
    ...              "prompt_tokens": 800, "completion_tokens": 100, "e2e_s": 5.0 + float(t), "ttft_s": float(t),
    ...              "finish_reason": "stop"} for i, t in enumerate(rng.gamma(4.0, ttft_mean / 4.0, n))]
    >>> (report,) = ChangeVerifier(resamples=200).compare(logs(400, 0.3, 0), logs(400, 0.2, 10_000))
    >>> [(row.signal, row.verdict) for row in report.signals][:4]
    [('ttft_p50', 'improved'), ('ttft_p95', 'improved'), ('e2e_p95', 'no change'), ('tokens_per_s_p50', 'no change')]
    >>> ttft = report.signals[0]
    >>> ttft.ci_low < ttft.change < ttft.ci_high < 0.95, ttft.segments_used, ttft.coverage_after
    (True, 1, 1.0)
    """

    min_requests: int = 30
    resamples: int = 500
    confidence: float = 0.95
    ratio_threshold: float = 0.05  # latency and throughput: a verdict needs at least 5 % change
    points_threshold: float = 0.1  # shares: ... and at least 0.1 percentage point
    seed: int = 0
    segment_of: Callable[[Mapping[str, Any]], str] | None = None
    outcome_segment_of: Callable[[Mapping[str, Any]], str] | None = None
    signals: Sequence[SignalSpec] = SIGNALS
    simultaneous: bool = True
    reasoning_markers: Sequence[str] = DEFAULT_REASONING_MARKERS

    def compare(
        self, before: Iterable[Record], after: Iterable[Record], model: str | None = None
    ) -> list[ChangeReport]:
        """One report per model found in either period (only ``model``, when given), by name."""
        by_model: dict[str, tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]] = {}
        for which, records in enumerate((before, after)):
            for record in records:
                row = _row(record)
                name = str(row.get("model", "other"))
                if model is None or name == model:
                    by_model.setdefault(name, ([], []))[which].append(row)
        rng = np.random.default_rng(self.seed)
        return [self.report(name, *by_model[name], rng=rng) for name in sorted(by_model)]

    def report(
        self,
        model: str,
        before_rows: Sequence[Mapping[str, Any]],
        after_rows: Sequence[Mapping[str, Any]],
        rng: np.random.Generator | None = None,
    ) -> ChangeReport:
        """The report of one model's (or one segment's) rows of both periods."""
        rng = rng if rng is not None else np.random.default_rng(self.seed)
        segmentations: dict[str, Segmentation] = {
            "input": (self.segment_of or default_segment_of(), {}),
            "outcome": (self.outcome_segment_of or default_segment_of(by_output=True), {}),
        }
        extract = extractors(self.reasoning_markers)
        before = columns(before_rows, segmentations, extract)
        after = columns(after_rows, segmentations, extract)
        tested = [spec for spec in self.signals if self._valid(spec, before).any() or self._valid(spec, after).any()]
        confidence = 1.0 - (1.0 - self.confidence) / len(tested) if self.simultaneous and tested else self.confidence
        sizes = {name: len(index) for name, (_, index) in segmentations.items()}
        rows = [self._signal(spec, before, after, sizes, rng, confidence) for spec in tested]
        return ChangeReport(
            model=model,
            before=_period(before),
            after=_period(after),
            segments=sizes["outcome"],
            confidence=self.confidence,
            resamples=self.resamples,
            min_requests=self.min_requests,
            signals=rows,
            simultaneous=self.simultaneous,
        )

    @staticmethod
    def _valid(spec: SignalSpec, data: Columns) -> np.ndarray:
        ok = np.isfinite(data.values[spec.numerator])
        if spec.denominator is not None:
            ok &= np.isfinite(data.values[spec.denominator])
        if spec.only_ok:
            ok &= data.values["error"] == 0
        return ok

    def _signal(
        self,
        spec: SignalSpec,
        before: Columns,
        after: Columns,
        sizes: Mapping[str, int],
        rng: np.random.Generator,
        confidence: float,
    ) -> SignalChange:
        """The signal's row (``insufficient data`` when no segment has enough requests on both sides)."""
        strata = "outcome" if spec.by_output else "input"
        valid_b, valid_a = self._valid(spec, before), self._valid(spec, after)
        mix = mix_of(before.strata[strata][valid_b], after.strata[strata][valid_a], sizes[strata], self.min_requests)
        empty = SignalChange(
            signal=spec.name,
            kind="points" if spec.points else "ratio",
            better="lower" if spec.lower_is_better else "higher",
            before=None,
            after=None,
            change=None,
            ci_low=None,
            ci_high=None,
            verdict="insufficient data",
            segments_used=len(mix.used),
            coverage_before=min(mix.coverage_before, 1.0),
            coverage_after=min(mix.coverage_after, 1.0),
        )
        if not len(mix.used):
            return empty
        sides = [self._side(spec, data, valid, mix, strata) for data, valid in ((before, valid_b), (after, valid_a))]
        b, a = (float(statistic(s, None, spec.quantile)[0]) for s in sides)
        boot_b, boot_a = (bootstrap(s, spec.quantile, rng, self.resamples) for s in sides)
        with np.errstate(invalid="ignore", divide="ignore"):
            if spec.points:
                change, draws = 100.0 * (a - b), 100.0 * (boot_a - boot_b)
            else:
                change = a / b if b > 0 else math.nan
                draws = np.where(boot_b > 0, boot_a / np.where(boot_b > 0, boot_b, 1.0), np.nan)
        draws = draws[np.isfinite(draws)]
        if not math.isfinite(change) or not len(draws):
            return empty.model_copy(update={"before": _finite(b), "after": _finite(a)})
        tail = (1.0 - confidence) / 2
        low, high = (float(x) for x in np.quantile(draws, [tail, 1.0 - tail]))
        return empty.model_copy(
            update={
                "before": b,
                "after": a,
                "change": change,
                "ci_low": low,
                "ci_high": high,
                "verdict": self._verdict(spec, change, low, high),
            }
        )

    @staticmethod
    def _side(spec: SignalSpec, data: Columns, valid: np.ndarray, mix: Mix, strata: str) -> Any:
        den = data.values[spec.denominator][valid] if spec.denominator is not None else None
        return side(data.strata[strata][valid], data.values[spec.numerator][valid], den, mix)

    def _verdict(self, spec: SignalSpec, change: float, low: float, high: float) -> Verdict:
        none, threshold = (0.0, self.points_threshold) if spec.points else (1.0, self.ratio_threshold)
        if low <= none <= high or abs(change - none) < threshold:
            return "no change"
        went_up = change > none
        return "regressed" if went_up == spec.lower_is_better else "improved"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
