"""Rare bad outcomes: a segment's usual rate is no surer than its requests allow, and a page
on a rate needs a handful of bad requests, not one; its severity grows with the users hurt.

Through the detector bank, as the worker judges windows: a fleet segment of the model serves
2,000 requests a window at a background error rate of 0.05 % (its model's pooled rate), and
the segment under test serves 40 a window (4 requests/s) for six hours without one error.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from servewatch.models.detect.bank import DetectorBank
from servewatch.models.detect.detector import DetectorConfig, SegmentDetectors
from servewatch.models.detect.signal_detector import SignalDetector
from servewatch.models.detect.signals import BY_SIGNAL, SPEC_SETS, Reading
from servewatch.models.stats.rates import JEFFREYS_BAD, BetaBinomialRate
from servewatch.models.windows.window import WindowStats
from servewatch.schemas.anomaly import AnomalyEvent, Signal, Status

FLEET, SEGMENT = "model=m|route=fleet", "model=m|route=chat"
BACKGROUND = 0.0005
WARMUP = 2_160  # six hours of 10 s windows: 86,400 requests of the segment, none failed


class Fleet:
    """A bank judging error rates only, the fleet's segment and the one under test in step."""

    def __init__(self, seed: int = 1) -> None:
        self.rng = np.random.default_rng(seed)
        self.bank = DetectorBank(DetectorConfig(signals=(Signal.ERROR_RATE.value,)))
        self.start = 0.0
        for _ in range(WARMUP):
            assert not self.window(40, 0)

    def window(self, requests: int, errors: int) -> list[AnomalyEvent]:
        """One 10 s window of both segments; the events of the one under test."""
        background = int(self.rng.binomial(2_000, BACKGROUND))
        self.bank.observe(WindowStats(FLEET, self.start, 10.0, requests=2_000, errors=background))
        events = self.bank.observe(WindowStats(SEGMENT, self.start, 10.0, requests=requests, errors=errors))
        self.start += 10.0
        return events


@pytest.fixture(scope="module")
def warmed() -> Fleet:
    return Fleet()


@pytest.fixture
def fleet(warmed: Fleet) -> Fleet:
    """Each test from the same six hours (a copy: warming up is most of the time)."""
    return copy.deepcopy(warmed)


def test_a_restarted_worker_starts_a_new_segment_from_its_models_stored_pooled_rate(fleet: Fleet) -> None:
    """The model's pooled rate (and the capacity a new segment borrows) is stored beside its
    segments: a worker restarted from the state table judges a segment it never met as the
    worker before it would have, not from a generic prior (as a replay of the same records does)."""
    stored = {key: json.loads(json.dumps(state)) for key, state in fleet.bank.states_to_save(every_one=True)}
    restarted = DetectorBank(fleet.bank.config, restore=stored.get)
    new = "model=m|route=new"
    for bank in (fleet.bank, restarted):  # a round of windows, the new segment's judged first
        bank.observe(WindowStats(new, fleet.start, 10.0, requests=40, errors=1))
        bank.observe(WindowStats(FLEET, fleet.start, 10.0, requests=2_000, errors=1))
        bank.observe(WindowStats(SEGMENT, fleet.start, 10.0, requests=40, errors=0))
    assert restarted.segment(new).state() == fleet.bank.segment(new).state()


def test_the_usual_rate_of_a_segment_without_errors_keeps_half_a_bad_request(fleet: Fleet) -> None:
    model = fleet.bank.segment(SEGMENT).model(BY_SIGNAL[Signal.ERROR_RATE])
    assert model.alpha == 0.0  # not one error of its own
    assert model.expected_rate >= JEFFREYS_BAD / model.strength > 1e-5  # not ~0
    # The model's rate beside its own: half a bad request at 0.05 % is 1,000 requests, capped
    # (a guess about this segment), so it holds half a bad request in fewer.
    assert model.prior_alpha == JEFFREYS_BAD
    assert model.prior_alpha + model.prior_beta == pytest.approx(model.max_prior_strength, rel=0.01)


@pytest.mark.parametrize("requests", [46, 11, 2])
def test_one_failed_request_does_not_page(fleet: Fleet, requests: int) -> None:
    events = fleet.window(requests, 1)
    for _ in range(12):
        events += fleet.window(40, 0)
    assert events == []


def test_one_failure_in_each_of_three_windows_does_not_page(fleet: Fleet) -> None:
    """The tester's windows in a row: three failures in 30 s, maybe one user's request retried."""
    events = [e for requests in (46, 11, 2) for e in fleet.window(requests, 1)]
    for _ in range(12):
        events += fleet.window(40, 0)
    assert events == []


def test_ten_failures_in_a_minute_page_an_error_burst_as_a_warning(fleet: Fleet) -> None:
    events = [e for errors in (2, 1, 2, 2, 1, 2) for e in fleet.window(40, errors)]
    fired = [e for e in events if e.status is Status.FIRING]
    assert fired, "10 of 240 requests failed in a minute, against none in 86,400"
    first = fired[0]
    assert first.signal is Signal.ERROR_RATE and first.pages
    assert first.hints[0].code == "error_burst"
    assert first.severity.value == "warning"  # ten users a minute: sure, but not an outage
    assert first.expected > 1e-5, "the usual rate said is not 0.000 %"


