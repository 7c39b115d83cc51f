"""Which replica: one bad serving instance among healthy peers, and healthy fleets that move.

Each case of ``pipeline.dev.replica_scenarios`` replayed through the worker's code
(``run_scenario``): pages naming the faulty instance (``replica_outlier`` on its instance)
and the windows to the first, from the fault's start (``windows``) and from the window
holding the first request the fault changed (``logged``, as ``bench.detection`` counts
real runs); pages naming another instance; and
false paging groups (incident groups starting to page outside the fault and its aftermath,
as a pager receives them). Then replay speed and memory with and without replica rows at
many replicas (``--replicas 64 --models 20``: every model on 64 instances). With
``--healthy-splits N``, the real GPU load tests' healthy runs split at random over 4 and 8
replicas with N seeds each (``real_run_replicas``): paging groups per day of healthy real
traffic, where any page is false (the table's own healthy cases are one split each).

    .venv/bin/python -m bench.replicas [--seed 7] [--only NAME] [--scrapes] [--scale] [--healthy-splits 10]
"""

from __future__ import annotations

import argparse
import copy
import gc
import resource
import statistics
import time
import tracemalloc

import orjson

from servewatch.pipeline.dev.replica_scenarios import FAULTY_HOST, real_run_replicas, replica_scenarios
from servewatch.pipeline.dev.scenarios import Scenario, ScenarioResult, run_scenario
from servewatch.pipeline.dev.serving_sim import TraceWorkload
from servewatch.pipeline.dev.sim_scrapes import run_scrape_scenario
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.pipeline.settings import Settings

WINDOW_S = 10.0


def _naming(result: ScenarioResult, host: str) -> list:
    return [
        e
        for e in result.pages
        if e.segment.get("instance") == host and any(h.code == "replica_outlier" for h in e.hints)
    ]


def row(result: ScenarioResult) -> str:
    scenario = result.scenario
    right = [e for e in _naming(result, FAULTY_HOST) if result.injected_at < e.window_end]
    first = min((e.window_end for e in right), default=None)

    def windows_from(start: float) -> str:
        return "-" if first is None else f"{(first - WINDOW_S * (start // WINDOW_S)) / WINDOW_S:.0f}"

    # Also from the window holding the first request the fault changed, as bench.detection
    # counts its real runs: a prefill slowed now shows once that request has decoded its answer.
    delay, since_logged = windows_from(result.injected_at), windows_from(result.first_evidence)
    wrong = {
        e.segment.get("instance")
        for e in result.pages
        if any(h.code == "replica_outlier" for h in e.hints) and e.segment.get("instance") != FAULTY_HOST
    }
    false_groups = len(result.false_group_pages)
    expected = "page" if scenario.must_page else "quiet"
    ok = (bool(right) and not wrong and not false_groups) if scenario.must_page else not result.group_pages
    return (
        f"{scenario.name:34} {expected:6} {'yes' if right else 'no':>8} {delay:>7} {since_logged:>6} "
        f"{len(wrong):>6} {false_groups:>6} {len(result.group_pages):>6} {result.records:>9,} {'ok' if ok else 'MISS'}"
    )


