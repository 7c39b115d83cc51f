"""The trace-driven fleet simulation (``pipeline/dev/serving_sim.py``) and the real-run replays
(``pipeline/dev/real_runs.py``): deterministic, physically consistent, faults where they are put."""

from __future__ import annotations

import dataclasses
import inspect
import statistics
from collections import defaultdict
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from servewatch.pipeline.dev import real_runs, serving_sim
from servewatch.pipeline.dev.real_runs import HEALTHY_S, RUN_NAMES, Injection, RealRunWorkload, run_columns
from servewatch.pipeline.dev.serving_sim import (
    CHAT_MODEL,
    CODE_MODEL,
    DEFAULT_FLEET,
    LOW_VOLUME_MODEL,
    PAGER_CHAT_MODEL,
    PAGER_FLEET,
    TRACES,
    SimPhase,
    TraceWorkload,
    load_trace,
    read_sample,
    scenario_phases,
)
from servewatch.pipeline.dev.simulator import EPOCH
from servewatch.pipeline.dev.traffic_cycles import DAY_S, cycle_phases, diurnal_multiplier
from servewatch.schemas.request_log import RequestLog


def _arrival(record: dict[str, Any]) -> float:
    return float(record["timestamp"] - record["e2e_s"] - EPOCH)


def _in(records: list[dict[str, Any]], first_s: float, last_s: float, model: str | None = None) -> list[dict[str, Any]]:
    """Records that arrived in [first_s, last_s) (seconds from the start), of ``model`` if given."""
    return [r for r in records if first_s <= _arrival(r) < last_s and (model is None or r["model"] == model)]


@pytest.fixture(scope="module")
def surge() -> TraceWorkload:
    """The chat model: 5 normal minutes, then 5 at 2.5x traffic (more than its slots can serve)."""
    return TraceWorkload((SimPhase("normal", 300), SimPhase("surge", 300, traffic=2.5)), models=(CHAT_MODEL,), seed=3)


def test_samples_are_bundled_with_the_package() -> None:
    folder = resources.files("servewatch.pipeline.dev") / "trace_samples"
    assert Path(str(folder)).resolve() == Path(serving_sim.__file__).resolve().parent / "trace_samples"
    _, columns = serving_sim.read_sample("mooncake_conversation.csv.gz")
    assert len(columns["t_s"]) == 12_031
    # The cold cache's first five minutes are left out of the trace that is played.
    trace = load_trace("mooncake_conversation")
    assert 11_000 < len(trace.t_s) < 12_031 and trace.t_s[0] == 0.0
    for name in TRACES:
        trace = load_trace(name)
        assert "CC-BY-4.0" in trace.source or "Apache-2.0" in trace.source
        assert (trace.prompt_tokens > 0).all() and (trace.output_tokens > 0).all()
        assert (trace.t_s[1:] >= trace.t_s[:-1]).all()
    source, columns = read_sample("real_runs.csv.gz")
    assert "kv-cache-tester" in source and set(columns["run"]) == set(RUN_NAMES)
    # Nothing reads the shared data folder at run time: only bench/derive_trace_samples.py does.
    for module in (serving_sim, real_runs):
        assert "/work/shared" not in inspect.getsource(module)


def test_same_seed_same_records_other_seed_other_records() -> None:
    phases = scenario_phases(SimPhase("cache_off", 60, prefix_caching=False), warmup_s=120, recovery_s=30)
    first = list(TraceWorkload(phases, seed=11).records())
    again = list(TraceWorkload(phases, seed=11).records())
    other = list(TraceWorkload(phases, seed=12).records())
    assert first == again and len(first) > 500
    assert first != other


def test_records_validate_and_stream_in_finish_order() -> None:
    phases = (
        SimPhase("normal", 60),
        SimPhase("faults", 60, max_tokens=300, error_rate=0.05, leak_rate=0.1, capacity_factor=0.5),
    )
    workload = TraceWorkload(phases, models=(*DEFAULT_FLEET, LOW_VOLUME_MODEL), log_content=True, seed=5)
    batches = list(workload.seconds())
    streamed = [r for _, batch in batches for r in batch]
    assert streamed == list(workload.records())
    for now, batch in batches:
        assert all(now - 1 <= r["timestamp"] < now for r in batch)
    assert batches[-1][0] >= streamed[-1]["timestamp"]  # the drain gives every request
    for record in streamed:
        RequestLog.model_validate(record)
    assert len({r["request_id"] for r in streamed}) == len(streamed)
    faulty = _in(streamed, 60, 120)
    reasons = {r["finish_reason"] for r in faulty}
    assert {"length", "error", "stop"} <= reasons
    assert any("</think>" in r["content"] for r in faulty if "content" in r)
    assert not any("</think>" in r.get("content", "") for r in _in(streamed, 0, 60))