def test_half_of_a_segments_requests_failing_is_critical(fleet: Fleet) -> None:
    events = [e for _ in range(3) for e in fleet.window(40, 20)]
    fired = [e for e in events if e.status is Status.FIRING]
    assert fired and fired[0].severity.value == "critical"


@pytest.mark.parametrize(("requests", "bad", "severity"), [(40, 1, "warning"), (2_000, 100, "critical")])
def test_a_sure_rise_is_critical_only_when_it_hurts_many(requests: int, bad: int, severity: str) -> None:
    """Surprise alone does not make a page critical: bad requests a minute do. A segment
    without errors that fails 1 of 40 a window for two minutes is sure to have a fault, which
    hurts 6 users a minute; 100 of 2,000 a window is 600 a minute."""
    spec = BY_SIGNAL[Signal.ERROR_RATE]
    config = DetectorConfig()
    model = spec.build(config.grace_windows)
    for _ in range(360):
        model.learn_one({"trials": requests, "seconds": 10.0}, 0)
    detector = SignalDetector(spec, model)
    for _ in range(12):
        verdict = detector.judge(Reading(bad / requests, requests, {"trials": requests, "seconds": 10.0}, bad), config)
    assert verdict.pages and verdict.score >= config.critical
    assert detector.for_lifecycle(verdict, config) == (True, severity)


def test_a_rate_state_from_before_the_prior_was_kept_apart_still_loads() -> None:
    model = BetaBinomialRate()
    for _ in range(20):
        model.learn_one({"trials": 100}, 1)
    old = model.state()
    del old["prior"]
    clone = BetaBinomialRate()
    clone.load_state(old)
    assert (clone.prior_alpha, clone.prior_beta) == (BetaBinomialRate().prior_alpha, BetaBinomialRate().prior_beta)
    assert abs(clone.expected_rate - model.expected_rate) < 1e-12

    segment = SegmentDetectors(SEGMENT)
    segment.observe(WindowStats(SEGMENT, 0.0, 10.0, requests=40, errors=1), {})
    state = segment.state()
    state["v"] = 3
    for saved in state["signals"].values():
        saved["model"].pop("prior", None)
    SegmentDetectors(SEGMENT).load_state(state)  # version 3 still reads


def _engine_hit_rate_detector(usual: float, requests: int, seed: int) -> tuple[SignalDetector, DetectorConfig]:
    """An engine's prefix-cache hit rate learned at ``usual`` over ``requests`` a window (a
    share of prompt tokens, which wobbles less than a count of requests hitting would)."""
    spec = SPEC_SETS["engines"][Signal.CACHE_HIT_RATE]
    config = DetectorConfig()
    model = spec.build(config.grace_windows)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        model.learn_one({"trials": requests}, float(np.clip(rng.normal(usual, 0.05), 0.0, 1.0)))
    return SignalDetector(spec, model), config


def test_a_quiet_window_without_cache_hits_does_not_page() -> None:
    """Six requests, none of which hit a cache that serves one request in five: it happens a
    quarter of the time (0.8 ** 6), and no request's worth of service was lost."""
    detector, config = _engine_hit_rate_detector(0.2, 6, seed=3)
    verdict = detector.judge(Reading(0.0, 6, {"trials": 6}), config)
    assert verdict.score >= config.threshold  # surprising on the logit scale, yet
    assert not verdict.pages and not verdict.learnable


def test_a_hit_rate_collapse_pages_once_a_handful_of_requests_missed() -> None:
    """The cache switched off on an engine serving a few requests a window: the windows in a
    row that fall short add up, and it pages once four requests' worth of hits were lost."""
    detector, config = _engine_hit_rate_detector(0.4, 6, seed=4)
    pages = [detector.judge(Reading(0.0, 6, {"trials": 6}), config).pages for _ in range(3)]
    assert pages == [False, True, True]  # 2.4 requests' worth short, then 4.8


def test_a_hit_rate_collapse_with_critical_evidence_fires_in_one_window_a_quiet_one_never() -> None:
    """As for latency, one window fires its incident alone only with critical evidence, and a
    share also needs its handful of requests' worth short: the cache switched off on an engine
    serving 40 requests a window fires at once; six requests with no hit are short by one
    request's worth and page nothing, however surprising on the logit scale."""
    detector, config = _engine_hit_rate_detector(0.4, 40, seed=5)
    collapse = detector.judge(Reading(0.0, 40, {"trials": 40}), config)
    assert collapse.score >= config.critical and collapse.pages and collapse.sustained

    quiet, config = _engine_hit_rate_detector(0.2, 6, seed=3)
    verdict = quiet.judge(Reading(0.0, 6, {"trials": 6}), config)
    assert not verdict.pages and not verdict.sustained
