"""``servewatch compare`` on data nobody here made: the real GPU load tests, split in two.

Each row compares two stretches of one real run (``pipeline/dev/real_runs``) with the
``ChangeVerifier``: stretches that are both healthy, and a stretch across ``dram_only``'s
real degradation. The tester changes its concurrency between stretches (closed loop), so
the request rates are printed beside the verdicts, and why a verdict is inconclusive
under them. ``--raw`` compares without holding the traffic fixed (segments only).

    .venv/bin/python -m bench.compare_real
"""

from __future__ import annotations

import argparse

from servewatch.models.compare import ChangeVerifier
from servewatch.pipeline.changes.render import notes
from servewatch.pipeline.dev.real_runs import RealRunWorkload

#: (run, what it is, start, split, end): seconds of finish time from the run's first request.
CASES = (
    ("dram_only", "healthy halves", 60.0, 420.0, 779.0),
    ("dram_only", "across the real degradation at 779 s", 300.0, 779.0, 1300.0),
    ("gds_dram", "healthy halves (mild drift)", 60.0, 930.0, 1800.0),
    ("cacherate_sustained", "concurrency stepped up, saturated", 40.0, 110.0, 184.0),
)
SHOWN = ("ttft_p50", "ttft_p95", "e2e_p95", "cache_hit_rate")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resamples", type=int, default=500)
    parser.add_argument("--raw", action="store_true", help="segments only: load and cache eligibility not held")
    args = parser.parse_args(argv)
    verifier = ChangeVerifier(resamples=args.resamples, hold_traffic=not args.raw)
    print(f"{'run':<20} {'stretches':<38} {'req/s':>11}  " + "  ".join(f"{s:<24}" for s in SHOWN))
    for run, what, start, split, end in CASES:
        workload = RealRunWorkload(run)
        rows = list(workload.records())
        offset = [row["timestamp"] - workload.start for row in rows]
        before = [row for row, t in zip(rows, offset, strict=True) if start <= t < split]
        after = [row for row, t in zip(rows, offset, strict=True) if split <= t < end]
        (report,) = verifier.compare(before, after)
        rates = f"{len(before) / (split - start):.1f}>{len(after) / (end - split):.1f}"
        by_signal = {row.signal: row for row in report.signals}
        cells = []
        for name in SHOWN:
            row = by_signal.get(name)
            change = (
                "-"
                if row is None or row.change is None
                else (f"{row.change:+.2f} pt" if row.kind == "points" else f"{100 * (row.change - 1):+.0f} %")
            )
            cells.append(f"{(row.verdict if row else '-') + ' ' + change:<24}")
        print(f"{run:<20} {what:<38} {rates:>11}  " + "  ".join(cells))
        for line in notes(report):
            print(f"{'':<20} {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