def test_slots_are_never_exceeded_and_each_engine_serves_in_arrival_order(surge: TraceWorkload) -> None:
    by_instance: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    for r in surge.records():
        arrival = _arrival(r)
        order = int(r["request_id"].rsplit("-", 1)[1])  # ids number requests by arrival (ties included)
        by_instance[r["instance"]].append((order, arrival + r["queue_s"], arrival + r["e2e_s"]))
    assert len(by_instance) == CHAT_MODEL.instances
    for spans in by_instance.values():
        # Rounded times: a request ending within 1 ms of another's start has freed its slot.
        events = sorted([(b, 1) for _, b, _ in spans] + [(e - 1e-3, -1) for _, _, e in spans])
        running = peak = 0
        for _, step in events:
            running += step
            peak = max(peak, running)
        assert peak <= CHAT_MODEL.max_num_seqs
        assert peak == CHAT_MODEL.max_num_seqs  # the surge fills them
        spans.sort()
        starts = [b for _, b, _ in spans]
        assert all(later >= earlier - 1e-3 for earlier, later in pairwise(starts))


def test_a_surge_beyond_the_slots_builds_a_queue(surge: TraceWorkload) -> None:
    records = list(surge.records())
    normal, surged = _in(records, 60, 300), _in(records, 360, 600)
    assert 2.0 < len(surged) / len(normal) < 3.2  # the trace plays 2.5x faster (its own rate varies)
    # Exactly: 300 s at 1x and 300 s at 2.5x play as much of the trace as 1,050 s at 1x.
    flat = TraceWorkload((SimPhase("normal", 1050),), models=(CHAT_MODEL,), seed=3)
    assert len(records) == len(list(flat.records()))
    normal_queue = statistics.median(r["queue_s"] for r in normal)
    surge_queue = statistics.median(r["queue_s"] for r in surged)
    assert surge_queue > 5 * normal_queue and surge_queue > 1.0
    occupancy = surge.occupancy(CHAT_MODEL.name)
    assert 0.45 < occupancy.share(60, 300) < 0.75
    assert occupancy.share(400, 600) > 0.95 and occupancy.saturated_share(400, 600) > 0.9
    assert occupancy.saturated_share(60, 300) < 0.2


def test_caching_off_raises_uncached_tokens_and_ttft() -> None:
    workload = TraceWorkload(scenario_phases(SimPhase("cache_off", 180, prefix_caching=False), 180, 0), seed=9)
    records = list(workload.records())
    for model in (m.name for m in DEFAULT_FLEET):
        # (margins: an arrival is recomputed from rounded times, and one that waits past the
        # phase's end starts service with caching on again)
        on, off = _in(records, 0, 180, model), _in(records, 181, 330, model)
        assert sum(r["cached_tokens"] for r in on) / sum(r["prompt_tokens"] for r in on) > 0.15
        assert sum(r["cached_tokens"] for r in off) == 0
        assert statistics.median(r["prefill_s"] for r in off) > 1.2 * statistics.median(r["prefill_s"] for r in on)
    # The chat model's TTFT is mostly prefill; the code model's, in its bursts, mostly queueing.
    on, off = _in(records, 0, 180, CHAT_MODEL.name), _in(records, 180, 360, CHAT_MODEL.name)
    assert statistics.median(r["ttft_s"] for r in off) > 2 * statistics.median(r["ttft_s"] for r in on)
    # Prefix hashes are still sent: the prompts share their prefixes whether the cache serves them or not.
    assert all(r["prefix_hash"] for r in records)
    chat = [r for r in records if r["model"] == CHAT_MODEL.name]
    assert len({r["prefix_hash"] for r in chat}) == 1  # Mooncake: every prompt opens with block 0


def test_a_restarted_engines_cache_fills_again_as_it_prefills_each_prefix() -> None:
    """A restarted engine starts with an empty prefix cache: the first request of each prefix
    it serves since is prefilled whole, the later ones hit as on an engine that did not restart."""
    model = dataclasses.replace(CHAT_MODEL, instances=2)
    phases = (SimPhase("normal", 120), SimPhase("restarted", 120, cold_instances=(1,)))
    records = list(TraceWorkload(phases, models=(model,), seed=5).records())

    def served_by(host: str) -> list[dict[str, Any]]:
        """The host's requests that began service in the second phase."""
        return [r for r in records if r["instance"] == host and 120 <= _arrival(r) + r["queue_s"] < 240]

    restarted, warm = served_by("10.0.0.11:8000"), served_by("10.0.0.10:8000")
    # Mooncake's prompts all open with one prefix: one request prefilled it whole, then it hit.
    assert [r["cached_tokens"] for r in restarted].count(0) == 1
    assert [r["cached_tokens"] for r in warm].count(0) == 0 and len(restarted) > 10


