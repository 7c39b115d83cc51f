"""Scale: memory and per-window CPU as the number of live segments grows.

    python bench/scale.py [--segments 10 100 1000 10000] [--windows 30] [--partitions 4]

Each size runs in a fresh process: the worker's stream logic (stage 1 per input partition,
bundles of partials as sent over the partials topic, stage 2 and the detectors; no broker)
is fed ``--windows`` windows of traffic spread over N distinct segments (one route each)
and over every input partition, then the process reports its RSS growth over a baseline
taken after imports, divided by the live segments, and the stage-2 CPU time one window
costs per segment. Past ``max_segments`` (default 1,000) new segments share one overflow segment,
so memory stops growing: the cardinality cap at work.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

T0 = 1_767_225_600.0
PER_SEGMENT_PER_WINDOW = 8


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def batches(segments: int, windows: int, partitions: int = 1) -> Iterator[tuple[int, bytes]]:
    """Per window, PER_SEGMENT_PER_WINDOW requests for each segment, in messages of 500.

    Built one message at a time: a whole window of rows held at once would be the largest
    thing in the process and would show up as the worker's memory.
    """
    for w in range(windows):
        rows = (
            {"request_id": f"{w}-{s}-{i}", "timestamp": T0 + w * 10 + i, "model": "m", "route": f"r{s}",
             "prompt_tokens": 800, "completion_tokens": 100, "e2e_s": 1.0, "ttft_s": 0.2 + 0.01 * i,
             "cached_tokens": 400, "finish_reason": "stop"}
            for s in range(segments) for i in range(PER_SEGMENT_PER_WINDOW)
        )  # fmt: skip
        while chunk := list(itertools.islice(rows, 500 * partitions)):  # shipper-sized messages
            # Record i goes to partition i % partitions: every segment's traffic reaches
            # every input partition, as when each serving instance has its own shipper.
            for partition in range(partitions):
                yield partition, orjson.dumps(chunk[partition::partitions])


def child(segments: int, windows: int, partitions: int) -> dict[str, float]:
    from pipeline.decode import Source
    from pipeline.settings import Settings
    from pipeline.stages import StageOne, StageTwo
    from pipeline.tuning import tune_process

    tune_process()  # as `servewatch worker` does
    settings = Settings(allowed_lateness_s=0.0, topic_partitions=partitions)
    one, two = StageOne(settings), StageTwo(settings)
    for offset, (partition, raw) in enumerate(batches(10, 3, partitions)):  # warm up allocators, lazy imports
        StageOne(settings).process(raw, Source("warm", partition, offset), now=0.0)
    gc.collect()
    base = rss_kib()
    stage_two_cpu = 0.0
    for offset, (partition, raw) in enumerate(batches(segments, windows, partitions)):
        _, partials = one.process(raw, Source("bench", partition, offset), now=0.0)
        # As in the worker: bundles of partials per partials partition, watermarks last.
        bundles = one.bundles(partials, partitions)
        partials = None  # type: ignore[assignment]  # a partial holds its whole window's table
        started = time.process_time()
        for via, bundle in bundles:
            two.receive(bundle, via=via, now=0.0)
        stage_two_cpu += time.process_time() - started
    bundles = bundle = None  # type: ignore[assignment]  # the bench's own references
    two.release_all()
    raw = None  # type: ignore[assignment]  # the bench's own last message is not the worker's memory
    gc.collect()
    live = len(two.bank.detectors)
    grown = rss_kib() - base
    return {
        "segments": segments,
        "live": live,
        "overflowed_records": one.overflowed_records,
        "rss_growth_kib": grown,
        "kib_per_live_segment": grown / max(live, 1),
        "stage_two_us_per_segment_window": stage_two_cpu / max(two.bank.windows_judged, 1) * 1e6,
        "late_partials": two.assembler.late_partials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--partitions", type=int, default=4, help="input partitions the worker reads (its default: 4)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.windows, args.partitions)))
        return
    print(f"{'segments':>9} {'live':>6} {'overflowed':>11} {'RSS growth':>11} {'per added segment':>17} "
          f"{'stage-2 CPU / segment window':>29}")  # fmt: skip
    previous: dict[str, float] | None = None
    for n in args.segments:
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(n), "--windows", str(args.windows),
             "--partitions", str(args.partitions)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        slope = "-"
        if previous is not None and r["live"] == previous["live"] + 1:
            slope = "capped"
        elif previous is not None and r["live"] > previous["live"]:
            per = (r["rss_growth_kib"] - previous["rss_growth_kib"]) / (r["live"] - previous["live"])
            slope = f"{per:.2f}KiB"
        print(f"{r['segments']:9,} {r['live']:6,} {r['overflowed_records']:11,} {r['rss_growth_kib'] / 1024:9.1f}MB "
              f"{slope:>17} {r['stage_two_us_per_segment_window']:26.0f}µs")  # fmt: skip
        previous = r
    print()
    print("RSS growth: over a baseline taken after imports and a warm-up; it includes the segmenter, the")
    print("windows in flight and the detectors. 'per added segment': growth between this row and the one")
    print("above, divided by the live segments added. Cap: max_segments (SERVEWATCH_MAX_SEGMENTS), 1,000.")
    print(f"Input partitions: {args.partitions}, every segment's traffic spread over all of them. Stage-2 CPU:")
    print("decoding bundles of partials, merging them and judging, per segment window.")


if __name__ == "__main__":
    main()
