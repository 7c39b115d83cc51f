"""One signal of one segment in judgement, and the knobs every detector shares.

``SignalDetector.judge`` turns a window's ``Reading`` into a ``Verdict``: latency-like
signals are judged against the load-conditioned prediction (pages) and the load-blind
level (explained by load when only that one is surprising); rates and shares against
their usual level. The run of anomalous windows it keeps decides when a lasting change
is adopted as the new normal.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scipy.special import bdtrik

from servewatch.models.detect.lifecycle import IncidentTracker
from servewatch.models.detect.signals import SPECS, Reading, SignalSpec, structural_cache_surprise
from servewatch.models.explain.hints import engine_slots_idle, slots_kept_full
from servewatch.models.stats.latency import Prediction
from servewatch.models.stats.tails import TWO_LOOKS, student_bound
from servewatch.schemas.anomaly import Signal


@dataclass(frozen=True)
class DetectorConfig:
    """Knobs shared by every segment's detectors."""

    threshold: float = 4.0  # surprise (-log10 p) at which a window is anomalous
    critical: float = 8.0  # surprise at which a paging window is critical, and fires its incident alone
    min_requests: int = 5  # fewer samples behind a latency or share: no verdict, nothing learned
    fire_after: int = 2
    fire_within: int = 3
    resolve_after: int = 3
    update_every: int = 6
    young_windows: int = 30  # baseline younger than this is flagged in events
    grace_windows: int = 6
    adopt_after: int = 90  # anomalous windows in a row after which the new level is the normal
    reopen_within: int = 30  # a re-fire this soon after resolving continues the incident
    # A window with fewer requests than this share of the segment's usual is not judged on
    # latency: its few survivors (a segment draining or going quiet) are a biased sample.
    min_share_of_usual: float = 0.2
    # Event seconds without a window after which a segment's open incidents resolve as
    # ``no_data``, and after which the segment itself is forgotten (``models.detect.no_data``).
    no_data_after_s: float = 300.0
    segment_idle_s: float = 86_400.0
    signals: tuple[str, ...] = tuple(spec.signal.value for spec in SPECS)  # the signals judged
    source: str = "requests"  # whose windows: "requests" (WindowStats) or "engines" (EngineWindow)
    replica_min_ratio: float = 1.3  # an instance is paged only this much worse than its peers
    replica_warmup_requests: int = 100  # requests an instance serves before it is compared

    @property
    def unusual(self) -> float:
        """Surprise at which a window is unusual on its own, half the paging bar (1 in 100 at
        the default): reported, or taken as corroboration, never paged on alone."""
        return self.threshold / 2

    @property
    def near_paging(self) -> float:
        """Surprise within a decade of paging: such a window is not learned as the normal, and
        above the usual demand the weaker of a pair's windows must reach it."""
        return self.threshold - 1.0

    def tracker(self) -> IncidentTracker:
        return IncidentTracker(
            self.fire_after, self.fire_within, self.resolve_after, self.update_every, self.reopen_within
        )


@dataclass(slots=True)
class Verdict:
    score: float  # the surprise reported
    expected: float
    pages: bool
    explained: bool
    usual: float  # load-blind usual value (latency) or the expected one
    # Why, when the window alone does not say: "saturated" (demand beyond the capacity the
    # model has shown: explained by load), "drift" (the level crept away from its anchor).
    cause: str | None = None
    learnable: bool = True  # the model may learn this window (it is what the model expects)
    drifting: bool = False  # what surprises is the drift of recent windows, not this one alone
    # The evidence spans windows already (a rate's CUSUM): an anomalous window fires without
    # waiting for a second one, a normal one inside an incident resolves it without waiting
    # for more (either would count the same evidence twice).
    sustained: bool = False
    # Rates: the evidence hurts users enough for a critical page (``CRITICAL_BAD_PER_MINUTE``).
    severe: bool = True
    # A latency model's prediction at this load, for ``band`` (kept, not drawn: drawing it
    # costs special functions, paid only where judged windows are kept for charts).
    prediction: Prediction | None = None
    # Latency: the window's own surprise at this demand, one look (``Judgement.alone``).
    alone: float = 0.0