@pytest.mark.parametrize("contention", [0.0, CHAT_MODEL.prefill_contention])
def test_prefill_slowdown_hits_only_prompts_above_its_threshold(contention: float) -> None:
    chat = dataclasses.replace(CHAT_MODEL, prefill_contention=contention)
    phases = (SimPhase("slow", 300, prefill_slowdown=3.0, slow_prompt_tokens=16_000),)
    slow = {r["request_id"]: r for r in TraceWorkload(phases, models=(chat,), seed=4).records()}
    plain = {r["request_id"]: r for r in TraceWorkload((SimPhase("x", 300),), models=(chat,), seed=4).records()}
    assert slow.keys() == plain.keys()
    long = [slow[k]["prefill_s"] / plain[k]["prefill_s"] for k in slow if slow[k]["prompt_tokens"] > 16_000]
    short = [slow[k]["prefill_s"] / plain[k]["prefill_s"] for k in slow if slow[k]["prompt_tokens"] <= 16_000]
    assert len(long) > 100 and len(short) > 300
    assert 2.7 < statistics.median(long) < 3.3
    if contention == 0.0:  # then a request's prefill depends on nothing but its own prompt and the phase
        assert all(abs(ratio - 1.0) < 1e-3 for ratio in short)
    else:  # only through a little more contention from the slower long prefills
        assert 0.97 < statistics.median(short) < 1.1


def test_a_faults_first_log_is_the_first_request_it_changed() -> None:
    """``first_faulty_log_s``: the first request whose service or answer the injected phase
    changed ended then, not merely the first that ran in it (requests are logged at their end)."""
    chat = dataclasses.replace(CHAT_MODEL, prefill_contention=0.0)
    phases = (SimPhase("normal", 120), SimPhase("slow", 300, prefill_slowdown=3.0, slow_prompt_tokens=16_000))
    workload = TraceWorkload(phases, models=(chat,), seed=4)
    onset = workload.first_faulty_log_s
    assert onset is not None
    records = list(workload.records())
    started = [r for r in records if _arrival(r) + r["queue_s"] >= 120]  # a fault hits requests starting service
    long = [r for r in started if r["prompt_tokens"] > 16_000]
    touched = [r for r in records if _arrival(r) >= 120]
    # The first long prompt served in the phase, not the first request of any length.
    assert onset == pytest.approx(min(r["timestamp"] for r in long), abs=1e-3)
    assert onset > min(r["timestamp"] for r in touched)
    # A phase that changes nothing touched nobody.
    unchanged = TraceWorkload((SimPhase("normal", 120), SimPhase("same", 300)), models=(chat,), seed=4)
    assert unchanged.first_faulty_log_s is None


