"""Scale: memory and per-window CPU as the number of live segments grows.

    python -m bench.scale [--segments 10 100 1000 10000] [--windows 30] [--partitions 4]

Each size runs in a fresh process: the worker's stream logic (stage 1 over its input
partitions, bundles of partials as sent over the partials topic, stage 2 and the detectors;
no broker) is fed ``--windows`` windows of traffic spread over N distinct segments (one
route each) and over every input partition, then the process reports its RSS growth over a
baseline taken after imports, and the stage-2 CPU time one window costs per segment.

Memory per segment is the slope of RSS against live segments, fitted over the rows with at
least 1,000 of them. Small rows overstate it: part of what a process holds is a fixed cost
that a few hundred segments already reach (bundles of at most 256 segments per message,
the allocator's 1 MiB arenas), so RSS divided by live segments only falls towards the
slope as segments grow. For these rows the
cap is raised to ``--max-segments``. A last row offers twice the worker's default cap
(``max_segments``, 1,000): new segments past it share one overflow segment, so memory
stops growing.
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

import numpy as np
import orjson

from servewatch.pipeline.setting_groups import SegmentSettings
from servewatch.pipeline.settings import Settings

T0 = 1_767_225_600.0
PER_SEGMENT_PER_WINDOW = 8
#: The per-segment slope is fitted over rows with at least this many live segments.
FIT_FROM = 1000


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


#: What ``--records full`` adds to each request log: every phase timing, a prefix hash and
#: the answer text, so that all eleven request-log signals of a segment have a model.
FULL_FIELDS = {"queue_s": 0.01, "prefill_s": 0.15, "decode_s": 0.8, "prefix_hash": "sys-v1", "content": "ok"}


def batches(segments: int, windows: int, partitions: int = 1, full: bool = False) -> Iterator[tuple[int, bytes]]:
    """Per window, PER_SEGMENT_PER_WINDOW requests for each segment, in messages of 500.

    Built one message at a time: a whole window of rows held at once would be the largest
    thing in the process and would show up as the worker's memory.
    """
    for w in range(windows):
        rows = (
            {"request_id": f"{w}-{s}-{i}", "timestamp": T0 + w * 10 + i, "model": "m", "route": f"r{s}",
             "prompt_tokens": 800, "completion_tokens": 100, "e2e_s": 1.0, "ttft_s": 0.2 + 0.01 * i,
             "cached_tokens": 400, "finish_reason": "stop", **(FULL_FIELDS if full else {})}
            for s in range(segments) for i in range(PER_SEGMENT_PER_WINDOW)
        )  # fmt: skip
        while chunk := list(itertools.islice(rows, 500 * partitions)):  # shipper-sized messages
            # Record i goes to partition i % partitions: every segment's traffic reaches
            # every input partition, as when each serving instance has its own shipper.
            for partition in range(partitions):
                yield partition, orjson.dumps(chunk[partition::partitions])


def child(segments: int, windows: int, partitions: int, max_segments: int, full: bool) -> dict[str, float]:
    from servewatch.pipeline.messages.origin import MessageOrigin
    from servewatch.pipeline.tuning import trim_heap, tune_process
    from servewatch.pipeline.worker.stage_one import StageOne
    from servewatch.pipeline.worker.stage_two import StageTwo

    tune_process()  # as `servewatch worker` does
    settings = Settings(
        allowed_lateness_s=0.0, max_lateness_s=0.0, topic_partitions=partitions, max_segments=max_segments
    )
    one, two = StageOne(settings), StageTwo(settings)
    for offset, (partition, raw) in enumerate(batches(10, 3, partitions)):  # warm up allocators, lazy imports
        StageOne(settings).process(raw, MessageOrigin("warm", partition, offset), now=0.0)
    gc.collect()
    trim_heap()  # the worker trims its heap every few seconds from the start
    base = rss_kib()
    stage_two_cpu = 0.0
    for offset, (partition, raw) in enumerate(batches(segments, windows, partitions, full)):
        _, partials = one.process(raw, MessageOrigin("bench", partition, offset), now=0.0)
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
    untrimmed = rss_kib() - base  # the worker's RSS just before one of its heap trims
    trim_heap()  # what its timer does every heap_trim_interval_s
    grown = rss_kib() - base
    return {
        "segments": segments,
        "live": live,
        "overflowed_records": one.overflowed_records,
        "rss_growth_kib": grown,
        "untrimmed_growth_kib": untrimmed,
        "kib_per_live_segment": grown / max(live, 1),
        "stage_two_us_per_segment_window": stage_two_cpu / max(two.bank.windows_judged, 1) * 1e6,
        "late_partials": two.assembler.late_partials,
        "signals_per_segment": sum(len(d.layout.signals) for d in two.bank.detectors.values()) / max(live, 1),
    }


def run_child(segments: int, windows: int, partitions: int, max_segments: int, records: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--child", str(segments), "--windows", str(windows),
         "--partitions", str(partitions), "--max-segments", str(max_segments), "--records", records],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def per_segment_slope(rows: list[dict[str, float]], growth: str = "rss_growth_kib") -> tuple[float, float] | None:
    """Least-squares (KiB per live segment, fixed base in MiB) over rows with ≥ FIT_FROM live segments."""
    fitted = [r for r in rows if r["live"] >= FIT_FROM]
    if len(fitted) < 2:
        return None
    slope, base = np.polyfit([r["live"] for r in fitted], [r[growth] for r in fitted], 1)
    return float(slope), float(base) / 1024


def print_row(r: dict[str, float], note: str) -> None:
    print(f"{r['segments']:9,} {r['live']:6,} {r['overflowed_records']:11,} {r['rss_growth_kib'] / 1024:9.1f}MB "
          f"{r['kib_per_live_segment']:12.2f}KiB {r['stage_two_us_per_segment_window']:26.0f}µs  {note}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, nargs="+", default=[10, 100, 1000, 5000, 10000])
    parser.add_argument("--windows", type=int, default=30)
    parser.add_argument("--partitions", type=int, default=4, help="input partitions the worker reads (its default: 4)")
    parser.add_argument("--max-segments", type=int, default=20_000, help="cap for the memory rows")
    parser.add_argument("--records", choices=("lean", "full"), default="lean",
                        help="lean: TTFT, e2e, tokens, cached tokens, finish reason (6 signals with a model); "
                             "full: every phase timing, prefix hash and answer text too (all 11)")  # fmt: skip
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.windows, args.partitions, args.max_segments, args.records == "full")))
        return
    default_cap = SegmentSettings.model_fields["max_segments"].default
    print(f"{'segments':>9} {'live':>6} {'overflowed':>11} {'RSS growth':>11} {'growth / live':>15} "
          f"{'stage-2 CPU / segment window':>29}")  # fmt: skip
    rows = []
    for n in args.segments:
        rows.append(run_child(n, args.windows, args.partitions, args.max_segments, args.records))
        print_row(rows[-1], f"cap {args.max_segments:,}")
    capped = run_child(2 * default_cap, args.windows, args.partitions, default_cap, args.records)
    held = capped["live"] <= default_cap + 1  # the cap's segments plus the overflow segment
    print_row(capped, f"cap {default_cap:,} (the default): {'capped' if held else 'NOT CAPPED'}")
    print()
    fit, untrimmed = per_segment_slope(rows), per_segment_slope(rows, "untrimmed_growth_kib")
    if fit is not None and untrimmed is not None:
        print(f"RSS per live segment: {fit[0]:.2f} KiB beyond a fixed base of {fit[1]:.1f} MB "
              f"(least squares over the rows with ≥ {FIT_FROM:,} live segments)")  # fmt: skip
        print(f"  measured after a heap trim, as the worker's RSS is every heap_trim_interval_s; just before one: "
              f"{untrimmed[0]:.2f} KiB")  # fmt: skip
    print("RSS growth: over a baseline taken after imports and a warm-up; it includes the segmenter, the")
    print("windows in flight and the detectors. Small rows are dominated by fixed costs (bundles of at most")
    print("256 segments, 1 MiB allocator arenas): the slope is the cost of one more live segment.")
    signals = rows[-1]["signals_per_segment"]
    print(f"Input partitions: {args.partitions}, every segment's traffic spread over all of them. Records: "
          f"{args.records}, {signals:.0f} signals with a model per segment. Stage-2 CPU:")  # fmt: skip
    print("decoding bundles of partials, merging them and judging, per segment window.")


if __name__ == "__main__":
    main()
