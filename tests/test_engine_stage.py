"""Capacity signals from engine metrics: KV-cache usage, waiting requests and
preemptions, judged per engine on its scrape intervals, at the load it serves."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import orjson

from servewatch.models.explain.hints import engine_slots_idle
from servewatch.models.stats.capacity import Capacity
from servewatch.models.windows.engine_window import PERHAPS_FULL, EngineMemory, EngineWindow
from servewatch.pipeline.dev.serving_sim import CHAT_MODEL, SimPhase, TraceWorkload
from servewatch.pipeline.dev.sim_scrapes import run_scrape_scenario
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker.engine_stage import JudgeEngines
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.engine_interval import EngineInterval

T0 = 1_767_225_600.0


def interval(
    i: int, rng: random.Random, load: float = 1.0, instance: str = "gpu-1:8000", **fault: float
) -> dict[str, object]:
    """Ten seconds of one engine: ~10 requests/s x ``load``, KV usage and queue that follow it."""
    finished = 100 * load * rng.uniform(0.9, 1.1)
    usage = fault.get("kv_cache_usage", min(0.45 * load**0.8 * rng.uniform(0.95, 1.05), 1.0))
    return {
        "instance": instance, "model": "qwen", "engine": "vllm", "start": T0 + 10 * i, "end": T0 + 10 * i + 10,
        "prompt_tokens_per_s": 20_000 * load * rng.uniform(0.9, 1.1),
        "generation_tokens_per_s": 3_000 * load * rng.uniform(0.9, 1.1),
        "kv_cache_usage": usage, "running": 24 * load * rng.uniform(0.9, 1.1),
        "waiting": fault.get("waiting", float(rng.randint(0, 2)) * load),
        "preemptions_per_s": fault.get("preemptions_per_s", 0.0),
        "finished": {"stop": finished * 0.97, "length": finished * 0.03},
        "prefix_cache_hit_rate": fault.get("prefix_cache_hit_rate"),
    }  # fmt: skip


def run(phases: list[tuple[int, float, dict[str, float]]], seed: int = 3) -> list[AnomalyEvent]:
    """(intervals, load, fault figures) per phase, through the stage as the worker feeds it."""
    judge, rng, events, i = JudgeEngines(Settings()), random.Random(seed), [], 0
    for count, load, fault in phases:
        for _ in range(count):
            found, letters = judge.receive(orjson.dumps(interval(i, rng, load, **fault)))
            assert not letters
            events += found
            i += 1
    return events


def paging(events: list[AnomalyEvent]) -> set[Signal]:
    return {e.signal for e in events if e.pages}


def test_a_kv_cache_filling_up_at_the_same_load_pages_with_its_queue_and_preemptions() -> None:
    fault = {"kv_cache_usage": 0.99, "waiting": 40.0, "preemptions_per_s": 3.0}
    events = run([(60, 1.0, {}), (8, 1.0, fault)])
    assert paging(events) == {Signal.KV_CACHE_USAGE, Signal.WAITING_REQUESTS, Signal.PREEMPTIONS}
    assert all(e.window_start >= T0 + 600 for e in events if e.pages), "quiet before the fault"
    kv = next(e for e in events if e.signal is Signal.KV_CACHE_USAGE and e.pages)
    assert kv.segment == {"model": "qwen", "instance": "gpu-1:8000", "engine": "vllm"}
    assert kv.hints[0].code == "kv_cache_pressure" and "KV-cache usage" in kv.summary
    preempted = next(e for e in events if e.signal is Signal.PREEMPTIONS and e.pages)
    assert preempted.hints[0].code == "kv_cache_exhausted"


def test_a_fuller_cache_and_longer_queue_under_triple_traffic_are_explained_by_load() -> None:
    events = run([(60, 1.0, {}), (12, 3.0, {})])
    assert not paging(events), [e.summary for e in events if e.pages]


def test_inter_token_latency_is_judged_at_the_batch_running_over_the_interval() -> None:
    """Every decode step in the interval ran at the batch of its moment: the mean of the
    running gauge at the interval's two ends, not one scrape's reading of it (a burst that
    filled the batch and drained before the scrape slowed the tokens it decoded)."""
    memory, rng = EngineMemory(), random.Random(5)
    first, second = interval(0, rng), interval(1, rng)
    first["running"], second["running"] = 30.0, 10.0
    alone = memory.window(EngineInterval.model_validate(first))
    after = memory.window(EngineInterval.model_validate(second))
    assert alone is not None and after is not None
    assert alone.load()["decode_batch"] == 30.0  # no scrape before it: the one reading
    assert after.load()["decode_batch"] == 20.0


def test_an_incident_resolves_when_the_engine_recovers() -> None:
    fault = {"kv_cache_usage": 0.99, "waiting": 40.0, "preemptions_per_s": 3.0}
    events = run([(60, 1.0, {}), (6, 1.0, fault), (12, 1.0, {})])
    kv = [e for e in events if e.signal is Signal.KV_CACHE_USAGE]
    assert kv[0].status is Status.FIRING and kv[-1].status is Status.RESOLVED
    assert len({e.fingerprint for e in kv}) == 1


def test_a_replayed_interval_is_judged_once_and_bad_ones_are_dead_lettered() -> None:
    judge, rng = JudgeEngines(Settings()), random.Random(1)
    raw = orjson.dumps(interval(0, rng))
    judge.receive(raw)
    judge.receive(raw)
    assert (judge.intervals, judge.replayed, judge.bank.windows_judged) == (1, 1, 1)
    events, letters = judge.receive(b'[{"instance": "x"}, 7]', MessageOrigin("servewatch.scrapes", 2, 40))
    assert not events and [letter.record_index for letter in letters] == [0, 1]
    assert letters[0].reason == "validation" and "model" in letters[0].error and letters[0].source_offset == 40
    _, letters = judge.receive(b"{not json")
    assert letters[0].reason == "invalid_json"


def test_an_interval_with_a_server_restart_inside_says_nothing() -> None:
    raw = interval(0, random.Random(2))
    assert EngineWindow.from_interval(EngineInterval.model_validate({**raw, "counter_reset": True})) is None
    judge = JudgeEngines(Settings())
    judge.receive(orjson.dumps({**raw, "counter_reset": True}))
    assert judge.skipped == 1 and judge.bank.windows_judged == 0


def test_requests_queueing_on_a_well_cached_engine_with_an_empty_kv_cache_are_reported_as_headroom() -> None:
    """The third incident of the brief: a high hit rate with low KV usage while requests wait
    is room to raise concurrency without more GPUs; told once, as info, closed when it ends."""
    roomy = {"prefix_cache_hit_rate": 0.93, "kv_cache_usage": 0.25, "waiting": 6.0}
    events = run([(20, 1.0, roomy), (3, 1.0, {**roomy, "kv_cache_usage": 0.8})])
    headroom = [e for e in events if e.hints and e.hints[0].code == "capacity_headroom"]
    assert [e.status for e in headroom] == [Status.FIRING, Status.RESOLVED]
    assert not any(e.pages for e in headroom) and len({e.fingerprint for e in headroom}) == 1
    assert "max_num_seqs" in headroom[0].summary and headroom[0].window_start == T0 + 50
    cold = run([(20, 1.0, {**roomy, "prefix_cache_hit_rate": 0.1})])
    full = run([(20, 1.0, {**roomy, "kv_cache_usage": 0.7})])
    idle = run([(20, 1.0, {**roomy, "waiting": 0.0})])
    for other in (cold, full, idle):  # little from the cache, a cache not empty, or no one waiting
        assert not [e for e in other if e.hints and e.hints[0].code == "capacity_headroom"]


def test_prefix_caching_switched_off_on_an_engine_pages_its_hit_rate_and_says_so() -> None:
    """The first incident of the brief, seen from the engine's own counters and config."""
    judge, rng, events = JudgeEngines(Settings()), random.Random(8), []
    for i in range(68):
        off = i >= 60
        raw = interval(i, rng, prefix_cache_hit_rate=0.01 if off else 0.9 * rng.uniform(0.97, 1.03))
        raw["cache_config"] = {"enable_prefix_caching": "False" if off else "True"}
        events += judge.receive(orjson.dumps(raw))[0]
    hit = [e for e in events if e.signal is Signal.CACHE_HIT_RATE and e.pages]
    assert hit and all(e.window_start >= T0 + 600 for e in hit)
    assert hit[0].hints[0].code == "prefix_cache_disabled" and hit[0].summary.startswith("Prefix-cache hit rate")