def test_the_low_volume_model_has_small_windows() -> None:
    workload = TraceWorkload((SimPhase("normal", 600),), models=(LOW_VOLUME_MODEL,), seed=2)
    counts: dict[int, int] = defaultdict(int)
    for r in workload.records():
        if r["prompt_tokens"] < 4096 and r["completion_tokens"] < 1000 and r["timestamp"] < EPOCH + 600:
            counts[int((r["timestamp"] - EPOCH) // 10)] += 1
    assert 8 <= statistics.median(counts.values()) <= 35


def test_real_runs_replay_healthy_and_validate() -> None:
    for run in RUN_NAMES:
        workload = RealRunWorkload(run, healthy_only=True)
        records = list(workload.records())
        first, last = HEALTHY_S[run]
        assert len(records) == sum(1 for t in run_columns(run)["launch_s"] if first <= t < last)
        assert workload.duration_s <= last
        for record in records[::50]:
            RequestLog.model_validate(record)
        assert {r["finish_reason"] for r in records} == {"stop"}
        assert sum(len(batch) for _, batch in workload.seconds()) == len(records)


def test_real_run_injection_changes_only_its_stretch() -> None:
    run = "dram_only"
    plain = {r["request_id"]: r for r in RealRunWorkload(run, healthy_only=True).records()}
    injection = Injection.middle_third(run, ttft_factor=4.0, drop_cache=True)
    faulty = {r["request_id"]: r for r in RealRunWorkload(run, injection, healthy_only=True).records()}
    assert plain.keys() == faulty.keys()
    launch = dict(zip((f"{run}-{i}" for i in range(10_000)), run_columns(run)["launch_s"], strict=False))
    inside = [k for k in plain if injection.start_s <= launch[k] < injection.end_s]
    assert 700 < len(inside) < 1000
    for key, before in plain.items():
        after = faulty[key]
        if key not in inside:
            assert after == before
            continue
        assert after["ttft_s"] == pytest.approx(4 * before["ttft_s"], abs=1e-4)
        assert after["e2e_s"] == pytest.approx(before["e2e_s"] + 3 * before["ttft_s"], abs=1e-4)
        assert after["timestamp"] == pytest.approx(before["timestamp"] + 3 * before["ttft_s"], abs=1e-3)
        assert after["cached_tokens"] == 0 < before["cached_tokens"]
        RequestLog.model_validate(after)


def test_real_run_truncation_cuts_a_share_of_the_stretch() -> None:
    run = "gds_dram"
    injection = Injection.middle_third(run, truncate_share=0.05, max_tokens=1)
    records = list(RealRunWorkload(run, injection).records())
    launch = run_columns(run)["launch_s"]
    cut = [r for r in records if r["finish_reason"] == "length"]
    inside = sum(1 for t in launch if injection.start_s <= t < injection.end_s)
    assert 0.03 < len(cut) / inside < 0.07
    assert all(injection.start_s <= launch[int(r["request_id"].rsplit("-", 1)[1])] < injection.end_s for r in cut)
    assert all(r["completion_tokens"] == r["max_tokens"] == 1 for r in cut)


# -- KV budget, background errors and cut answers, daily cycles ---------------------------


def _held_peak(records: list[dict[str, Any]], instance: str) -> int:
    """The most KV tokens (prompt + answer) the engine's running requests held at once."""
    spans = []
    for r in records:
        if r["instance"] == instance:
            begin = _arrival(r) + r["queue_s"]
            spans += [(begin, r["prompt_tokens"] + r["completion_tokens"]),
                      (_arrival(r) + r["e2e_s"] - 1e-3, -(r["prompt_tokens"] + r["completion_tokens"]))]  # fmt: skip
    held = peak = 0
    for _, tokens in sorted(spans):
        held += tokens
        peak = max(peak, held)
    return peak


def test_a_kv_budget_makes_long_prompts_wait_with_slots_free() -> None:
    """The same arrivals through engines that also hold prompt + answer tokens: long prompts
    wait for room while slots are free, the budget is never exceeded, short prompts barely care."""
    phases = (SimPhase("normal", 900),)
    tight = dataclasses.replace(CHAT_MODEL, kv_tokens=240_000)
    plain = {r["request_id"]: r for r in TraceWorkload(phases, models=(CHAT_MODEL,), seed=6).records()}
    workload = TraceWorkload(phases, models=(tight,), seed=6)
    budgeted = {r["request_id"]: r for r in workload.records()}
    assert plain.keys() == budgeted.keys()  # the same requests: the budget changes only when they run

    def mean_queue(records: dict[str, dict[str, Any]], long: bool) -> float:
        return statistics.mean(r["queue_s"] for r in records.values() if (r["prompt_tokens"] > 32_768) == long)

    assert mean_queue(budgeted, long=True) > 3 * mean_queue(plain, long=True) + 0.1
    assert mean_queue(budgeted, long=True) > mean_queue(budgeted, long=False)
    records = list(budgeted.values())
    for instance in {r["instance"] for r in records}:
        assert _held_peak(records, instance) <= tight.kv_tokens
    occupancy = workload.occupancy(tight.name)
    assert occupancy.kv_tokens == 4 * 240_000 and 0.2 < occupancy.kv_share() < 0.9
    free_slots_waiting = (occupancy.waiting > 0) & (occupancy.busy < occupancy.slots - 4)
    assert free_slots_waiting.mean() > 0.01  # waits that no slot count explains


def test_the_pager_fleet_is_calibrated_like_the_plain_one() -> None:
    """With their KV budgets, the pager fleet's engines still run at ~60 % of the slots (chat),
    waits stay occasional, and the KV budget binds now and then."""
    workload = TraceWorkload((SimPhase("normal", 1800),), models=(PAGER_CHAT_MODEL,), seed=7)
    list(workload.records())
    occupancy = workload.occupancy(PAGER_CHAT_MODEL.name)
    assert 0.5 < occupancy.share() < 0.7
    assert 0.01 < occupancy.saturated_share() < 0.2
    assert 0.3 < occupancy.kv_share() < 0.6


def test_background_errors_and_cut_answers_appear_at_their_share() -> None:
    spec = dataclasses.replace(CHAT_MODEL, error_rate=0.01, truncation_rate=0.02)
    phases = (SimPhase("normal", 1200),)
    records = list(TraceWorkload(phases, models=(spec,), seed=8).records())
    clean = {r["request_id"]: r for r in TraceWorkload(phases, models=(CHAT_MODEL,), seed=8).records()}
    n = len(records)
    assert n > 3000 and {r["request_id"] for r in records} == clean.keys()
    errors = [r for r in records if r["finish_reason"] == "error"]
    cut = [r for r in records if r["finish_reason"] == "length"]
    assert abs(len(errors) / n - 0.01) < 4 * (0.01 / n) ** 0.5
    assert abs(len(cut) / n - 0.02) < 4 * (0.02 / n) ** 0.5
    assert all(r["status_code"] == 500 and r["completion_tokens"] == 0 for r in errors)
    for r in cut:  # cut at 20-90 % of the answer the request would have written
        wanted = clean[r["request_id"]]["completion_tokens"]
        assert r["completion_tokens"] == r["max_tokens"] < wanted
        assert 0.2 * wanted - 1 <= r["completion_tokens"] <= 0.9 * wanted
    assert {r["finish_reason"] for r in clean.values()} == {"stop"}  # none without the background


def test_an_error_burst_fails_exactly_its_count_in_its_prompt_range() -> None:
    burst = SimPhase("burst", 60, error_count=10, error_prompt_tokens=(1000, 3000), models=(CHAT_MODEL.name,))
    records = list(TraceWorkload((SimPhase("normal", 120), burst, SimPhase("normal", 60)), seed=4).records())
    errors = [r for r in records if r["finish_reason"] == "error"]
    assert len(errors) == 10
    assert all(r["model"] == CHAT_MODEL.name and 1000 <= r["prompt_tokens"] < 3000 for r in errors)
    arrivals = sorted(_arrival(r) for r in errors)
    assert arrivals[0] >= 120 - 1e-3 and arrivals[-1] < 180
    assert arrivals[-1] - arrivals[0] > 30  # spread over the minute, not its first seconds


def test_the_pager_fleet_is_deterministic_per_seed() -> None:
    phases = cycle_phases(1800.0, start_s=14 * 3600.0)
    first = list(TraceWorkload(phases, models=PAGER_FLEET, seed=21).records())
    assert first == list(TraceWorkload(phases, models=PAGER_FLEET, seed=21).records())
    assert first != list(TraceWorkload(phases, models=PAGER_FLEET, seed=22).records())


def test_the_daily_cycle_peaks_in_the_afternoon_and_dips_at_weekends() -> None:
    hours = np.arange(0, 24 * 7) * 3600.0
    level = diurnal_multiplier(hours, depth=0.6, peak_hour=15.0, weekend_dip=0.3)
    thursday = level[:24]
    assert int(np.argmax(thursday)) == 15 and int(np.argmin(thursday)) == 3
    assert thursday.max() == pytest.approx(1.0) and thursday.min() == pytest.approx(0.4)
    assert thursday[15 - 4] == pytest.approx(thursday[15 + 4])  # a cosine: as steep before the peak as after
    saturday, sunday, monday = level[48:72], level[72:96], level[96:120]  # EPOCH is a Thursday
    assert saturday == pytest.approx(0.7 * thursday) and sunday == pytest.approx(0.7 * thursday)
    assert monday == pytest.approx(thursday)
    phases = cycle_phases(DAY_S, step_s=600.0)
    assert len(phases) == 144 and sum(p.duration_s for p in phases) == DAY_S
    assert phases[0].name == "normal@d0 00:00" and phases[90].name == "normal@d0 15:00"
    assert max(p.traffic for p in phases) == pytest.approx(1.0, abs=1e-3)


def test_a_daily_cycle_moves_the_arrivals_with_it() -> None:
    """Traffic follows the curve (the trace's own bursts aside): the busy hour has about 2.5x
    the requests of the quiet one."""
    workload = TraceWorkload(cycle_phases(DAY_S, step_s=1800.0), models=(CODE_MODEL,), seed=5)
    arrivals = np.array([_arrival(r) for r in workload.records()])
    quiet = np.sum((arrivals >= 2 * 3600) & (arrivals < 4 * 3600))
    busy = np.sum((arrivals >= 14 * 3600) & (arrivals < 16 * 3600))
    assert 1.8 < busy / quiet < 3.3