def band(kind: str, verdict: Verdict, reading: Reading, threshold: float) -> tuple[float | None, float | None]:
    """The normal band of a judged window: values outside it are anomalous on their own (the
    single-window bound at ``threshold``); None where the model has no such bound (shares)."""
    if kind == "latency":
        return latency_band(verdict.prediction, threshold) if verdict.prediction is not None else (None, None)
    if kind == "rate":
        return 0.0, rate_band(verdict.expected, reading.n, threshold)
    return None, None


def latency_band(prediction: Prediction, threshold: float) -> tuple[float | None, float | None]:
    """Latencies a window may show at this load before it is anomalous on its own: the
    prediction's median times and divided by the factor whose surprise is ``threshold``
    (two looks, as ``LatencyModel.judge`` takes them)."""
    if not (prediction.sd > 0 and math.isfinite(prediction.sd)):
        return None, None
    z = student_bound(threshold + TWO_LOOKS, prediction.nu) * prediction.sd
    return math.exp(prediction.mean - z), math.exp(prediction.mean + z)


def rate_band(expected: float, n: int, threshold: float) -> float | None:
    """The highest share of ``n`` requests that is not anomalous on its own at ``expected``
    (the binomial bound; the beta-binomial model is a little wider)."""
    if n <= 0 or not 0.0 < expected < 1.0:
        return None
    # bdtrik inverts the binomial CDF in k (a ufunc: microseconds, where binom.isf takes ~100)
    bad = math.ceil(float(bdtrik(1.0 - 10.0 ** (-(threshold + TWO_LOOKS)), n, expected)))
    return min(bad, n) / n


#: Bad requests the evidence of a rate must hold before a window pages (``Impact.bad``: over
#: the windows the evidence spans). Surprise alone says the rate moved; a page also says bad
#: requests keep coming. Were they a one-off, at most one expected over those windows, four
#: or more would come under 2 % of the time (Poisson: P(K >= 4 | 1) = 1.9 %, against 8 % for
#: three), however low the usual rate is believed to be, so the count holds even where the
#: usual rate was learned too low. And one user's failing request is up to three failed ones
#: in the log: OpenAI's client libraries retry twice by default. The count spans windows, so
#: it costs a large share little at any traffic: a segment whose every request fails pages
#: once four have, and a slow fault's CUSUM holds more than four by the time it crosses.
MIN_BAD_TO_PAGE = 4
#: A rate's page is critical only when it hurts many users, not merely surprises: this many
#: bad requests a minute beyond the usual rate (one every two seconds: an hour's wait, all a
#: warning may get, would fail 1,800), or this share of the segment's requests beyond it
#: (most of them fail: the segment is down, whatever its traffic).
CRITICAL_BAD_PER_MINUTE = 30.0
CRITICAL_SHARE = 0.5


#: Signals a queue in front of the engines lengthens: saturation explains their rise.
#: (Prefill per token is TTFT less queue time where the logs do not split them.)
#: (An engine's waiting requests are the queue itself, as its metrics measure it.)
QUEUE_SENSITIVE = frozenset(
    {Signal.TTFT, Signal.QUEUE_TIME, Signal.E2E, Signal.PREFILL_PER_TOKEN, Signal.WAITING_REQUESTS}
)
#: Share of a signal's time that queueing must make up for a full engine to explain it.
QUEUE_SHARE = 0.25


def queue_makes_up(signal: Signal, load: Mapping[str, float], observed: float) -> bool:
    """Whether queueing makes up ``QUEUE_SHARE`` of a window's ``signal`` (observed at
    ``observed`` seconds): for TTFT, the share of its seconds spent queueing where the
    window says it (``queue_share``: request logs, whose ``queue_s`` is a mean of logs, not
    comparable with a sum); else the mean queue against the signal's value."""
    share = load.get("queue_share", math.nan) if signal is Signal.TTFT else math.nan
    if share == share:
        return share >= QUEUE_SHARE
    queue = load.get("queue_s", math.nan)
    return queue == queue and queue >= QUEUE_SHARE * observed


