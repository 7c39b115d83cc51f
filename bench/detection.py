"""Detection: the scenario suite as a table (what paged, how fast, what paged by mistake).

    python bench/detection.py [--seeds 7 8 9]

Each scenario (``pipeline/scenarios.py``) is normal traffic followed by one injected
condition, replayed through the worker's code (windows, detectors, lifecycle; no broker).
Per scenario and seed it prints the signals that must page and the delay of each (event
seconds from the fault to the end of the first paging window; 10 s windows), the signals
that paged in the injected phase, pages before the fault (false alarms), and the replay's
records/s. The last line sums up: faults caught, and false pages over all normal windows.

Then the same runs judged by two naive TTFT detectors (``bench/baselines.py``: a fixed
fleet-wide p95 threshold, and a load-blind rolling z-score), side by side with servewatch:
faults caught (an incident in the injected phase: for servewatch, of a signal that must
page), the median delay in windows, and false incidents per simulated day of normal
traffic (incidents outside the injected phase; servewatch's counted by fingerprint).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.baselines import (
    WINDOW_S,
    fixed_threshold,
    fixed_threshold_incidents,
    rolling_z_incidents,
    ttft_p95_series,
)
from pipeline.scenarios import AFTERMATH_S, SCENARIOS, ScenarioResult, run_scenario
from pipeline.settings import Settings

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
    args = parser.parse_args()

    print(f"{'scenario':18} {'seed':>4} {'must page (delay)':42} {'paged in the fault':44} {'false':>5} {'rec/s':>8}")
    caught = total = false_pages = 0
    # Per detector: faults caught, delays (windows), false incidents; and the normal traffic judged.
    tally: dict[str, dict[str, list[float]]] = {d: defaultdict(list) for d in DETECTORS}
    faults, normal_s = 0, 0.0
    for scenario in SCENARIOS:
        if args.only and scenario.name not in args.only:
            continue
        for seed in args.seeds:
            r = run_scenario(scenario, seed=seed)
            delays = []
            for signal in sorted(scenario.must_page, key=lambda s: s.value):
                delay = r.first_page_delay(signal)
                delays.append(f"{signal.value} {'MISSED' if delay is None else f'{delay:.0f}s'}")
            paged = ", ".join(sorted(s.value for s in r.paged_signals)) or "-"
            total += 1
            caught += r.caught and (bool(scenario.must_page) or not r.pages)
            false_pages += len(r.false_pages)
            print(f"{scenario.name:18} {seed:4} {', '.join(delays) or '(none)':42} {paged:44} "
                  f"{len(r.false_pages):5} {r.records / r.seconds:8,.0f}")  # fmt: skip
            fault_end = r.injected_end + AFTERMATH_S if scenario.must_page else r.injected_at
            faults += bool(scenario.must_page)
            normal_s += (r.stream_end - r.scenario.build(seed).start) - (fault_end - r.injected_at)
            mine = [e for e in r.pages if e.signal in scenario.must_page and e.window_end > r.injected_at]
            starts = {DETECTORS[0]: [min((e.window_start for e in mine), default=math.inf)] if mine else []}
            starts.update(judged_by_baselines(r, seed))
            tally[DETECTORS[0]]["false"].append(len({e.fingerprint for e in r.false_pages}))
            for detector in DETECTORS:
                in_fault = [t for t in starts[detector] if r.injected_at - WINDOW_S < t < fault_end]
                if detector != DETECTORS[0]:
                    tally[detector]["false"].append(len(starts[detector]) - len(in_fault))
                if scenario.must_page and in_fault:
                    tally[detector]["caught"].append(1)
                    tally[detector]["delay"].append((min(in_fault) + WINDOW_S - r.injected_at) / WINDOW_S)
    print()
    print(f"caught as specified: {caught}/{total} scenario runs; false pages outside the faults: {false_pages}")
    print("delay: event seconds from the fault to the end of the first paging window (windows of 10 s, a page")
    print("needs 2 anomalous windows of the last 3). 'paged in the fault' may include consequences (a slower")
    print("decode also lengthens end-to-end time).")
    days = normal_s / 86_400
    print()
    print(f"{'detector':24} {'faults caught':>14} {'median delay':>13} {'false incidents':>16} {'per day':>8}")
    for detector in DETECTORS:
        t = tally[detector]
        delay = f"{statistics.median(t['delay']):.1f} win" if t["delay"] else "-"
        false = sum(t["false"])
        print(f"{detector:24} {len(t['caught']):>6}/{faults:<7} {delay:>13} {false:>16} {false / days:>8.1f}")
    print(f"over {faults} fault runs and {days:.2f} simulated days of normal traffic; delay: windows from the")
    print("fault's start to the end of the window that fired (an incident needs 2 anomalous windows of 3).")


if __name__ == "__main__":
    main()
