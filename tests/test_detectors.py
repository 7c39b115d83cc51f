"""Detector behaviour beyond single windows: level changes, flapping, cold start, state."""

from __future__ import annotations

import json

import orjson

from servewatch.models.detect.bank import DetectorBank
from servewatch.models.detect.detector import DetectorConfig, SegmentDetectors
from servewatch.models.detect.lifecycle import IncidentTracker, Transition
from servewatch.models.stats.rates import BetaBinomialRate
from servewatch.models.windows.window import WindowStats
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.schemas.anomaly import Signal, Status


def batches(workload: Workload) -> list[bytes]:
    return [orjson.dumps(batch) for _, batch in workload.seconds() if batch]


def test_a_lasting_change_is_adopted_once_not_paged_forever() -> None:
    """Decode 1.5x slower for good (say, a new engine version): one incident, then a level change."""
    workload = Workload((Phase("normal", 600), Phase("slower", 1500, decode_slowdown=1.5)), seed=4)
    events = list(Replay().run(batches(workload)))
    itl = [e for e in events if e.signal is Signal.ITL and e.segment["route"] == "chat"]
    adopted = [e for e in itl if e.hints and e.hints[0].code == "level_shift"]
    assert adopted, "the new level is adopted after adopt_after windows"
    assert all(e.status is Status.RESOLVED for e in adopted)
    for adoption in adopted:  # after its adoption, a segment's new level is its normal
        segment = adoption.segment
        later = [e for e in itl if e.segment == segment and e.pages and e.window_start > adoption.window_end]
        assert not later, f"{segment} paged again after adopting its new level"


def test_flapping_reopens_the_same_incident_and_takes_longer_to_resolve() -> None:
    tracker = IncidentTracker(fire_after=1, fire_within=1, resolve_after=2, reopen_within=10)
    transitions = []
    pattern = [1, 0, 0, 1, 0, 0, 0, 0]  # fires, resolves, fires again two windows later
    for w, bad in enumerate(pattern):
        transitions.append((w, tracker.step(bool(bad), window_start=float(w), severity="warning")))
    fired = [w for w, t in transitions if t is Transition.FIRING]
    resolved = [w for w, t in transitions if t is Transition.RESOLVED]
    assert fired == [0, 3] and tracker.incident_start == 0.0, "the reopened incident keeps its start"
    assert resolved == [2, 7], "a reopened incident needs twice the normal windows to resolve"


def test_a_new_segment_borrows_its_models_error_rate() -> None:
    pooled = {("m", Signal.ERROR_RATE): BetaBinomialRate(grace_windows=0)}
    for _ in range(50):
        pooled[("m", Signal.ERROR_RATE)].learn_one({"trials": 1000}, 20)  # this model fails 2 %
    segment = SegmentDetectors("model=m|route=new")
    from servewatch.models.detect.signals import BY_SIGNAL

    model = segment.model(BY_SIGNAL[Signal.ERROR_RATE], pooled[("m", Signal.ERROR_RATE)])
    assert abs(model.expected_rate - 0.02) < 0.002


def test_state_round_trips_through_json_and_changes_nothing() -> None:
    workload = Workload((Phase("normal", 400), Phase("cache_off", 200, prefix_caching=False)), seed=6)
    messages = batches(workload)
    half = len(messages) // 2
    straight = Replay()
    expected = [e.model_dump() for e in straight.run(messages)]

    restarted = Replay()
    before = [e.model_dump() for offset, raw in enumerate(messages[:half]) for e in restarted.feed(raw, offset)]
    bank = restarted.stage_two.bank
    saved = {key: json.dumps(d.state(), allow_nan=False) for key, d in bank.detectors.items()}
    fresh = DetectorBank(bank.config, pooled=bank.pooled)
    for key, text in saved.items():
        fresh.detectors[key] = SegmentDetectors(key, bank.config)
        fresh.detectors[key].load_state(json.loads(text))
    restarted.stage_two.bank = fresh
    after = [
        e.model_dump() for offset, raw in enumerate(messages[half:], start=half) for e in restarted.feed(raw, offset)
    ]
    after += [e.model_dump() for e in restarted.finish()]
    assert before + after == expected[: len(before) + len(after)] and after


def test_state_of_another_version_is_refused() -> None:
    segment = SegmentDetectors("model=m", DetectorConfig())
    state = segment.state()
    state["v"] = 999
    try:
        segment.load_state(state)
    except ValueError as exc:
        assert "version" in str(exc)
    else:
        raise AssertionError("an unknown state version must not load silently")


def test_shared_prefixes_with_a_near_zero_hit_rate_page_even_without_history() -> None:
    """Prefix caching never on: no usual hit rate to fall from, yet every request reuses a prefix."""
    from servewatch.pipeline.dev.scenarios import Scenario, run_scenario
    from servewatch.pipeline.dev.simulator import Phase

    never_on = Scenario("never_on", Phase("cache_off", 300, prefix_caching=False), frozenset(), warmup_s=0.0)
    result = run_scenario(never_on)
    cache = [e for e in result.pages if e.signal is Signal.CACHE_HIT_RATE]
    assert cache and cache[0].observed < 0.01 and cache[0].expected >= 0.05
    assert cache[0].hints[0].code == "prefix_cache_ineffective"


