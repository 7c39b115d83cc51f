"""Replay at realistic density: two models on real arrival traces, six hours, about a dozen
request logs per segment-window, where judging windows (not reading records) is the work.

    python -m bench.replay_realistic [--seed 7] [--runs 3] [--against /tmp/before] [--floor]

The workload is the pager-day suite's three busy hours with their three hours of history
(``pipeline/dev/scenarios.py``: both models of the pager fleet, Azure and Mooncake arrival
traces through slot-limited engines, background errors and cut answers), written as JSONL
and replayed as ``servewatch replay`` reads a file, in a fresh process per run. Prints
records/s, the segment-windows judged and the cost of each (the run's time divided by
them). ``--against``: another checkout (a ``git worktree`` of an older commit) replayed in
turn with this one on the same file: the ratio of their medians, and the median of the ratios
of each round's two runs (this kind of machine drifts by tens of per cent within a minute, so
runs are paired; the paired median is the steadier figure). ``--floor``: this checkout
(and the other, with ``--against``) replayed in turn with its detectors switched off
(windows made, merged and released, none judged), the most any faster judging could give:
what is left is reading, segmenting and windowing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import orjson

from bench.replay_ab import CHILD, HERE, replay_run
from servewatch.pipeline.dev.scenarios import BY_NAME

WORKLOAD = "pager_three_hours"

#: The replay of ``bench.replay_ab``, its detector bank judging nothing (this checkout only).
FLOOR_CHILD = (
    """
from servewatch.models.detect.bank import DetectorBank
DetectorBank.observe_all = lambda self, windows, final=False: []
"""
    + CHILD
)


def write_workload(path: Path, seed: int) -> int:
    """The workload's request logs as JSONL at ``path``; how many."""
    count = 0
    with path.open("wb") as out:
        for _, batch in BY_NAME[WORKLOAD].build(seed).seconds():
            out.write(b"".join(orjson.dumps(record) + b"\n" for record in batch))
            count += len(batch)
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout, replayed in turn with this one")
    parser.add_argument("--floor", action="store_true",
                        help="also replay this checkout (and --against's) without judging, in turn")  # fmt: skip
    args = parser.parse_args()
    sides = {"this": HERE} if args.against is None else {"other": args.against.resolve(), "this": HERE}
    runners: dict[str, Callable[[Path], tuple[float, int, int]]] = {name: partial(replay_run, checkout)
                                                                     for name, checkout in sides.items()}  # fmt: skip
    if args.floor:
        floors = {"floor": HERE} if args.against is None else {"floor other": sides["other"], "floor": HERE}
        runners.update({name: partial(replay_run, checkout, child=FLOOR_CHILD) for name, checkout in floors.items()})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.jsonl"
        records = write_workload(path, args.seed)
        results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in runners}
        for run in range(args.runs):
            for name, runner in runners.items():
                results[name].append(runner(path))
                rate, events, windows = results[name][-1]
                print(f"run {run + 1}: {name:5} {rate:>10,.0f} records/s, {windows:,} segment-windows, {events} events",
                      file=sys.stderr)  # fmt: skip
    print(f"{WORKLOAD} (seed {args.seed}): {records:,} request logs over 6 h of event time, two models")
    for name, runs in results.items():
        rate = statistics.median(r for r, _, _ in runs)
        if name.startswith("floor"):
            side = "other" if name == "floor other" else "this"
            share = 1 - statistics.median(r for r, _, _ in results[side]) / rate
            print(f"floor ({side}, nothing judged): median {rate:,.0f} records/s; judging takes {share:.0%} of the "
                  f"replay's time  [{', '.join(f'{r:,.0f}' for r, _, _ in runs)}]")  # fmt: skip
            continue
        windows = runs[0][2]
        per_window_ms = records / rate / windows * 1000
        print(f"{name:5} ({sides[name]}): median {rate:,.0f} records/s; {windows:,} segment-windows, "
              f"{records / windows:.1f} records each, {per_window_ms:.3f} ms per segment-window  "
              f"[{', '.join(f'{r:,.0f}' for r, _, _ in runs)}]")  # fmt: skip
    if args.against is not None:
        for label, this_side, other_side in (("", "this", "other"), ("floor ", "floor", "floor other")):
            if this_side not in results:
                continue
            this, other = (statistics.median(r for r, _, _ in results[name]) for name in (this_side, other_side))
            # Each run against the other side's run of the same round, a moment apart: the
            # machine's drift over the sitting falls on both.
            paired = [a / b for (a, _, _), (b, _, _) in zip(results[this_side], results[other_side], strict=True)]
            print(f"{label}ratio this/other: {this / other:.2f} (of the medians); paired by round: median "
                  f"{statistics.median(paired):.2f}  [{', '.join(f'{r:.2f}' for r in paired)}]")  # fmt: skip


if __name__ == "__main__":
    main()
