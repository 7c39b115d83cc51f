"""Verdicts per signal for a change: the period after a marker against the period before.

Each signal is a statistic of a model's requests (a latency quantile, a token-weighted hit
rate, a share of bad finishes) computed on both periods with the before period's mix of
strata (segment, prompt octave, cache eligibility and, for latencies, load: ``strata``,
``mix``), with a block-bootstrap confidence interval of the ratio (latency, throughput) or
of the difference in points (shares). A verdict needs both: the interval excludes no change
(so it is not noise) *and* the estimate moved past a practical threshold (so a 0.5 % TTFT
shift on a million requests is not called a regression). Where the traffic could have made
it, it is ``inconclusive`` instead, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from servewatch.models.compare import strata
from servewatch.models.compare.adjust import explained_shift
from servewatch.models.compare.mix import (
    Columns,
    Mix,
    Segmentations,
    Side,
    bootstrap,
    columns,
    mix_of,
    overlap,
    side,
    statistic,
)
from servewatch.models.compare.signals import CACHE_SIGNAL, SIGNALS, SignalSpec, default_segment_of, extractors
from servewatch.models.windows.signal_columns import DEFAULT_REASONING_MARKERS
from servewatch.schemas.change_report import ChangeReport, Period, SignalChange, TrafficMix, Verdict
from servewatch.schemas.request_log import RequestLog

Record = Mapping[str, Any] | RequestLog


def _row(record: Record) -> Mapping[str, Any]:
    return record.to_row() if isinstance(record, RequestLog) else record


def _period(data: Columns) -> Period:
    stamps = data.values["timestamp"]
    stamps = stamps[np.isfinite(stamps)]
    if not len(stamps):
        return Period(requests=len(data))
    return Period(first=float(stamps.min()), last=float(stamps.max()), requests=len(data))


def _arrival_rate(data: Columns) -> float | None:
    """Requests per second over the period's arrivals: what the clients asked, which a slower
    service spreads over a longer stretch of finish times."""
    arrivals = data.values["arrival"]
    arrivals = arrivals[np.isfinite(arrivals)]
    span = float(arrivals.max() - arrivals.min()) if len(arrivals) > 1 else 0.0
    return len(arrivals) / span if span > 0 else None


def _eligible_share(data: Columns) -> float | None:
    prefix = data.values["prefix"]
    seen, new = int((prefix == strata.SEEN).sum()), int((prefix == strata.NEW).sum())
    return seen / (seen + new) if seen + new else None


#: Request rates this far apart (either way) are named as the reason a comparison is inconclusive.
LOAD_RATIO = 1.5
#: ... and cache-eligible shares this many points apart.
ELIGIBLE_POINTS = 10.0


def load_differs(traffic: TrafficMix) -> str | None:
    """``load differs: 4.6 vs 2.7 req/s`` when the arrival rates are more than ``LOAD_RATIO`` apart."""
    rb, ra = traffic.rate_before, traffic.rate_after
    if not rb or not ra or 1 / LOAD_RATIO <= ra / rb <= LOAD_RATIO:
        return None
    return f"load differs: {rb:.1f} vs {ra:.1f} req/s"


def why_not_comparable(traffic: TrafficMix, comparable: float) -> str:
    """Why too few requests had a counterpart, in the traffic's terms.

    >>> why_not_comparable(TrafficMix(rate_before=4.6, rate_after=2.7, eligible_before=0.62,
    ...                               eligible_after=0.60), 0.38)
    'load differs: 4.6 vs 2.7 req/s, 38 % of requests comparable'
    """
    load = load_differs(traffic)
    parts = [load] if load else []
    eb, ea = traffic.eligible_before, traffic.eligible_after
    if eb is not None and ea is not None and abs(eb - ea) * 100 >= ELIGIBLE_POINTS:
        parts.append(f"prefix reuse differs: {eb:.0%} vs {ea:.0%} of requests cache-eligible")
    return f"{'; '.join(parts) or 'the traffic differs'}, {100 * comparable:.0f} % of requests comparable"


@dataclass
class ChangeVerifier:
    """Compares two periods of request logs per model; ``compare`` returns a ``ChangeReport`` each.

    ``segment_of`` maps a request (a ``RequestLog`` row) to its segment key for most signals
    (default: model, route, prompt band: what a request asks); ``outcome_segment_of`` for the
    signals marked ``by_output`` (default: the output band too). With ``hold_traffic`` (the
    default) each segment is split further by the load each request met and whether its
    prompt prefix was seen shortly before (``strata``), so a quieter hour or less prefix reuse
    does not pass for a change; where the periods have less than ``min_coverage`` of their
    requests in common (``overlap``), or the traffic explains the change, the verdict is
    ``inconclusive``, with the reason.
    With ``simultaneous`` (the default) the intervals hold together over the report's signals
    (Bonferroni): one report reads nine signals, and nine separate 95 % intervals would call
    one of them changed in about one no-change report in three.

    >>> rng = np.random.default_rng(7)
    >>> def logs(n, ttft_mean, t0):
    ...     return [{"request_id": f"r{t0 + i}", "timestamp": 1.77e9 + t0 + i, "model": "m", "route": "chat",
    ...              "prompt_tokens": 800, "completion_tokens": 100, "e2e_s": 5.0 + float(t), "ttft_s": float(t),
    ...              "decode_s": 5.0, "finish_reason": "stop"}
    ...             for i, t in enumerate(rng.gamma(4.0, ttft_mean / 4.0, n))]
    >>> (report,) = ChangeVerifier(resamples=200).compare(logs(400, 0.3, 0), logs(400, 0.2, 10_000))
    >>> [(row.signal, row.verdict) for row in report.signals][:4]
    [('ttft_p50', 'improved'), ('ttft_p95', 'improved'), ('e2e_p95', 'no change'), ('itl_p50', 'no change')]
    >>> ttft = report.signals[0]
    >>> ttft.ci_low < ttft.change < ttft.ci_high < 0.95, ttft.segments_used, ttft.coverage_after
    (True, 1, 1.0)

    Faster at a third of the load is not an improvement the comparison can vouch for:

    >>> (report,) = ChangeVerifier(resamples=200).compare(logs(400, 0.3, 0), logs(1200, 0.2, 10_000)[::3])
    >>> report.signals[0].verdict, report.signals[0].reason
    ('inconclusive', 'load differs: 1.0 vs 0.3 req/s, 0 % of requests comparable')
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
    hold_traffic: bool = True
    min_coverage: float = 0.5
    min_stratum_requests: int = 10
    prefix_lifetime_s: float = strata.PREFIX_LIFETIME_S
    block_s: float = 60.0  # the bootstrap's time blocks (``mix``)

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

    def labelled(
        self, before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
    ) -> tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]]]:
        """One model's two periods with their traffic labels (``strata``), computed over both
        together unless the rows carry them already (a live watch labels its own)."""
        if not self.hold_traffic or strata.is_labelled(before) or strata.is_labelled(after):
            return before, after
        before, after = strata.label((before, after), self.prefix_lifetime_s)
        return before, after

    def report(
        self,
        model: str,
        before_rows: Sequence[Mapping[str, Any]],
        after_rows: Sequence[Mapping[str, Any]],
        rng: np.random.Generator | None = None,
    ) -> ChangeReport:
        """The report of one model's (or one segment's) rows of both periods."""
        rng = rng if rng is not None else np.random.default_rng(self.seed)
        before_rows, after_rows = self.labelled(before_rows, after_rows)
        segmentations = Segmentations(("input", "input+load", "outcome+load", "segment"), self._strata_of())
        extract = extractors(self.reasoning_markers)
        before = columns(before_rows, segmentations, extract)
        after = columns(after_rows, segmentations, extract)
        traffic = TrafficMix(
            rate_before=_arrival_rate(before),
            rate_after=_arrival_rate(after),
            eligible_before=_eligible_share(before),
            eligible_after=_eligible_share(after),
        )
        eligibility = traffic.eligible_before is not None or traffic.eligible_after is not None
        valid = {spec.name: (self._valid(spec, before, eligibility), self._valid(spec, after, eligibility))
                 for spec in self.signals}  # fmt: skip
        # A signal the logs carry is in the table even where no request's traffic is known.
        carried = {spec.name: self._valid(spec, before, eligibility, False).any()
                   or self._valid(spec, after, eligibility, False).any() for spec in self.signals}  # fmt: skip
        tested = [spec for spec in self.signals if carried[spec.name]]
        confidence = 1.0 - (1.0 - self.confidence) / len(tested) if self.simultaneous and tested else self.confidence
        sizes = segmentations.sizes()
        # The cache first: whether its hit rate moved decides what a prefill latency's change
        # may be put down to (``_explained_by_traffic``).
        judged: dict[str, SignalChange] = {}
        for spec in sorted(tested, key=lambda spec: spec.name != CACHE_SIGNAL):
            cache = judged.get(CACHE_SIGNAL)
            cache_moved = cache is not None and cache.verdict in ("regressed", "improved")
            judged[spec.name] = self._signal(
                spec, before, after, valid[spec.name], sizes, rng, confidence, traffic, cache_moved
            )
        rows = [judged[spec.name] for spec in tested]
        return ChangeReport(
            model=model,
            before=_period(before),
            after=_period(after),
            segments=sizes["segment"],
            confidence=self.confidence,
            resamples=self.resamples,
            min_requests=self.min_requests,
            signals=rows,
            simultaneous=self.simultaneous,
            traffic=traffic if self.hold_traffic else None,
        )

    def _strata_of(self) -> Callable[[Mapping[str, Any]], tuple[str, str, str, str]]:
        """A request's strata: what it asks split by the traffic labels (the prompt's octave
        and its cache eligibility; with the load band too), the same for the outcome segment
        with the load band, and the outcome segment alone. Without ``hold_traffic``, the
        segments alone."""
        asked_of = self.segment_of or default_segment_of()
        outcome_of = self.outcome_segment_of or default_segment_of(by_output=True)

        def strata_of(row: Mapping[str, Any]) -> tuple[str, str, str, str]:
            asked, outcome = asked_of(row), outcome_of(row)
            if not self.hold_traffic:
                return asked, asked, outcome, outcome
            octave = f"|prompt<2^{int(row.get('prompt_tokens') or 0).bit_length()}"
            load = f"|load={strata.load_band(row.get(strata.LOAD))}"
            prefix = f"|prefix={row.get(strata.PREFIX)}"
            return (
                f"{asked}{octave}{prefix}",
                f"{asked}{octave}{load}{prefix}",
                f"{outcome}{octave}{load}{prefix}",
                outcome,
            )

        return strata_of

    def _valid(self, spec: SignalSpec, data: Columns, eligibility: bool, traffic: bool = True) -> np.ndarray:
        """The requests that count for ``spec``: ``traffic``, only those whose labels are known."""
        ok = np.isfinite(data.values[spec.numerator])
        if spec.denominator is not None:
            ok &= np.isfinite(data.values[spec.denominator])
        if spec.only_ok:
            ok &= data.values["error"] == 0
        if self.hold_traffic and traffic:
            ok &= data.values["prefix"] != strata.UNKNOWN
            if not spec.points:
                ok &= np.isfinite(data.values["load"])
        if spec.only_eligible and eligibility:
            ok &= data.values["prefix"] == strata.SEEN
        return ok

    def _signal(
        self,
        spec: SignalSpec,
        before: Columns,
        after: Columns,
        valid: tuple[np.ndarray, np.ndarray],
        sizes: Mapping[str, int],
        rng: np.random.Generator,
        confidence: float,
        traffic: TrafficMix,
        cache_moved: bool = False,
    ) -> SignalChange:
        """The signal's row: ``insufficient data`` when a side has too few requests,
        ``inconclusive`` when too few of them have a counterpart on the other side;
        ``cache_moved``: the cache's hit rate got a verdict (see ``_explained_by_traffic``)."""
        # Shares (errors, truncations, cache hits) are held to what requests ask and could hit;
        # latencies to the load they met too. A lower max_tokens lightens the load: holding
        # the truncations it causes to the load would call them inconclusive.
        strata_name = "input" if spec.points else "outcome+load" if spec.by_output else "input+load"
        valid_b, valid_a = valid
        mix = mix_of(
            before.strata[strata_name][valid_b], after.strata[strata_name][valid_a], sizes[strata_name],
            self.min_stratum_requests if self.hold_traffic else self.min_requests,
        )  # fmt: skip
        comparable = overlap(
            before.strata[strata_name][valid_b], after.strata[strata_name][valid_a], sizes[strata_name]
        )
        enough = min(valid_b.sum(), valid_a.sum()) >= self.min_requests
        judged = not self.hold_traffic or comparable >= self.min_coverage
        empty = SignalChange(
            signal=spec.name,
            kind="points" if spec.points else "ratio",
            better="lower" if spec.lower_is_better else "higher",
            before=None,
            after=None,
            change=None,
            ci_low=None,
            ci_high=None,
            verdict="insufficient data" if judged or not enough else "inconclusive",
            reason=None if judged or not enough else why_not_comparable(traffic, comparable),
            segments_used=len(mix.used),
            coverage_before=min(mix.coverage_before, 1.0),
            coverage_after=min(mix.coverage_after, 1.0),
        )
        if not len(mix.used):
            return empty
        sides = [self._side(spec, data, ok, mix, strata_name) for data, ok in ((before, valid_b), (after, valid_a))]
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
        verdict = self._verdict(spec, b, change, low, high)
        if verdict in ("regressed", "improved") and spec.points and spec.denominator is None:
            verdict = verdict if counts_differ(sides[0], sides[1], alpha=1.0 - confidence) else "no change"
        reason = None
        if not judged and not against_the_load(spec, verdict, traffic):
            verdict, reason = "inconclusive", empty.reason
        elif verdict in ("regressed", "improved") and self.hold_traffic:
            reason = self._explained_by_traffic(spec, verdict, before, after, valid, mix, strata_name,
                                                (b, change, low, high), traffic, cache_moved)  # fmt: skip
            verdict = "inconclusive" if reason else verdict
        return empty.model_copy(
            update={
                "before": b,
                "after": a,
                "change": change,
                "ci_low": low,
                "ci_high": high,
                "verdict": verdict,
                "reason": reason,
            }
        )

    def _side(self, spec: SignalSpec, data: Columns, valid: np.ndarray, mix: Mix, which: str) -> Any:
        den = data.values[spec.denominator][valid] if spec.denominator is not None else None
        arrival = data.values["arrival"][valid]
        # A request without a timestamp is a block of its own (negative, apart from the others).
        blocks = np.where(
            np.isfinite(arrival), np.floor(np.nan_to_num(arrival) / self.block_s), -1 - np.arange(len(arrival))
        )
        return side(data.strata[which][valid], data.values[spec.numerator][valid], den, blocks, mix)

    def _explained_by_traffic(
        self, spec: SignalSpec, verdict: Verdict, before: Columns, after: Columns, valid: tuple[np.ndarray, np.ndarray],
        mix: Mix, which: str, estimate: tuple[float, float, float, float], traffic: TrafficMix,
        cache_moved: bool = False,
    ) -> str | None:  # fmt: skip
        """Why a verdict is not earned, if the traffic could have made it (``adjust``).

        The period before shows how the signal moves with the load and the prompt length
        within its strata. Two differences are weighed at those slopes: what the strata left
        (a half-octave of load, an octave of prompt), and, for latencies when the arrival rates
        differ beyond ``LOAD_RATIO``, the whole difference in rate (a closed-loop tester's
        requests in flight, and a batching engine's decode speed, follow the rate more than
        the strata can hold). For a latency that includes prefill, while the cache's hit rate
        has no verdict (``cache_moved`` false), a third: the prompt tokens the cache did not
        serve, whose difference is then what the prompts offered the cache (with a shared
        prefix of another length, say), not the cache's doing; once the hit rate moved, they
        are how the change reaches the latency, and explain nothing away. If what is left of
        the change is no verdict, it is inconclusive. A change *against* the traffic (slower
        at a lower rate) is never explained away.
        """
        b, change, low, high = estimate
        response = before.values[spec.numerator][valid[0]]
        if spec.denominator is not None:
            with np.errstate(invalid="ignore", divide="ignore"):
                response = 100.0 * response / before.values[spec.denominator][valid[0]]
        elif spec.points:
            response = 100.0 * response
        else:
            response = np.log(np.maximum(response, 1e-9))
        covariates = [
            np.column_stack([np.log1p(data.values["load"][ok]), np.log1p(data.values["prompt"][ok])])
            for data, ok in ((before, valid[0]), (after, valid[1]))
        ]
        strata_of = [data.strata[which][ok] for data, ok in ((before, valid[0]), (after, valid[1]))]
        effect = explained_shift(
            (strata_of[0], covariates[0], response), (strata_of[1], covariates[1]), mix, spec.quantile
        )
        shifts = [(effect.shift, "the load in flight and the prompt lengths left within comparable strata")]
        if spec.prefill and not cache_moved:
            # The prompt tokens the cache did not serve (NaN where no cached count was logged).
            uncached = [
                np.log1p(np.maximum(data.values["prompt"][ok] - data.values["cached"][ok], 0.0))[:, None]
                for data, ok in ((before, valid[0]), (after, valid[1]))
            ]
            by_cache = explained_shift(
                (strata_of[0], uncached[0], response), (strata_of[1], uncached[1]), mix, spec.quantile
            )
            shifts.append((by_cache.shift, "the prompt tokens the prefix cache did not serve (its hit rate unchanged)"))
        load = load_differs(traffic)
        if load and not spec.points and traffic.rate_before and traffic.rate_after:
            shifts.append((float(effect.slopes[0]) * math.log(traffic.rate_after / traffic.rate_before), load))
        for shift, what in shifts:
            if spec.points:
                left, amount = (change - shift, low - shift, high - shift), f"{shift:+.2f} pt"
            else:
                factor = math.exp(shift)
                left, amount = (change / factor, low / factor, high / factor), f"{100 * (factor - 1):+.1f} %"
            if self._verdict(spec, b, *left) != verdict:
                return f"{what}, at the period before's sensitivity to them, could explain {amount} of it"
        return None

    def _verdict(self, spec: SignalSpec, before: float, change: float, low: float, high: float) -> Verdict:
        """A verdict needs the interval to exclude no change and a practical size: 5 % of the
        value (``ratio_threshold``), and for shares also at least 0.1 point."""
        if spec.points:
            none, threshold = 0.0, max(self.points_threshold, 100.0 * self.ratio_threshold * abs(before))
        else:
            none, threshold = 1.0, self.ratio_threshold
        if low <= none <= high or abs(change - none) < threshold:
            return "no change"
        went_up = change > none
        return "regressed" if went_up == spec.lower_is_better else "improved"


