"""Replay records/s of two checkouts of servewatch, side by side on the same request logs.

    git worktree add /tmp/before <commit>
    python -m bench.replay_ab /tmp/before [--records 200000] [--rate 300] [--rounds 5] [--tenants 2000]

Writes ``--records`` request logs of ``bench/common.py``'s fleet at ``--rate`` requests/s of
event time as JSONL, then runs ``Replay`` over that file in a fresh process per run,
alternating between the other checkout and this one (this kind of machine drifts by tens of
per cent within a minute, so runs are paired), and prints each side's median and runs. At
the default rate of 300 requests/s the fleet's ~100 segments get a few tens of requests per
window, where judging windows, not reading records, is most of the work.

``--tenants N`` gives each request one of N tenants (a few of them most of the traffic, as
tenants are) and segments by tenant too: a fleet with far more label combinations than the
segment cap, most of its requests in the shared overflow segment.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.common import fleet_records

HERE = Path(__file__).resolve().parents[1]

#: Run with the checkout under test as working directory, so that ``python -c`` imports its
#: own code from there (its ``servewatch/`` links, or the folders themselves in the older flat layout).
CHILD = """
import pathlib, sys, time
if pathlib.Path("servewatch", "pipeline").exists():
    from servewatch.pipeline.replay.request_logs import JsonlChunks, Replay
    from servewatch.pipeline.tuning import tune_process
    try:
        from servewatch.pipeline.replay.request_logs import REPLAY_CHUNK_LINES
    except ImportError:  # where it was before the event-time work
        from servewatch.pipeline.cli.main import REPLAY_CHUNK_LINES
else:  # the older flat layout
    from pipeline.cli import REPLAY_CHUNK_LINES
    from pipeline.replay import JsonlChunks, Replay
    from pipeline.tuning import tune_process
tune_process()
chunks = JsonlChunks(sys.argv[1], REPLAY_CHUNK_LINES)
engine = Replay(reread=chunks.reread)
started = time.perf_counter()
events = sum(1 for _ in engine.run(chunks))
print(engine.stats.records / (time.perf_counter() - started), events, engine.stats.windows)
"""


#: Segment dimensions with ``--tenants``.
BY_TENANT = "model,route,tenant,prompt_band,output_band"


def replay_run(
    checkout: Path, path: Path, child: str = CHILD, env: dict[str, str] | None = None
) -> tuple[float, int, int]:
    """One replay of ``path`` in a fresh process of ``checkout`` (``child``'s code, ``env``
    added to its environment): records/s, events, segment-windows judged."""
    done = subprocess.run(
        [sys.executable, "-c", child, str(path)], capture_output=True, text=True, cwd=checkout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(f"replay in {checkout} failed:\n{done.stderr[-2000:]}")
    rate, events, windows = done.stdout.split()
    return float(rate), int(events), int(windows)


def replay_once(checkout: Path, path: Path, env: dict[str, str] | None = None) -> tuple[float, int]:
    rate, events, _ = replay_run(checkout, path, env=env)
    return rate, events


def with_tenants(records: list[dict[str, Any]], tenants: int, seed: int = 7) -> list[dict[str, Any]]:
    """Each record with one of ``tenants`` tenants, drawn with weights 1/rank (Zipf)."""
    rng = random.Random(seed)
    names = [f"tenant-{k:05d}" for k in range(tenants)]
    drawn = rng.choices(names, weights=[1.0 / (k + 1) for k in range(tenants)], k=len(records))
    return [{**record, "tenant": tenant} for record, tenant in zip(records, drawn, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", type=Path, help="the other checkout (e.g. a git worktree of an older commit)")
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rate", type=float, default=300.0, help="the fleet's requests/s in event time")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tenants", type=int, default=0, help="requests of this many tenants, segmented by tenant")
    args = parser.parse_args()
    records = fleet_records(args.records, rate=args.rate)
    env = None
    if args.tenants:
        records, env = with_tenants(records, args.tenants), {"SERVEWATCH_SEGMENT_DIMENSIONS": BY_TENANT}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.jsonl"
        path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
        sides = {"other": args.other.resolve(), "this": HERE}
        rates: dict[str, list[float]] = {name: [] for name in sides}
        for round_ in range(args.rounds):
            for name, checkout in sides.items():
                rate, events = replay_once(checkout, path, env)
                rates[name].append(rate)
                print(f"round {round_ + 1}: {name:5} {rate:>10,.0f} records/s, {events} events", file=sys.stderr)
    tenants = f", {args.tenants:,} tenants, segmented by tenant" if args.tenants else ""
    print(f"{args.records:,} request logs at {args.rate:,.0f}/s of event time{tenants}")
    for name, values in rates.items():
        runs = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:5} ({sides[name]}): median {statistics.median(values):,.0f}/s  [{runs}]")
    print(f"ratio this/other: {statistics.median(rates['this']) / statistics.median(rates['other']):.2f}")


if __name__ == "__main__":
    main()
