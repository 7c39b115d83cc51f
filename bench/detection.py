"""Detection: the scenario suite as a table (what paged, how fast, what paged by mistake).

    python bench/detection.py [--seeds 7 8 9]

Each scenario (``pipeline/scenarios.py``) is normal traffic followed by one injected
condition, replayed through the worker's code (windows, detectors, lifecycle; no broker).
Per scenario and seed it prints the signals that must page and the delay of each (event
seconds from the fault to the end of the first paging window; 10 s windows), the signals
that paged in the injected phase, pages before the fault (false alarms), and the replay's
records/s. The last line sums up: faults caught, and false pages over all normal windows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.scenarios import SCENARIOS, run_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[7])
    parser.add_argument("--only", nargs="+", help="scenario names")
    args = parser.parse_args()

    print(f"{'scenario':18} {'seed':>4} {'must page (delay)':42} {'paged in the fault':44} {'false':>5} {'rec/s':>8}")
    caught = total = false_pages = 0
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
    print()
    print(f"caught as specified: {caught}/{total} scenario runs; false pages outside the faults: {false_pages}")
    print("delay: event seconds from the fault to the end of the first paging window (windows of 10 s, a page")
    print("needs 2 anomalous windows of the last 3). 'paged in the fault' may include consequences (a slower")
    print("decode also lengthens end-to-end time).")


if __name__ == "__main__":
    main()
