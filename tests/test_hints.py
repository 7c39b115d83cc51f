"""Each hint from the windows that should raise it, and not from those that should not.

The rules are pure functions of a window's load, the segment's usual figures and the
signal (``models.explain.hints``); engine-side hints come from scrape windows (``capacity_headroom``
and ``prefix_cache_disabled`` end to end in ``tests/test_engine_stage.py``; ``new_segment``
in ``tests/test_detectors.py``), and each injected case's first page in
``tests/test_scenarios.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from servewatch.models.detect.headroom import HeadroomWatch
from servewatch.models.explain.hints import (
    HINT_CODES,
    Baseline,
    latency_hints,
    mention_engine_versions,
    mention_max_tokens,
    signal_hints,
)
from servewatch.models.windows.engine_window import EngineWindow
from servewatch.models.windows.window import WindowStats
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status

#: A segment's usual window: 10 requests/s of 2,000-token prompts, 80 % served from cache,
#: 300-token answers.
USUAL = {
    "requests_per_s": 10.0, "prompt_tokens_per_s": 20_000.0, "uncached_prompt_tokens_per_s": 4_000.0,
    "output_tokens_per_s": 3_000.0, "cache_hit_rate": 0.8,
}  # fmt: skip


def usual() -> Baseline:
    baseline = Baseline()
    for i in range(20):
        baseline.learn(USUAL, window_start=10.0 * i)
    return baseline


def codes(load: dict[str, float], explained: bool = False) -> list[str]:
    return [hint.code for hint in latency_hints({**USUAL, **load}, usual(), explained_by_load=explained)]


def test_the_usual_window_raises_no_latency_hint() -> None:
    assert codes({}) == []


def test_prefix_cache_ineffective_when_the_hit_rate_collapses() -> None:
    assert codes({"cache_hit_rate": 0.05, "uncached_prompt_tokens_per_s": 19_000.0})[0] == "prefix_cache_ineffective"
    assert "prefix_cache_ineffective" not in codes({"cache_hit_rate": 0.7})  # a dip, not a collapse


def test_prefill_bound_when_uncached_work_per_request_grows_at_the_same_prompts() -> None:
    assert codes({"cache_hit_rate": 0.6, "uncached_prompt_tokens_per_s": 10_000.0}) == ["prefill_bound"]
    assert "prefill_bound" not in codes({"uncached_prompt_tokens_per_s": 6_000.0})  # 1.5x: within reason


def test_traffic_shift_when_prompts_grow_and_it_outranks_the_prefill_work_they_bring() -> None:
    longer = {"prompt_tokens_per_s": 60_000.0, "uncached_prompt_tokens_per_s": 12_000.0}  # 3x prompts, same hits
    assert codes(longer) == ["traffic_shift"]
    hint = latency_hints({**USUAL, **longer}, usual(), explained_by_load=True)[0]
    assert hint.code == "traffic_shift" and "longer prompts: 6,000 tokens per request against 2,000" in hint.message
    assert codes({"output_tokens_per_s": 9_000.0}) == ["traffic_shift"]  # longer answers
    assert "traffic_shift" not in codes({"prompt_tokens_per_s": 24_000.0})  # 1.2x
    assert "traffic_shift" not in codes({"prompt_tokens_per_s": 8_000.0})  # shorter: not a shift to longer


def test_queueing_only_when_load_explains_the_rise() -> None:
    surge = {key: value * 3 for key, value in USUAL.items() if key != "cache_hit_rate"}
    assert codes(surge, explained=True) == ["queueing"]
    assert codes(surge, explained=False) == []


def test_a_young_baseline_with_unknown_figures_raises_nothing() -> None:
    fresh = Baseline()
    assert latency_hints(USUAL, fresh, explained_by_load=False) == []
    assert math.isnan(fresh.last_window_start)


def window(**figures: float) -> WindowStats:
    return WindowStats("model=m", 0.0, 10.0, requests=1000, **figures)


@pytest.mark.parametrize(
    ("signal", "code"),
    [
        (Signal.ITL, "decode_slowdown"),
        (Signal.THROUGHPUT, "decode_slowdown"),
        (Signal.PREFILL_TIME, "prefill_bound"),
        (Signal.LENGTH_TRUNCATION, "output_truncated"),
        (Signal.REASONING_LEAK, "reasoning_marker_in_content"),
        (Signal.ERROR_RATE, "error_burst"),
        (Signal.CACHE_HIT_RATE, "prefix_cache_ineffective"),
        (Signal.KV_CACHE_USAGE, "kv_cache_pressure"),
        (Signal.WAITING_REQUESTS, "queue_building"),
        (Signal.PREEMPTIONS, "kv_cache_exhausted"),
    ],
)
def test_each_signal_names_its_own_cause(signal: Signal, code: str) -> None:
    hints = signal_hints(signal, window(errors=30, reasoning_leaks=12), observed=0.9, expected=0.3)
    assert [hint.code for hint in hints] == [code]


def test_the_latency_signals_take_their_hints_from_the_load_not_from_signal_hints() -> None:
    assert signal_hints(Signal.TTFT, window(), 2.0, 1.0) == []


def event_with(hint: Hint, evidence: list[dict[str, Any]]) -> AnomalyEvent:
    return AnomalyEvent(
        id="e", fingerprint="f", status=Status.FIRING, signal=Signal.LENGTH_TRUNCATION, segment={"model": "m"},
        window_start=0.0, window_end=10.0, observed=0.05, expected=0.001, score=6.0, severity=Severity.WARNING,
        load={}, explained_by_load=False, hints=[hint], evidence=evidence, summary=f"cut; {hint.message}.",
    )  # fmt: skip


def test_output_truncated_names_the_limits_of_the_cut_requests_only() -> None:
    hint = Hint(code="output_truncated", message="4 answers ended at the length limit")
    evidence = [
        {"sample": "faulty", "finish_reason": "length", "max_tokens": 1000},
        {"sample": "faulty", "finish_reason": "length", "max_tokens": 512},
        {"sample": "uniform", "finish_reason": "stop", "max_tokens": 4096},  # not cut: not the limit
        {"sample": "baseline", "finish_reason": "length", "max_tokens": 8192},  # another window
    ]
    event = event_with(hint, evidence)
    event = mention_max_tokens(event)
    assert event.hints[0].message.endswith("(max_tokens of the requests cut: 512, 1,000)")
    assert event.hints[0].message in event.summary
    quiet = event_with(hint, [{"sample": "uniform", "finish_reason": "stop", "max_tokens": 4096}])
    quiet = mention_max_tokens(quiet)
    assert quiet.hints[0] == hint


def test_reasoning_marker_in_content_names_the_engine_versions_that_leaked() -> None:
    hint = Hint(code="reasoning_marker_in_content", message="3 answers contain the reasoning end marker")
    evidence = [
        {"sample": "faulty", "engine": "vllm", "engine_version": "0.11.0"},
        {"sample": "faulty", "engine": "vllm", "engine_version": "0.11.0"},
        {"sample": "uniform", "engine": "sglang", "engine_version": "0.5.2"},  # did not leak
    ]
    event = event_with(hint, evidence)
    event = mention_engine_versions(event)
    assert event.hints[0].message.endswith("(the leaking answers shown were served by vllm 0.11.0)")
    unknown = event_with(hint, [{"sample": "faulty"}])
    unknown = mention_engine_versions(unknown)
    assert unknown.hints[0] == hint


def engine_window(i: int, usage: float, hit: float, waiting: float) -> EngineWindow:
    return EngineWindow("gpu-1:8000|qwen", {"model": "qwen", "instance": "gpu-1:8000"}, 10.0 * i, 10.0 * i + 10,
                        100.0, 20_000.0, 3_000.0, 8.0, waiting, usage, hit, 0)  # fmt: skip


@pytest.mark.parametrize(
    ("usage", "hit", "waiting", "raised"),
    [(0.2, 0.93, 6.0, True), (0.9, 0.93, 6.0, False), (0.2, 0.4, 6.0, False), (0.2, 0.93, 0.0, False)],
)
def test_capacity_headroom_needs_a_queue_a_mostly_empty_kv_cache_and_a_working_prefix_cache(
    usage: float, hit: float, waiting: float, raised: bool
) -> None:
    watch = HeadroomWatch(windows=3)
    events = [e for i in range(4) if (e := watch.observe(engine_window(i, usage, hit, waiting))) is not None]
    assert bool(events) is raised
    assert all(e.hints[0].code == "capacity_headroom" and not e.pages for e in events)


def test_every_hint_raised_anywhere_is_documented() -> None:
    from servewatch.pipeline.dev.scenarios import BY_NAME, run_scenario

    raised = {hint.code for name in ("cache_off", "truncation") for e in run_scenario(BY_NAME[name]).events
              for hint in e.hints}  # fmt: skip
    assert raised and raised <= HINT_CODES.keys()


# -- capacity, queue, drift, and a cause for every latency event --------------------------
def codes_for(load: dict[str, float], *, signal: Signal = Signal.TTFT, cause: str | None = None,
              explained: bool = False, queue_usual: float = 0.02) -> list[str]:  # fmt: skip
    baseline = usual()
    baseline.queue_s = queue_usual
    hints = latency_hints({**USUAL, **load}, baseline, explained_by_load=explained, signal=signal, cause=cause)
    return [hint.code for hint in hints]


def test_capacity_saturated_when_the_engines_serve_flat_out_during_a_surge() -> None:
    surge = {"arrivals_vs_usual": 2.4, "model_requests_per_s": 24.0, "capacity_requests_per_s": 24.5}
    assert codes_for(surge, cause="saturated", explained=True)[0] == "capacity_saturated"
    assert "capacity_saturated" not in codes_for(surge)  # not saturated: not this


def test_capacity_lost_when_the_engines_serve_less_than_they_have_and_requests_queue() -> None:
    lost = {"served_vs_capacity": 0.5, "model_requests_per_s": 5.0, "capacity_requests_per_s": 10.0,
            "arrivals_vs_usual": 1.0, "queue_s": 2.0}  # fmt: skip
    assert codes_for(lost)[:2] == ["capacity_lost", "queue_building"]
    assert codes_for({**lost, "served_vs_capacity": 0.95}) == ["queue_building"]  # flat out: the queue only
    assert codes_for(lost, signal=Signal.ITL) == []  # decode does not wait in the queue
    assert "capacity_lost" not in codes_for(lost, explained=True)  # a queue load explains is no fault


def test_capacity_lost_when_requests_queue_while_fewer_slots_than_ever_are_busy() -> None:
    # Half the slots gone at 60 % of the old load: the engines still serve what arrives (no
    # fall in throughput to see), yet a queue forms with only half the usual slots busy.
    lost_slots = {"served_vs_capacity": 0.8, "running_vs_most": 0.53, "arrivals_vs_usual": 0.9, "queue_s": 1.9}
    baseline = usual()
    baseline.queue_s = 0.02
    hints = latency_hints({**USUAL, **lost_slots}, baseline, explained_by_load=False, signal=Signal.QUEUE_TIME)
    assert hints[0].code == "capacity_lost" and "53% of the slots" in hints[0].message
    assert codes_for({**lost_slots, "running_vs_most": 0.95}) == ["queue_building"]  # every slot busy: load
    assert "capacity_lost" not in codes_for({**lost_slots, "queue_s": 0.0})  # no queue: idle slots are no loss


def test_a_low_hit_rate_beside_a_queue_that_makes_the_rise_does_not_lead() -> None:
    baseline = usual()
    baseline.prefill_s_per_1k_tokens, baseline.queue_s = 0.1, 0.01
    # One window's hit rate at a third of usual, prefill per request as usual, a queue of 2 s.
    dip = {**USUAL, "cache_hit_rate": 0.25, "uncached_prompt_tokens_per_s": 4_400.0, "queue_s": 2.0,
           "prefill_tokens_per_s_per_request": 10_000.0, "running_vs_most": 0.5}  # fmt: skip
    ranked = [h.code for h in latency_hints(dip, baseline, explained_by_load=False, signal=Signal.TTFT)]
    assert ranked[0] == "capacity_lost" and "prefix_cache_ineffective" in ranked
    # The cache that serves less and the prefill that grew with it: the cache leads.
    grew = {**dip, "uncached_prompt_tokens_per_s": 19_000.0, "queue_s": 0.01, "running_vs_most": 0.9}
    ranked = [h.code for h in latency_hints(grew, baseline, explained_by_load=False, signal=Signal.TTFT)]
    assert ranked[0] == "prefix_cache_ineffective"


def test_latency_drift_names_the_slow_creep() -> None:
    assert codes_for({}, cause="drift") == ["latency_drift"]


def test_the_prefix_cache_is_named_only_where_prefill_is_involved() -> None:
    collapsed = {"cache_hit_rate": 0.05, "uncached_prompt_tokens_per_s": 19_000.0}
    assert codes_for(collapsed, signal=Signal.PREFILL_PER_TOKEN)[0] == "prefix_cache_ineffective"
    assert "prefix_cache_ineffective" not in codes_for(collapsed, signal=Signal.ITL)
    assert "prefix_cache_ineffective" not in codes_for(collapsed, signal=Signal.QUEUE_TIME)


def test_prefill_slower_per_token_at_the_same_cache_hit_rate_is_prefill_bound() -> None:
    baseline = usual()
    baseline.prefill_s_per_1k_tokens = 0.1
    load = {**USUAL, "prefill_tokens_per_s_per_request": 4_000.0}  # 0.25 s per 1k tokens: 2.5x slower
    hints = latency_hints(load, baseline, explained_by_load=False, signal=Signal.TTFT)
    assert hints[0].code == "prefill_bound" and "2.5x slower per token" in hints[0].message


def test_a_latency_rise_with_nothing_else_moved_still_names_where_to_look() -> None:
    from servewatch.models.explain.hints import fallback_hint

    hint = fallback_hint("TTFT")
    assert hint.code == "latency_rise" and hint.code in HINT_CODES and "serving instances" in hint.message