def test_one_bad_request_in_three_does_not_page_but_thirty_in_a_thousand_do() -> None:
    model = BetaBinomialRate()
    for _ in range(60):
        model.learn_one({"trials": 1000}, 1)  # a 0.1 % baseline
    assert model.score_one({"trials": 3}, 1) < 4 <= model.score_one({"trials": 1000}, 30)


def test_a_new_latency_segment_borrows_its_models_response_to_load() -> None:
    """A new segment of a known model is judged after two windows of its own, at its own level."""
    import math
    import random

    from servewatch.models.stats.latency import LoadConditionedLatency

    rng = random.Random(2)
    known, new = LoadConditionedLatency(), LoadConditionedLatency()
    for _ in range(60):
        x = {"model_requests_per_s": rng.uniform(9, 11), "model_prompt_tokens_per_s": 1e4}
        known.learn_one(x, 0.4 * math.exp(rng.gauss(0, 0.05)))
    flat = {"model_requests_per_s": 10.0, "model_prompt_tokens_per_s": 1e4}
    new.learn_one(flat, 2.0)  # a slower segment (long prompts): its own level
    new.borrow(known)
    assert not new.warm
    new.learn_one(flat, 2.1)
    assert new.warm and 1.6 < new.predict_one(flat).expected < 2.5
    assert new.score_one(flat, 20.0) > 6  # 10x its own level: pages already
    assert new.score_one(flat, 2.2) < 2


def test_forgotten_segments_come_back_from_their_stored_state() -> None:
    """A partition handed away and back: the segment is read from storage again, not kept stale."""
    workload = Workload((Phase("normal", 200),), seed=9)
    engine = Replay()
    list(engine.run(batches(workload)))
    bank = engine.stage_two.bank
    stored = {key: json.loads(json.dumps(state)) for key, state in bank.states_to_save()}
    key = next(iter(stored))
    assert bank.forget(lambda k: k == key) == 1 and key not in bank.detectors
    bank.restore = stored.get
    assert bank.segment(key).state() == stored[key] and bank.restored == 1


def test_a_restarted_bank_meets_each_model_with_the_templates_and_pooled_rates_it_had() -> None:
    """What a new segment borrows (its model's best-known latency models and capacity, and its
    pooled rates) comes back from storage with the model's first window after a restart."""
    first = Replay()
    list(first.run(batches(Workload((Phase("normal", 200),), seed=9))))
    bank = first.stage_two.bank
    stored = {key: orjson.loads(orjson.dumps(state)) for key, state in bank.states_to_save(every_one=True)}
    restarted = DetectorBank(bank.config, restore=stored.get)
    for key in bank.detectors:  # a window each segment judged long ago: skipped, but its model met
        restarted.observe(WindowStats(key, 0.0, 10.0, requests=0))
    assert restarted.windows_judged == 0 and restarted.windows_skipped == len(bank.detectors)
    for kept in ("templates", "pooled"):
        before, after = getattr(bank, kept), getattr(restarted, kept)
        assert before and {k: v.state() for k, v in after.items()} == {k: v.state() for k, v in before.items()}


def test_states_are_stored_every_few_windows_with_segments_taking_turns() -> None:
    """Each store is a changelog message: 120 segments born together, stored every 6 windows,
    are stored ~20 per window rather than 120 every sixth one; every one on hand-over."""
    bank = DetectorBank(save_every=6)
    keys = [f"model=m|route=r{i}" for i in range(120)]
    per_window, times_stored = [], dict.fromkeys(keys, 0)
    for _ in range(12):
        for key in keys:
            bank.segment(key).unsaved += 1  # what judging a window does
        saved = bank.states_to_save()
        per_window.append(len(saved))
        for key, _ in saved:
            times_stored[key] += 1
    assert set(times_stored.values()) <= {1, 2} and sum(per_window) >= 120  # each once or twice in 12
    assert max(per_window) <= 45, f"stores bunched up: {per_window}"
    assert len(bank.states_to_save(every_one=True)) == 120


def test_a_segment_whose_incident_moves_is_due_for_storage_at_once() -> None:
    workload = Workload((Phase("normal", 300), Phase("cache_off", 120, prefix_caching=False)), seed=12)
    engine = Replay()
    engine.stage_two.bank.save_every = 10_000  # the cadence alone would store nothing
    events = list(engine.run(batches(workload)))
    assert events
    bank = engine.stage_two.bank
    due = [dict(label.split("=", 1) for label in key.split("|")) for key, _ in bank.states_to_save()]
    assert due and all(event.segment in due for event in events)


def test_an_event_from_a_young_segment_says_so_after_its_cause() -> None:
    # 25 windows of history: young (below 30), yet enough that its noise is known (a younger
    # segment is judged with heavier tails, see models.stats.latency, and pages only bigger faults)
    workload = Workload((Phase("normal", 250), Phase("cache_off", 120, prefix_caching=False)), seed=14)
    pages = [e for e in Replay().run(batches(workload)) if e.pages and e.signal is Signal.TTFT]
    assert pages and all(e.baseline_young for e in pages)
    codes = [h.code for h in pages[0].hints]
    assert codes[0] == "prefix_cache_ineffective" and codes[-1] == "new_segment"