def latency(mean_s: float) -> dict[str, float]:
    """One phase's histogram summary over an interval of ~100 requests, log-normal-ish."""
    return {"count": 100.0, "mean_s": mean_s, "p50_s": mean_s * 0.8, "p90_s": mean_s * 1.8, "p99_s": mean_s * 3}


def test_an_engines_own_histograms_page_ttft_and_prefill_when_its_cache_stops_hitting() -> None:
    """A server that logs no requests is judged on its metrics' phases, by model
    and instance, at the load it serves; the hint reads the hit rate the same interval shows."""
    judge, rng, events = JudgeEngines(Settings()), random.Random(11), []
    for i in range(70):
        off = i >= 60
        hit = 0.01 if off else 0.9 * rng.uniform(0.97, 1.03)
        prefill = (2.4 if off else 0.25) * rng.uniform(0.95, 1.05)
        raw = interval(i, rng, prefix_cache_hit_rate=hit)
        raw["latency"] = {"ttft": latency(prefill + 0.05), "prefill_time": latency(prefill),
                          "queue_time": latency(0.05 * rng.uniform(0.9, 1.1)), "itl": latency(0.02)}  # fmt: skip
        raw["cache_config"] = {"enable_prefix_caching": "False" if off else "True"}
        events += judge.receive(orjson.dumps(raw))[0]
    assert paging(events) >= {Signal.TTFT, Signal.PREFILL_TIME, Signal.CACHE_HIT_RATE}
    assert Signal.QUEUE_TIME not in paging(events) and Signal.ITL not in paging(events)
    assert all(e.window_start >= T0 + 600 for e in events if e.pages), "quiet before the fault"
    ttft = next(e for e in events if e.signal is Signal.TTFT and e.pages)
    assert ttft.segment == {"model": "qwen", "instance": "gpu-1:8000", "engine": "vllm"}
    assert ttft.hints[0].code == "prefix_cache_ineffective"
    assert "enable_prefix_caching=False on gpu-1:8000" in ttft.hints[0].message