def against_the_load(spec: SignalSpec, verdict: Verdict, traffic: TrafficMix) -> bool:
    """Whether a latency verdict goes against a load difference beyond ``LOAD_RATIO``: slower
    at a lower arrival rate, or faster at a higher one. Latency does not fall as load grows,
    so such a verdict stands however little the two periods' traffic overlaps.

    >>> spec = SignalSpec("ttft_p50", "ttft", quantile=0.5)
    >>> quieter = TrafficMix(rate_before=2.2, rate_after=1.1)
    >>> against_the_load(spec, "regressed", quieter), against_the_load(spec, "improved", quieter)
    (True, False)
    """
    rb, ra = traffic.rate_before, traffic.rate_after
    if spec.points or verdict not in ("regressed", "improved") or not rb or not ra or not load_differs(traffic):
        return False
    return (ra < rb) == (verdict == "regressed")


def counts_differ(before: Side, after: Side, alpha: float) -> bool:
    """Whether two periods' counts of a 0/1 outcome differ beyond chance (two-sided, at ``alpha``).

    The exact test of two Poisson counts: given ``k`` events in all, the period after's number
    is binomial with its share of the requests. The bootstrap alone cannot say this for rare
    events: a period with no event has no spread to resample, so 4 errors in 3,000 requests
    against none in 2,300 would look certain, while chance alone puts all 4 on one side one
    time in ten.

    >>> def side_of(events, n):
    ...     return Side(np.r_[np.ones(events), np.zeros(n - events)], None, np.full(n, 1 / n),
    ...                 np.zeros(1, np.int64), np.array([n]), np.ones(1), np.zeros(n, np.int64))
    >>> counts_differ(side_of(4, 3000), side_of(0, 2300), 0.05)
    False
    >>> counts_differ(side_of(40, 3000), side_of(5, 2300), 0.05)
    True
    """
    events_b, events_a = int(before.numerator.sum()), int(after.numerator.sum())
    total = events_b + events_a
    if total == 0:
        return False
    share = len(after.numerator) / (len(before.numerator) + len(after.numerator))
    from scipy.stats import binom  # here, not at the top: see ``models.stats.traffic``

    tails = binom.cdf(events_a, total, share), binom.sf(events_a - 1, total, share)
    return bool(min(1.0, 2 * min(tails)) < alpha)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None