@dataclass(slots=True)
class SignalDetector:
    """One signal of one segment in judgement: its model, and its incident tracker and run of
    anomalous windows. Kept by the segment only while something is going on (see ``active``).
    """

    spec: SignalSpec
    model: Any
    tracker: IncidentTracker | None = None
    run: int = 0  # anomalous windows of the current run (see ``note_run``)
    run_total: float = 0.0  # sum over the run of what ``adopt`` takes (log value, or share)
    shortfall: float = 0.0  # a share's surprising windows in a row: requests' worth short of usual

    def judge(self, reading: Reading, config: DetectorConfig) -> Verdict:
        model, kind = self.model, self.spec.kind
        if kind == "latency":
            judged = model.judge(reading.x, reading.value)
            prediction, conditioned, level, drifting, at_most_usual = judged[:5]
            # A model still in its grace windows has no band worth drawing (nor judges anything).
            kept = prediction if model.warm else None
            worse = (math.log(reading.value) - prediction.level) * (1 if model.tail == "upper" else -1) > 0
            surprising = conditioned >= config.threshold
            if surprising and self.spec.signal in QUEUE_SENSITIVE and self._saturated(reading):
                # Demand beyond anything the engines have kept up with: the queue is load.
                return Verdict(max(conditioned, level), prediction.expected, False, True,
                               math.exp(prediction.level), "saturated", learnable=False,
                               prediction=kept)  # fmt: skip
            pages = surprising and (worse or drifting)
            # Above its usual level at all, but as expected at this demand: load. While the
            # engines are saturated a rise that is merely unusual (1 in 100) is reported too:
            # capacity is binding, and on-call should see it before it becomes a fault.
            # At the usual demand or less, load explains nothing.
            saturated = reading.x.get("saturated", 0.0) > 0 and self.spec.signal in QUEUE_SENSITIVE
            bar = config.unusual if saturated else config.threshold
            explained = not surprising and not at_most_usual and level >= bar
            score = max(conditioned, level) if explained else conditioned
            expected = prediction.anchored if drifting and pages else prediction.expected
            # A window within a decade of paging is not learned either: a fault's first windows
            # often fall just short, and learning them would teach the model the fault.
            learnable = conditioned < config.near_paging
            # Two windows in a row, each within a decade of paging on its own (as near as a fault's
            # first windows come) and together beyond it (``pair_surprise``), are the two anomalous
            # windows an incident asks for: the incident fires on them, as on a rate's CUSUM, rather
            # than wait for a third window that would count the same evidence again. A burst's
            # ordinary window followed by a wild one does not qualify: that needs a second look.
            # Nor does one wild window, unless it alone is as strong as such a pair ever is
            # (``critical``: 1 in 100 million at the segment's own heavy tails, where a model
            # learns them; a series judged with Gaussian tails waits for a second point).
            # At no more than the usual demand there is no burst to rise with, and the window before
            # need only be unusual on its own (1 in 100): a fault's first window is mostly requests
            # served partly before it (an answer half decoded at the old pace when decoding slowed).
            # Not so a reading taken as it happens (``SignalSpec.at_finish``: an engine's gauges,
            # its TTFT and inter-token histograms): a change shows there in full at once, and a
            # series creeping up (longer contexts at the usual demand) gives windows in a row each
            # a little higher, which no fault's first window explains.
            reached_partway = at_most_usual and self.spec.at_finish
            paired = judged.paired >= config.threshold and judged.weaker >= (
                config.unusual if reached_partway else config.near_paging
            )
            alone = model.tails_learned and conditioned >= config.critical
            sustained = pages and (paired or alone)
            return Verdict(score, expected, pages, explained, math.exp(prediction.level),
                           "drift" if drifting and pages else None, learnable=learnable,
                           drifting=drifting, sustained=sustained, prediction=kept,
                           alone=judged.alone)  # fmt: skip
        if kind == "rate":
            # Judged alone and with the windows before it (``BetaBinomialRate``); this moves
            # the sequential evidence on, so ``judge`` is called once per window.
            incident = self.firing
            if not incident:
                model.incident_over()  # a resolved incident's evidence must not fire it again
            looks = model.looks(reading.x, reading.bad, config.threshold)
            score, sustained = max(looks.alone, looks.together), looks.sustained
            model.step(reading.x, reading.bad, incident=incident)
            impact = model.impact(reading.x, reading.bad)
            # An incident lasts until the evidence favours the usual rate over its own (a 5 %
            # rate over 20 requests gives many windows with 0 or 1 bad ones), and then ends at
            # once: that evidence spans windows already.
            if incident:
                pages = not model.recovered
                sustained = not pages
            else:  # evidence and impact: a handful of bad requests, not one (``MIN_BAD_TO_PAGE``)
                pages = score >= config.threshold and impact.bad >= MIN_BAD_TO_PAGE
                sustained = sustained and pages
            severe = impact.per_minute >= CRITICAL_BAD_PER_MINUTE or impact.excess_share >= CRITICAL_SHARE
            # As for latency: a window within a decade of paging is not the usual rate (nor is
            # one held back for want of bad requests: learned, it would hide the next ones).
            learnable = not incident and score < config.near_paging
            return Verdict(score, model.expected_rate, pages, False, model.expected_rate, learnable=learnable,
                           sustained=sustained, severe=severe)  # fmt: skip
        score, expected = model.score_one(reading.x, reading.value), model.expected
        if self.spec.signal is Signal.CACHE_HIT_RATE:
            structural, floor = structural_cache_surprise(reading)
            if structural > score:  # judged against what sharing implies, not only history
                score, expected = structural, floor
        surprising = score >= config.threshold
        if surprising:
            gap = expected - reading.value if getattr(model, "tail", "lower") == "lower" else reading.value - expected
            self.shortfall += max(gap, 0.0) * reading.n
        elif not self.firing:
            self.shortfall = 0.0
        # Evidence and impact, as for rates: a share pages once the surprising windows in a row
        # fell short by a handful of requests' worth (``MIN_BAD_TO_PAGE``), not on one window of
        # six requests, none of which hit a cache that serves one in five (a quarter of the time).
        pages = surprising and (self.firing or self.shortfall >= MIN_BAD_TO_PAGE)
        # As for latency: one window fires the incident alone only with critical evidence.
        sustained = pages and score >= config.critical
        return Verdict(score, expected, pages, False, model.expected, learnable=not surprising, sustained=sustained)

    def for_lifecycle(self, verdict: Verdict, config: DetectorConfig) -> tuple[bool, str]:
        """(anomalous, severity) of a window as the incident lifecycle takes it.

        Inside a paging incident a window counts as normal only once it is back near the
        baseline (below half the threshold), not merely short of paging: a fault at the edge
        of significance would otherwise resolve and fire again. Rates have their own test
        (``BetaBinomialRate.recovered``).

        A page is critical when its surprise reaches ``critical``; a rate's also needs many
        users hurt (``verdict.severe``): ``CRITICAL_BAD_PER_MINUTE`` bad requests a minute
        beyond the usual rate, at the rate its evidence shows and the segment's traffic now,
        or ``CRITICAL_SHARE`` of its requests. Ten failures a minute in a segment of 240 is
        a warning however sure; half a segment's requests failing, or one every two seconds,
        is critical."""
        holding = self.spec.kind != "rate" and self.paging and not verdict.pages and verdict.score >= config.unusual
        if verdict.pages:
            severity = "critical" if verdict.score >= config.critical and verdict.severe else "warning"
        else:
            severity = "warning" if holding else "info"
        return verdict.pages or verdict.explained or holding, severity

    @property
    def firing(self) -> bool:
        """Whether this signal's incident is open."""
        return self.tracker is not None and self.tracker.firing

    @property
    def paging(self) -> bool:
        """Whether this signal's incident is open and pages (not one load explains)."""
        return self.firing and self.tracker is not None and self.tracker.severity != "info"

    def _saturated(self, reading: Reading) -> bool:
        """Whether a queue-sensitive rise is the engines' capacity binding: saturation (a surge
        beyond what they serve, ``models.stats.capacity``), or a logged queue that makes up a good
        part of the signal (``QUEUE_SHARE``; a burst slows prefill too) while the model's
        engines keep nearly as many slots busy as they ever have (``slots_kept_full``; at the
        usual demand, in the window itself too): a burst too short to lift a window's arrivals
        (seconds of them fill every slot). A fault that
        slows service shows in its own signals (prefill per token, inter-token latency), which
        still page; one that loses slots keeps fewer busy, and pages here."""
        x = reading.x
        if x.get("preempted", 0.0) > 0:
            # An engine whose metrics show preemptions admitted more than its KV cache holds: its
            # queue holds requests thrown back for want of blocks, which no demand explains.
            return False
        # An engine's gauges say whether it was full when its queue formed: running as many
        # requests as it ever does, or a KV cache with no room for one more context. Full, the
        # queue is load (a surge, a burst); with slots idle it is slots lost, whatever the
        # demand (served throughput, which saturation reads, cannot tell the two apart).
        if engine_slots_idle(x):
            return False
        # Before the model's capacity is learned (its first minutes) there is no "fewer slots
        # busy than before" to find: a queue then is the engines full, as any queue is at first.
        # The smoothed figure forgives a window that reads low by the luck of which requests
        # ended in it, but not one at the usual demand whose own figure shows slots lost.
        flat_out = x.get("running_measured", 0.0) > 0 or slots_kept_full(x, unknown=True)
        if x.get("saturated", 0.0) > 0:
            return True
        # End-to-end time also grows with a full batch (every token decodes slower), queue or not.
        queued = self.spec.signal in (Signal.QUEUE_TIME, Signal.E2E, Signal.WAITING_REQUESTS) or queue_makes_up(
            self.spec.signal, x, reading.value
        )
        return flat_out and queued

    def learn_if_normal(self, reading: Reading, verdict: Verdict) -> bool:
        """Learn the window if it is the segment's normal; whether it was.

        A surprise the model did not expect is never its normal, even when load explains it
        (a fault that starts during a surge must not be learned); outside an incident it
        still tells how heavy the segment's tails are (``note_unlearned``). Inside a paging
        incident nothing is learned: its quieter windows are the fault too (a lasting change
        is adopted instead, after ``adopt_after`` windows). An incident load explains (info)
        still teaches the slopes."""
        if not verdict.learnable or self.paging:
            self.note_unlearned(reading, verdict)
            return False
        if verdict.pages:
            return False
        self.learn(reading)
        return True

    def learn(self, reading: Reading) -> None:
        self.model.learn_one(reading.x, reading.bad if self.spec.kind == "rate" else reading.value)

    def note_unlearned(self, reading: Reading, verdict: Verdict) -> None:
        """A window the model does not learn (latency models only): it still sets the next
        window's pair, unless the engines' saturation explained it (a full engine's queue
        draining is that load's aftermath, not a fault that lasts), and outside an incident it
        counts towards how heavy the segment's tails are (``LoadConditionedLatency.note_unlearned``)."""
        if self.spec.kind == "latency":
            self.model.note_unlearned(reading.x, reading.value, tails=not self.firing, drift=verdict.drifting,
                                      pairs=verdict.cause != "saturated")  # fmt: skip

    def note_run(self, pages: bool, reading: Reading, adopt_after: int) -> bool:
        """Count the anomalous windows of the current run; True when it is long enough to adopt.

        A normal window ends the run only when no incident is firing: within an incident,
        a few normal-looking windows (a small segment's noise) do not make a lasting change
        any less lasting.
        """
        if not pages:
            if self.tracker is None or not self.tracker.firing:
                self.run, self.run_total = 0, 0.0
            return False
        self.run += 1
        self.run_total += math.log(reading.value) if self.spec.kind == "latency" else reading.value
        return self.run >= adopt_after

    def adopt(self, reading: Reading) -> None:
        mean = self.run_total / max(self.run, 1)
        if self.spec.kind == "latency":
            self.model.adopt(reading.x, math.exp(mean))
        else:
            self.model.adopt(mean)
        self.run, self.run_total = 0, 0.0
