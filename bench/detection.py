"""Detection: the scenario suite as tables (what paged, how fast, what paged by mistake), per family.

    python -m bench.detection [--seeds 7 8 9] [--only NAME ...] [--family "real arrivals"]

Each scenario (``pipeline/dev/scenarios.py``) is normal traffic, one injected condition (or none)
and normal traffic again, replayed through the worker's code (windows, detectors, lifecycle;
no broker). Three families: ``synthetic`` (the bundled generator), ``real arrivals`` (the
Mooncake trace through slot-limited engines) and ``real GPU runs`` (kv-cache-tester's runs on
a real server, with faults injected).

First, per scenario and seed: the signals that must page and, for each, the windows from the
first window that holds a faulty request to the end of the first paging window (2 is the
least: an incident needs 2 anomalous windows of 3), its first hint, the signals that paged in
the fault, and false incidents (incidents outside the fault and its aftermath, counted by
fingerprint). Then, per family, servewatch beside two naive TTFT detectors
(``bench/baselines.py``: a fixed fleet-wide p95 threshold, a load-blind rolling z-score) on
the same records: faults caught, median delay in windows, false incidents per simulated day
of normal traffic, and the replay's records/s.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import defaultdict

from bench.baselines import (
    WINDOW_S,
    fixed_threshold,
    fixed_threshold_incidents,
    rolling_z_incidents,
    ttft_p95_series,
)
from servewatch.pipeline.dev.scenarios import FAMILIES, SCENARIOS, ScenarioResult, run_scenario
from servewatch.pipeline.settings import Settings

DETECTORS = ("servewatch", "fixed p95 threshold", "rolling z-score (TTFT)")


def judged_by_baselines(r: ScenarioResult, seed: int) -> dict[str, list[float]]:
    """Window starts of the incidents each naive detector fires on this run's records."""
    records = [record for _, batch in r.scenario.build(seed).seconds() for record in batch]
    series = ttft_p95_series(records, Settings().segmenter())
    threshold = fixed_threshold(series, r.injected_at)
    return {
        DETECTORS[1]: [start for _, start in fixed_threshold_incidents(series, threshold)],
        DETECTORS[2]: [start for _, start in rolling_z_incidents(series)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[7])
    parser.add_argument("--only", nargs="+", help="scenario names")
    parser.add_argument("--family", choices=FAMILIES, help="one family only")
    args = parser.parse_args()

    print(f"{'scenario':28} {'seed':>4}  {'must page: windows, first hint':64} {'false':>5} {'rec/s':>8}")
    # Per family and detector: faults caught, delays (windows), false incidents; normal seconds judged.
    tally: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: {d: defaultdict(list) for d in DETECTORS})
    faults: dict[str, int] = defaultdict(int)
    normal_s: dict[str, float] = defaultdict(float)
    rates: dict[str, list[float]] = defaultdict(list)
    for scenario in SCENARIOS:
        if (args.only and scenario.name not in args.only) or (args.family and scenario.family != args.family):
            continue
        family = scenario.family
        for seed in args.seeds:
            r = run_scenario(scenario, seed=seed)
            cells = []
            for signal in sorted(scenario.must_page, key=lambda s: s.value):
                windows, first = r.windows_to_page(signal), r.first_page(signal)
                hint = first.hints[0].code if first is not None and first.hints else "-"
                cells.append(f"{signal.value} {'MISSED' if windows is None else windows} ({hint})")
            false = {e.fingerprint for e in r.false_pages}
            rates[family].append(r.records / r.seconds)
            print(f"{scenario.name:28} {seed:4}  {'; '.join(cells) or '(none may page)':64} {len(false):5} "
                  f"{r.records / r.seconds:8,.0f}")  # fmt: skip
            faults[family] += bool(scenario.must_page)
            normal_s[family] += r.normal_s
            fault_end = r.stream_end if scenario.after_fault else r.injected_end + scenario.aftermath_s
            mine = [e for e in r.pages if e.signal in scenario.must_page and e.window_end > r.injected_at]
            starts = {DETECTORS[0]: [min(e.window_start for e in mine)] if mine else []}
            starts.update(judged_by_baselines(r, seed))
            tally[family][DETECTORS[0]]["false"].append(len(false))
            for detector in DETECTORS:
                in_fault = [t for t in starts[detector] if r.injected_at - WINDOW_S < t < fault_end]
                if not scenario.must_page:
                    in_fault = []
                if detector != DETECTORS[0]:
                    tally[family][detector]["false"].append(len(starts[detector]) - len(in_fault))
                if scenario.must_page and in_fault:
                    tally[family][detector]["caught"].append(1)
                    onset = WINDOW_S * math.floor(r.first_evidence / WINDOW_S)
                    tally[family][detector]["delay"].append((min(in_fault) + WINDOW_S - onset) / WINDOW_S)
    print()
    print("windows: to the end of the first paging window, from the first window holding a faulty request")
    print("(real runs) or the fault phase's start (simulated: a fault hits requests starting service after it);")
    print("an incident needs 2 anomalous windows of 3, so 2 is the least. false: incidents outside the fault")
    print("and its aftermath (60 s; 300 s on real arrivals, where a backlog drains), by fingerprint.")
    print()
    print(f"{'family':15} {'detector':24} {'faults caught':>14} {'median delay':>13} {'false':>6} {'per day':>8} "
          f"{'rec/s':>8}")  # fmt: skip
    for family in FAMILIES:
        if family not in tally:
            continue
        days = normal_s[family] / 86_400
        for detector in DETECTORS:
            t = tally[family][detector]
            delay = f"{statistics.median(t['delay']):.1f} win" if t["delay"] else "-"
            false = sum(t["false"])
            rate = f"{statistics.median(rates[family]):8,.0f}" if detector == DETECTORS[0] else ""
            print(f"{family:15} {detector:24} {len(t['caught']):>6}/{faults[family]:<7} {delay:>13} {false:>6} "
                  f"{false / days if days else 0:>8.1f} {rate:>8}")  # fmt: skip
        print(f"{'':15} over {faults[family]} fault runs and {days:.2f} simulated days of normal traffic")


if __name__ == "__main__":
    main()
