"""The load-conditioned latency model's physics, one rule per test, no broker.

The scenario suites (``tests/test_real_traffic.py``) show these rules on whole workloads;
here each is pinned on a seeded stream small enough to read.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from servewatch.models.detect.signal_detector import (
    QUEUE_SHARE,
    DetectorConfig,
    SignalDetector,
    Verdict,
    queue_makes_up,
)
from servewatch.models.detect.signals import BY_SIGNAL, SPEC_SETS, Reading
from servewatch.models.stats.latency import LoadConditionedLatency
from servewatch.models.windows.open_window import aggregate_rows
from servewatch.models.windows.segments import Segmenter
from servewatch.schemas.anomaly import Signal
from servewatch.schemas.request_log import RequestLog


def demand(ratio: float) -> dict[str, float]:
    return {"requests_per_s": 10.0 * ratio, "prompt_tokens_per_s": 10_000.0 * ratio}


def trained(windows: int = 400, seed: int = 7, spread: float = 0.2) -> LoadConditionedLatency:
    """A TTFT model that has seen demand wander ±20 % around its usual, with 10 % noise."""
    rng = random.Random(seed)
    model = LoadConditionedLatency()
    for _ in range(windows):
        ratio = rng.uniform(1 - spread, 1 + spread)
        model.learn_one(demand(ratio), 0.8 * ratio**0.3 * math.exp(rng.gauss(0, 0.1)))
    return model


def test_a_rise_at_less_than_the_usual_demand_pages_and_is_never_put_down_to_load() -> None:
    # Demand never moved, so the slopes are as unsure as their priors far from the usual.
    detector = SignalDetector(BY_SIGNAL[Signal.TTFT], trained(spread=0.02))
    config = DetectorConfig()
    # Half the usual demand (latency can only be lower there), yet 1.8x the usual TTFT: the
    # regression alone cannot tell (its slope might be anything), the usual level can.
    verdict = detector.judge(Reading(value=0.8 * 1.8, x=demand(0.5), n=50), config)
    assert verdict.pages and not verdict.explained
    # 3x the usual demand, TTFT up 1.5x: load, as the slopes and surge allow.
    verdict = detector.judge(Reading(value=1.2, x=demand(3.0), n=50), config)
    assert not verdict.pages


def test_a_faults_first_lone_window_does_not_teach_heavy_tails() -> None:
    model = trained()
    nu_before = model.predict_one(demand(1.0)).nu
    usual = model.predict_one(demand(1.0)).expected
    # A fault that flickers: one wild window, a few ordinary-looking ones, then back.
    for value in (usual * 2.5, usual, usual * 1.1, usual * 2.4, usual, usual * 2.6):
        if value > usual * 2:
            model.note_unlearned(demand(1.0), value)
        else:
            model.learn_one(demand(1.0), value)
    assert model.predict_one(demand(1.0)).nu >= nu_before - 0.5  # not counted as the noise's tails


def test_a_lone_wild_window_followed_by_calm_counts_as_the_tails() -> None:
    model = trained()
    nu_before = model.predict_one(demand(1.0)).nu
    usual = model.predict_one(demand(1.0)).expected
    model.note_unlearned(demand(1.0), usual * 3.0)
    for _ in range(8):
        model.learn_one(demand(1.0), usual)
    assert model.predict_one(demand(1.0)).nu < nu_before  # heavier tails than it thought


def judged(
    factors: list[tuple[float, dict[str, float]]], signal: Signal = Signal.TTFT, source: str = "requests"
) -> list[Verdict]:
    """Verdicts of a trained TTFT detector (judging ``signal`` from ``source``'s windows) on
    windows at ``factor`` times the usual TTFT, at the usual demand (plus ``extra`` inputs),
    each learned or noted as the worker does."""
    config = DetectorConfig()
    model = trained()
    usual = model.predict_one(demand(1.0)).expected
    detector = SignalDetector(SPEC_SETS[source][signal], model, tracker=config.tracker())
    verdicts = []
    for factor, extra in factors:
        reading = Reading(value=usual * factor, x={**demand(1.0), **extra}, n=50)
        verdict = detector.judge(reading, config)
        detector.learn_if_normal(reading, verdict)
        verdicts.append(verdict)
    return verdicts


def test_a_window_beyond_the_critical_surprise_fires_on_its_own() -> None:
    # 2.2x: anomalous (1 in a million), but one window: the incident waits for a second.
    (anomalous,) = judged([(2.2, {})])
    assert anomalous.pages and DetectorConfig().threshold <= anomalous.score < DetectorConfig().critical
    assert not anomalous.sustained
    # 3x: beyond 1 in 100 million at the segment's own tails, as strong as any pair of windows.
    (critical,) = judged([(3.0, {})])
    assert critical.pages and critical.score >= DetectorConfig().critical and critical.sustained


def test_the_window_after_a_paging_one_is_judged_for_persistence() -> None:
    # A fault's first full window (2x), then one that alone would not page (1.45x): together,
    # beyond the echo noise leaves after a wild window, the fault lasts.
    first, second = judged([(2.0, {}), (1.45, {})])
    assert first.pages and second.pages
    (alone,) = judged([(1.45, {})])
    assert not alone.pages
    # Back to usual after the wild window: nothing lasts.
    assert not judged([(2.0, {}), (1.0, {})])[1].pages


def test_a_window_load_explained_leaves_no_pair_behind() -> None:
    # A burst fills every slot: its queue is load (explained). The window after it, still
    # draining at 1.45x, is not a fault that lasts: what load explains does not persist.
    burst, after = judged([(2.0, {"saturated": 1.0}), (1.45, {})])
    assert burst.explained and not burst.pages
    assert not after.pages


def test_at_the_usual_demand_an_unusual_window_and_a_paging_one_fire_at_once() -> None:
    # A fault's first window is mostly requests served partly before it: 1.45x, unusual (1 in
    # 100) but short of paging; the next, 2x, pages. At the usual demand no burst explains the
    # pair, and the incident fires on it rather than wait for a third window.
    first, second = judged([(1.45, {}), (2.0, {})])
    assert not first.pages and first.score >= DetectorConfig().threshold / 2
    assert second.pages and second.sustained
    # Above the usual demand a burst's rise comes first as such a window: the pair waits.
    busier = demand(1.18)
    _, burst = judged([(1.45 * 1.05, busier), (2.0 * 1.05, busier)])
    assert burst.pages and not burst.sustained
    # Nor does a reading an engine takes as it happens: its gauges, its TTFT and inter-token
    # histograms hold no requests reached part-way. Its per-request histograms (queue and
    # prefill time, observed when the request finishes) do, as request logs do.
    for signal in (Signal.KV_CACHE_USAGE, Signal.ITL, Signal.TTFT):
        _, scraped = judged([(1.45, {}), (2.0, {})], signal, source="engines")
        assert scraped.pages and not scraped.sustained
    _, at_finish = judged([(1.45, {}), (2.0, {})], Signal.PREFILL_TIME, source="engines")
    assert at_finish.pages and at_finish.sustained


def test_a_burst_that_queues_a_few_requests_for_seconds_is_read_as_the_queue_it_is() -> None:
    # A burst fills every slot: 5 of 20 requests wait 6 s for one, the rest none; each
    # prefills in 1 s. TTFT's geometric mean triples, while the queue's (most requests
    # waited 1 ms) is a tenth of it: compared so, the queue would seem a small part of the
    # rise. Of the seconds users waited for a first token, 60 % were queueing.
    records = []
    for i in range(20):
        queue = 6.0 if i < 5 else 0.001
        records.append(RequestLog.model_validate({
            "request_id": f"r{i}", "timestamp": 1_767_225_605.0 + i * 0.1, "model": "m", "prompt_tokens": 5000,
            "completion_tokens": 10, "queue_s": queue, "prefill_s": 1.0, "ttft_s": queue + 1.0,
            "e2e_s": queue + 1.5, "finish_reason": "stop",
        }).to_row())  # fmt: skip
    (window,) = aggregate_rows(records, Segmenter(), 10.0)
    load = window.load()
    ttft = _geometric_ttft(records)
    assert load["queue_s"] < QUEUE_SHARE * ttft  # a mean of logs: a small part
    assert load["queue_share"] == pytest.approx(30.0 / 50.0, rel=1e-3)
    assert queue_makes_up(Signal.TTFT, load, ttft)


def _geometric_ttft(records: list[dict[str, Any]]) -> float:
    return math.exp(sum(math.log(r["ttft_s"]) for r in records) / len(records))


def test_a_queue_at_the_usual_demand_is_a_burst_only_while_the_window_shows_the_slots_full() -> None:
    # Requests queue at 0.9x the usual arrivals, and the queue is most of TTFT. The smoothed
    # busy-slot figure still remembers the full windows before (0.72 of the most ever).
    queued = {"queue_s": 7.0, "queue_share": 0.8, "arrivals_vs_usual": 0.9, "running_vs_most": 0.72,
              "arrivals_seen_s": 40.0}  # fmt: skip
    detector = SignalDetector(SPEC_SETS["requests"][Signal.TTFT], LoadConditionedLatency())

    def load_explains(**figures: float) -> bool:
        return detector._saturated(Reading(9.0, 20, {**queued, **figures}))

    assert load_explains(running_now_vs_most=0.95)  # a burst: every slot busy in its window
    assert not load_explains(running_now_vs_most=0.53)  # half the slots lost: a fault
    # The same low window draining a queue older than the arrivals it sees: a past surge's.
    assert load_explains(running_now_vs_most=0.53, queue_s=600.0)
    # Above the usual demand a window reading low is the luck of which requests ended in it.
    assert load_explains(running_now_vs_most=0.53, arrivals_vs_usual=1.3)
