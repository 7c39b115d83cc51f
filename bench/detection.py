"""Detection: the scenario suite as tables (what paged, how fast, what paged by mistake), per family.

    python -m bench.detection [--seeds 7 8 9] [--only NAME ...] [--family "pager day"] [--week] [--scrapes]

Each scenario (``pipeline/dev/scenarios.py``) is normal traffic, one injected condition (or none)
and normal traffic again, replayed through the worker's code (windows, detectors, lifecycle;
no broker). Four families: ``synthetic`` (the bundled generator), ``real arrivals`` (the
Mooncake trace through slot-limited engines), ``real GPU runs`` (kv-cache-tester's runs on
a real server, with faults injected) and ``pager day`` (both models on their traces through
engines with a KV budget, with background errors and cut answers: a day with its daily
cycle, three normal hours, a 2.5x surge, and two faults on the same traffic; ``--week`` adds
seven days, which take tens of minutes).

First, per scenario and seed: the signals that must page and, for each, the windows from the
first window that holds a request showing the fault to it (a cut answer for
``length_truncation``) to the end of the first paging window (2 is the least: an incident
needs 2 anomalous windows of 3), its first hint, the signals that paged in
the fault, and false incidents (incidents outside the fault and its aftermath, counted by
fingerprint). Then, per family, servewatch beside two naive TTFT detectors
(``bench/baselines.py``: a fixed fleet-wide p95 threshold, a load-blind rolling z-score) on
the same records: faults caught, median delay in windows, false incidents per simulated day
of normal traffic, and the replay's records/s.

On-call does not count incidents: it counts pages. So servewatch is counted twice: by
incident, and as a pager receives it (``servewatch (paging groups)``): the run's events
through ``IncidentGrouper``, a page being a group's first record above ``info`` (a group that
opens as info and steps up to warning pages once). Every false group page is listed at the
end with its cause, signals, severity and the line a person reads. In the pager day's
three-hour runs the first three hours are the detector's history and are not judged, by any
detector (``Scenario.judged_from_s``): on-call's detector has been running for a while.

``--scrapes`` replays each pager-day run a second time as a fleet with only ``/metrics``
sees it (``bench/scrape_pages.py``: the same engines as recorded vLLM scrapes), and prints
its paging groups beside the request logs' and a ``scrapes only (groups)`` row.
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
from bench.scrape_pages import scrape_outcome
from servewatch.pipeline.dev.scenarios import (
    FAMILIES,
    PAGER_SCENARIOS,
    PAGER_WEEK,
    SCENARIOS,
    GroupPage,
    ScenarioResult,
    run_scenario,
)
from servewatch.pipeline.settings import Settings

DETECTORS = ("servewatch", "fixed p95 threshold", "rolling z-score (TTFT)", "servewatch (paging groups)")


def judged_by_baselines(r: ScenarioResult, seed: int) -> dict[str, list[float]]:
    """Window starts of the incidents each naive detector fires on this run's records."""
    records = [record for _, batch in r.scenario.build(seed).seconds() for record in batch]
    series = ttft_p95_series(records, Settings().segmenter())
    threshold = fixed_threshold(series, r.injected_at)
    # Incidents ending in the detector's history (``judged_from``) are not judged, as servewatch's.
    return {
        DETECTORS[1]: [t for _, t in fixed_threshold_incidents(series, threshold) if t + WINDOW_S > r.judged_from],
        DETECTORS[2]: [t for _, t in rolling_z_incidents(series) if t + WINDOW_S > r.judged_from],
    }