def test_an_engines_detectors_come_back_from_stored_state() -> None:
    """What the worker stores in its state table: a successor judges the next fault with the
    grown-up baseline (cold, it would stay quiet for its grace windows)."""
    first, rng = JudgeEngines(Settings()), random.Random(4)
    for i in range(60):
        first.receive(orjson.dumps(interval(i, rng)))
    stored = {key: orjson.loads(orjson.dumps(state)) for key, state in first.bank.states_to_save(every_one=True)}
    assert [key for key in stored if not key.startswith("~")] == ["gpu-1:8000|qwen"]  # and its model's figures
    assert {"~pooled|engines|qwen|preemptions", "~template|engines|qwen|capacity"} <= stored.keys()
    second = JudgeEngines(Settings())
    second.bank.restore = stored.get
    fault = {"kv_cache_usage": 0.99, "waiting": 40.0, "preemptions_per_s": 3.0}
    events = [e for i in range(60, 63) for e in second.receive(orjson.dumps(interval(i, rng, **fault)))[0]]
    assert second.bank.restored == 1
    kv = next(e for e in events if e.signal is Signal.KV_CACHE_USAGE and e.pages)
    assert not kv.baseline_young and kv.window_start <= T0 + 610


def test_request_log_events_name_the_engines_that_report_prefix_caching_off() -> None:
    """The brief's first incident across both sources: request logs show the hit rate
    collapse, the engines' cache_config_info says why, and the hint names them."""
    judge, rng = JudgeEngines(Settings()), random.Random(6)
    for instance, enabled in (("gpu-1:8000", "False"), ("gpu-2:8000", "True")):
        raw = interval(0, rng, instance=instance)
        raw["cache_config"] = {"enable_prefix_caching": enabled}
        judge.receive(orjson.dumps(raw))
    message = "prefix-cache hit rate fell to 0% from a usual 55%; check that prefix caching is enabled"
    event = AnomalyEvent(
        id="x", fingerprint="f", status=Status.FIRING, signal=Signal.TTFT, segment={"model": "qwen"},
        window_start=T0, window_end=T0 + 10, observed=8.0, expected=0.9, score=9.0, severity=Severity.CRITICAL,
        load={}, explained_by_load=False, hints=[Hint(code="prefix_cache_ineffective", message=message)],
        summary=f"TTFT p95 for model qwen is 8.00 s against 900 ms expected; {message}.",
    )  # fmt: skip
    other = event.model_copy(update={"segment": {"model": "llama"}, "hints": list(event.hints)})
    event, other = judge.explain([event, other])
    assert event.hints[0].message.endswith("enable_prefix_caching=False on gpu-1:8000")
    assert "enable_prefix_caching=False on gpu-1:8000" in event.summary
    assert other.hints[0].message == message  # no engine of that model said anything