def scrape_row(scenario: Scenario, seed: int) -> str:
    """The same case from the engines' /metrics alone (``run_scrape_scenario``)."""
    workload = scenario.build(seed)
    if not isinstance(workload, TraceWorkload):  # a real run's request logs: it has no engines to scrape
        return f"{scenario.name:34} (request logs only)"
    run = run_scrape_scenario(workload)
    start = float(workload.start)
    injected_at = start + scenario.warmup_s
    fault_end = injected_at + scenario.injected_duration_s + scenario.aftermath_s
    end = start + float(workload.duration_s)
    groups = [g for g in run.paging_groups if g.window_end <= end]
    faulty = f"replica_outlier {FAULTY_HOST}"
    in_fault = [g for g in groups if scenario.must_page and g.window_end > injected_at and g.window_start < fault_end]
    right = [g for g in in_fault if g.cause == faulty]
    onset = WINDOW_S * (injected_at // WINDOW_S)
    delay = f"{(min(g.window_end for g in right) - onset) / WINDOW_S:.0f}" if right else "-"
    wrong = {g.cause for g in groups if g.cause.startswith("replica_outlier") and g.cause != faulty}
    false_groups = len([g for g in groups if g not in in_fault])
    expected = "page" if scenario.must_page else "quiet"
    ok = (bool(right) and not wrong and not false_groups) if scenario.must_page else not groups
    return (
        f"{scenario.name:34} {expected:6} {'yes' if right else 'no':>8} {delay:>7} {'':>6} {len(wrong):>6} "
        f"{false_groups:>6} {len(groups):>6} {'':>9} {'ok' if ok else 'MISS'}"
    )


def healthy_splits(seeds: int) -> None:
    """Paging groups on the real runs' healthy stretches split over 4 and 8 replicas, per day."""
    print(f"\nhealthy real runs split at random over replicas, seeds 0-{seeds - 1} (any page is false):")
    all_groups, all_s = 0, 0.0
    for run in ("dram_only", "gds_dram"):
        for instances in (4, 8):
            scenario = real_run_replicas(run, instances)
            seconds, said = 0.0, []
            for seed in range(seeds):
                result = run_scenario(scenario, seed)
                seconds += result.normal_s
                said += [
                    f"seed {seed}: {p.event.signal.value} {p.event.segment.get('instance', '')}"
                    for p in result.group_pages
                ]
            groups = len(said)
            all_groups, all_s = all_groups + groups, all_s + seconds
            which = f"; {', '.join(said)}" if said else ""
            per_day = groups * 86400 / seconds
            hours = seconds / 3600
            print(f"  {run:10} of {instances:2}: {groups} paging groups in {hours:5.1f} h ({per_day:.1f} a day){which}")
    print(f"  all: {all_groups} in {all_s / 3600:.1f} h ({all_groups * 86400 / all_s:.1f} a day)")


def scale(replicas: int, models: int, seconds: int, seed: int) -> None:
    """Replay speed and peak memory of one workload with and without replica rows."""
    instances = tuple(f"10.1.{k // 250}.{k % 250}:8000" for k in range(replicas))
    workload = Workload(  # 18 requests/s per model: tens of records per segment-window
        (Phase("normal", seconds),), seed=seed, instances=instances, base_rate=18.0,
        models=tuple(f"model-{m}" for m in range(models)),
    )  # fmt: skip
    batches = [orjson.dumps(batch) for _, batch in workload.seconds() if batch]
    records = sum(len(orjson.loads(b)) for b in batches)
    print(f"\n{replicas} replicas x {models} models: {records:,} request logs over {seconds:,} s of event time")

    def replay(compare: bool) -> Replay:
        engine = Replay(Settings(compare_replicas=compare))
        for offset, raw in enumerate(batches):
            engine.feed(raw, offset)
        engine.finish()
        return engine

    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):  # alternating, untraced: the speed
        for compare in (False, True):
            gc.collect()
            started = time.perf_counter()
            replay(compare)
            rates[compare].append(records / (time.perf_counter() - started))
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"  records/s, median of 3: replica rows on {on:,.0f}, off {off:,.0f}, ratio {on / off:.2f}")
    for compare in (False, True):  # one traced run each: the memory
        gc.collect()
        tracemalloc.start()
        engine = replay(compare)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        watched = sum(len(m) for m in engine.stage_two.bank.replicas.models.values())
        print(
            f"  replica rows {'on ' if compare else 'off'}: traced peak {peak / 2**20:6.1f} MiB, instances watched "
            f"{watched:,}"
        )
        if watched:  # what the instances' state costs: a copy of it, traced
            tracemalloc.start()
            kept = copy.deepcopy(engine.stage_two.bank.replicas.models)
            size, _ = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            signals = max(len(state.cusum) for m in kept.values() for state in m.values())
            print(f"  state per instance: {size / watched:,.0f} bytes ({size / watched / signals:,.0f} per signal)")
    print(f"  (process max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--scrapes", action="store_true", help="also run each case from scrapes alone")
    parser.add_argument("--scale", action="store_true", help="also measure replay speed and memory at many replicas")
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--seconds", type=int, default=600)
    parser.add_argument(
        "--healthy-splits", type=int, default=0, metavar="N", help="also N seeds of healthy real splits"
    )
    args = parser.parse_args()
    header = (f"{'case':34} {'wants':6} {'named':>8} {'windows':>7} {'logged':>6} {'others':>6} {'false':>6} "
              f"{'groups':>6}")  # fmt: skip
    print(f"{header} {'records':>9}")
    chosen = [s for s in replica_scenarios() if not args.only or args.only in s.name]
    for scenario in chosen:
        print(row(run_scenario(scenario, args.seed)), flush=True)
    if args.scrapes:
        print("\nfrom scrapes alone (each engine's /metrics every 10 s):")
        for scenario in chosen:
            print(scrape_row(scenario, args.seed), flush=True)
    if args.healthy_splits:
        healthy_splits(args.healthy_splits)
    if args.scale:
        scale(args.replicas, args.models, args.seconds, args.seed)


if __name__ == "__main__":
    main()