def _clock(seconds: float) -> str:
    """'+13:05:40': event seconds from the run's start, as a person reads a timeline."""
    whole = int(seconds)
    return f"+{whole // 3600:02d}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def describe_page(r: ScenarioResult, seed: int, page: GroupPage) -> list[str]:
    """A false group page as on-call met it: when, severity, cause, signals; the group's title;
    the incident that made it page (signal, segment, hints), and its summary line."""
    group, event = page.record, page.event
    segment = ", ".join(f"{value}" for key, value in event.segment.items() if key != "model")
    hints = ", ".join(hint.code for hint in event.hints) or "-"
    return [
        f"{r.scenario.name} seed {seed} at {_clock(group.window_end - r.stream_start)} "
        f"{group.severity.value} ({group.transition}) {group.title}",
        f"    paged by {event.signal.value} [{segment}] {event.severity.value}"
        f"{', explained by load' if event.explained_by_load else ''}; hints {hints}",
        f"    {event.summary}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[7])
    parser.add_argument("--only", nargs="+", help="scenario names")
    parser.add_argument("--family", choices=FAMILIES, help="one family only")
    parser.add_argument("--week", action="store_true", help="add the pager day family's week (slow)")
    parser.add_argument(
        "--scrapes",
        action="store_true",
        help="also replay the pager day family as vLLM scrapes alone (a /metrics-only fleet; slow)",
    )
    args = parser.parse_args()
    suite = (*SCENARIOS, *PAGER_SCENARIOS, *((PAGER_WEEK,) if args.week else ()))

    print(f"{'scenario':28} {'seed':>4}  {'must page: windows, first hint':64} {'false':>5} {'groups':>6} "
          f"{'rec/s':>8}")  # fmt: skip
    # Per family and detector: faults caught, delays (windows), false incidents; normal seconds judged.
    tally: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: {d: defaultdict(list) for d in DETECTORS})
    faults: dict[str, int] = defaultdict(int)
    normal_s: dict[str, float] = defaultdict(float)
    rates: dict[str, list[float]] = defaultdict(list)
    false_pages: list[str] = []
    scrapes: dict[str, list[float]] = defaultdict(list)  # caught delays, false groups, normal seconds, faults
    for scenario in suite:
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
            false_groups = r.false_group_pages
            rates[family].append(r.records / r.seconds)
            print(f"{scenario.name:28} {seed:4}  {'; '.join(cells) or '(none may page)':64} {len(false):5} "
                  f"{len(false_groups):6} {r.records / r.seconds:8,.0f}")  # fmt: skip
            for page in false_groups:
                false_pages.extend(describe_page(r, seed, page))
            faults[family] += bool(scenario.must_page)
            normal_s[family] += r.normal_s
            fault_end = r.stream_end if scenario.after_fault else r.injected_end + scenario.aftermath_s
            mine = [e for e in r.pages if e.signal in scenario.must_page and e.window_end > r.injected_at]
            starts = {DETECTORS[0]: [min(e.window_start for e in mine)] if mine else []}
            starts.update(judged_by_baselines(r, seed))
            # A group counts for the fault when it pages in it with one of the signals that must
            # page among its signals as that window closed.
            starts[DETECTORS[3]] = [
                page.event.window_start for page in r.group_pages if page.in_fault and page.signals & scenario.must_page
            ]
            if args.scrapes and (scenario in PAGER_SCENARIOS or scenario is PAGER_WEEK):
                seen = scrape_outcome(scenario, seed)
                after = "-" if seen.caught_after is None else f"{seen.caught_after:.1f}"
                print(f"{'':28} {'':4}  scrapes only: {after:>4} "
                      f"windows to page, {len(seen.false)} false groups: "
                      f"{', '.join(g.title for g in seen.false) or '-'}")  # fmt: skip
                scrapes["faults"].append(float(bool(scenario.must_page)))
                scrapes["false"].append(len(seen.false))
                scrapes["normal_s"].append(seen.normal_s)
                if scenario.must_page and seen.caught_after is not None:
                    scrapes["delay"].append(seen.caught_after)
            tally[family][DETECTORS[0]]["false"].append(len(false))
            tally[family][DETECTORS[3]]["false"].append(len(false_groups))
            for detector in DETECTORS:
                in_fault = [t for t in starts[detector] if r.injected_at - WINDOW_S < t < fault_end]
                if not scenario.must_page:
                    in_fault = []
                if detector in DETECTORS[1:3]:
                    tally[family][detector]["false"].append(len(starts[detector]) - len(in_fault))
                if scenario.must_page and in_fault:
                    tally[family][detector]["caught"].append(1)
                    onset = WINDOW_S * math.floor(r.first_evidence / WINDOW_S)
                    tally[family][detector]["delay"].append((min(in_fault) + WINDOW_S - onset) / WINDOW_S)
    print()
    print("windows: to the end of the first paging window, from the first window holding a request the fault")
    print("changed (for error_rate, length_truncation and reasoning_leak: a failed, cut or leaking one; a")
    print("lowered max_tokens cuts an answer only once it has decoded that many tokens);")
    print("an incident needs 2 anomalous windows of 3, so 2 is the least. false: incidents outside the fault")
    print("and its aftermath (60 s; 300 s on real arrivals, where a backlog drains), by fingerprint.")
    print("groups: incident groups starting to page outside them (a group's first record above info),")
    print("what a pager receives; the 'servewatch (paging groups)' rows count those.")
    print()
    print(f"{'family':15} {'detector':26} {'faults caught':>14} {'median delay':>13} {'false':>6} {'per day':>8} "
          f"{'rec/s':>8}")  # fmt: skip
    for family in FAMILIES:
        if family not in tally:
            continue
        days = normal_s[family] / 86_400
        for detector in DETECTORS:
            t = tally[family][detector]
            delay = f"{statistics.median(t['delay']):.1f} win" if t["delay"] else "-"
            wrong = sum(t["false"])
            rate = f"{statistics.median(rates[family]):8,.0f}" if detector == DETECTORS[0] else ""
            print(f"{family:15} {detector:26} {len(t['caught']):>6}/{faults[family]:<7} {delay:>13} {wrong:>6} "
                  f"{wrong / days if days else 0:>8.1f} {rate:>8}")  # fmt: skip
        print(f"{'':15} over {faults[family]} fault runs and {days:.2f} simulated days of normal traffic")
    if scrapes:
        days = sum(scrapes["normal_s"]) / 86_400
        delay = f"{statistics.median(scrapes['delay']):.1f} win" if scrapes["delay"] else "-"
        wrong = sum(scrapes["false"])
        caught, runs = len(scrapes["delay"]), int(sum(scrapes["faults"]))
        print(f"{'pager day':15} {'scrapes only (groups)':26} {caught:>6}/{runs:<7} "
              f"{delay:>13} {wrong:>6} {wrong / days if days else 0:>8.1f}")  # fmt: skip
        print(f"{'':15} the same traffic as vLLM scrapes every 10 s; an error burst leaves no engine metric to page on")
    if false_pages:
        print()
        print("false pages (incident groups starting to page outside any fault), with the line on-call reads;")
        print("+time from the run's start (the day starts at midnight, the pager day's hours runs at 10:00):")
        print("\n".join(false_pages))


if __name__ == "__main__":
    main()