def test_a_fleet_judged_from_its_first_scrape_pages_no_one_for_the_queues_of_its_first_bursts() -> None:
    """In a model's first minutes its engines' capacity is not learned yet (``Capacity``'s
    warm windows): a burst's queue then cannot be "slots lost", having no slots kept before to
    fall short of. Four engines of six serving the bursty Mooncake trace paged capacity_lost or
    latency_rise within 5 minutes of a cold start on each of these seeds when an unknown capacity
    read as 0 % of the slots busy."""
    model = dataclasses.replace(CHAT_MODEL, instances=6, utilisation=0.4)
    for seed in (7, 8, 10):
        workload = TraceWorkload((SimPhase("normal", 480.0, serving_instances=4),), models=(model,), seed=seed)
        run = run_scrape_scenario(workload)
        assert not run.paging_groups, (seed, [g.title for g in run.paging_groups])
        # The bursts did queue: reported, as load.
        if seed == 7:
            assert any(e.hints and e.hints[0].code == "capacity_saturated" for e in run.events)


def test_a_capacity_not_learned_yet_says_nothing_of_slots_or_demand_against_usual() -> None:
    capacity, load = Capacity(), {"model_running": 3.0, "model_requests_per_s": 2.0}
    window = SimpleNamespace(length=10.0, end=T0 + 10, running_measured=True)
    capacity.observe(window, load)
    assert not {"running_vs_most", "served_vs_capacity", "arrivals_vs_usual"} & load.keys()
    assert not engine_slots_idle({**load, "running_measured": 1.0})


def test_a_wait_no_scrape_saw_is_not_taken_for_lost_slots_and_one_every_scrape_sees_is() -> None:
    """A long prompt waits a second or two for KV blocks between two scrapes: the engine
    reports queue time, its gauges never saw anyone waiting, and it ran fewer requests than
    it can. As a wait one scrape saw, that is at least as likely memory as slots that are
    gone (which leave requests waiting scrape after scrape), so it is not said to have idle
    slots; the same engine with requests waiting at every scrape is."""

    def last(waiting: float) -> EngineWindow:
        memory, rng, window = EngineMemory(), random.Random(4), None
        for i in range(30):
            busy = i < 20  # it has run 24 requests; now 10, its KV cache a third full
            record = interval(i, rng, waiting=0.0 if busy else waiting, kv_cache_usage=0.3)
            if not busy:
                record["running"] = 10.0
            window = memory.window(EngineInterval.model_validate(record))
        assert window is not None
        return window

    unseen, seen = last(waiting=0.0), last(waiting=6.0)
    assert unseen.kv_full == PERHAPS_FULL and seen.kv_full == 0.0
    loads = [{**window.load(), "running_vs_most": 10.0 / 24.0} for window in (unseen, seen)]
    assert [engine_slots_idle(load) for load in loads] == [False, True]


def test_a_long_context_waiting_across_scrapes_is_judged_at_the_fullest_scrape_that_saw_it() -> None:
    """A long prompt waits half a minute for KV blocks while decodes free memory a little at
    a time: the first scrape of its queue finds every slot busy, the last a third of them
    free beside a cache not quite full. Its queue time, reported when it finishes, may have
    formed at either, so the engine is not said to have lost slots; an engine whose every
    scrape of its queue found slots and memory to spare is."""

    def last(queued: list[tuple[float, float]]) -> EngineWindow:
        memory, rng, window = EngineMemory(), random.Random(4), None
        for i in range(30 + len(queued)):
            record = interval(i, rng, waiting=0.0)
            if i >= 30:
                record["running"], record["kv_cache_usage"] = queued[i - 30]
                record["waiting"] = 1.0
                record["latency"] = {"e2e": {"count": 8.0, "mean_s": 20.0, "p90_s": 35.0, "p99_s": 40.0}}
            window = memory.window(EngineInterval.model_validate(record))
        assert window is not None
        return window

    memory_wait, slots_lost = last([(26.0, 0.8), (20.0, 0.78), (16.0, 0.72)]), last([(16.0, 0.35)] * 3)
    assert memory_wait.busy == 26.0 and slots_lost.busy == 16.0
    loads = [{**w.load(), "running_vs_most": w.busy / w.most_running} for w in (memory_wait, slots_lost)]
    assert [engine_slots_idle(load) for load in loads] == [False, True]
