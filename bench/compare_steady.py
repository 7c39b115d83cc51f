"""``servewatch compare`` on traffic that did not change, and on changes that did.

Three tables, every request from the trace-driven fleet simulation (real arrival traces
through slot-limited engines, ``pipeline/dev/serving_sim.py``):

* **slices**: half an hour of a model at its usual load against half an hour of the same
  service at 0.6x the arrivals from another stretch of its trace, with fewer prompts on a
  shared prefix (system prompts shared by 80 % then 50 % of requests, where the trace has
  no prefixes of its own). Per model: reports with any ``regressed``/``improved`` verdict.
* **hours**: each of several hours of a simulated day (the pager fleet with its daily
  cycle) against the hour after it, per model. Nothing changed; every verdict is false.
* **changes**: half an hour as usual, then half an hour with the prefix cache off, decode
  2x or 1.3x slower, or TTFT 1.3x, on one trace split at the change: how often each
  expected signal is ``regressed``.

``--raw`` compares on segments only (load and cache eligibility not held fixed).

    .venv/bin/python -m bench.compare_steady [--seeds 20] [--raw]
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import replace
from typing import Any

from servewatch.models.compare import ChangeVerifier
from servewatch.pipeline.dev.serving_sim import (
    LOW_VOLUME_MODEL,
    PAGER_CHAT_MODEL,
    PAGER_CODE_MODEL,
    PAGER_FLEET,
    ModelSpec,
    SimPhase,
    TraceWorkload,
)
from servewatch.pipeline.dev.traffic_cycles import cycle_phases
from servewatch.schemas.change_report import ChangeReport

HALF_HOUR = 1800.0
#: The Azure chat trace on two engines at 60 % occupancy: its bursts fill the slots often.
BUSY_CHAT = replace(
    LOW_VOLUME_MODEL, name="qwen3-8b-busy", utilisation=0.6, instances=2,
    error_rate=PAGER_CODE_MODEL.error_rate, truncation_rate=PAGER_CODE_MODEL.truncation_rate,
)  # fmt: skip
MODELS = (PAGER_CODE_MODEL, PAGER_CHAT_MODEL, BUSY_CHAT)
CHANGES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "prefix cache off": ({"prefix_caching": False}, ("ttft_p50", "cache_hit_rate")),
    "decode 2x slower": ({"decode_slowdown": 2.0}, ("itl_p50", "tokens_per_s_p50")),
    "decode 1.3x slower": ({"decode_slowdown": 1.3}, ("itl_p50", "tokens_per_s_p50")),
    "TTFT 1.3x": ({"ttft_factor": 1.3}, ("ttft_p95",)),
}
MOVED = ("regressed", "improved")


def verdicts(report: ChangeReport) -> collections.Counter[str]:
    return collections.Counter(row.verdict for row in report.signals)


def slices(spec: ModelSpec, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    before = list(TraceWorkload(phases=(SimPhase("usual", HALF_HOUR),),
                                models=(replace(spec, system_prompt_share=0.8),), seed=seed).records())  # fmt: skip
    after = list(TraceWorkload(phases=(SimPhase("quieter", HALF_HOUR, traffic=0.6),),
                               models=(replace(spec, system_prompt_share=0.5),), seed=1000 + seed,
                               start=before[-1]["timestamp"] + 1.0).records())  # fmt: skip
    return before, after


def split(rows: list[dict[str, Any]], at: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Requests that arrived before ``at``, and after it."""
    before = [row for row in rows if row["timestamp"] - row["e2e_s"] < at]
    return before, [row for row in rows if row["timestamp"] - row["e2e_s"] >= at]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds per model for the slices (5 for the changes)")
    parser.add_argument("--days", type=int, default=3, help="simulated days for the hours")
    parser.add_argument("--raw", action="store_true", help="segments only: load and cache eligibility not held")
    args = parser.parse_args(argv)

    def verifier(seed: int) -> ChangeVerifier:
        if "hold_traffic" not in ChangeVerifier.__dataclass_fields__:  # a checkout from before it existed
            return ChangeVerifier(seed=seed)
        return ChangeVerifier(seed=seed, hold_traffic=not args.raw)

    print(f"slices: usual half hour against 0.6x the arrivals and less prefix reuse, {args.seeds} seeds")
    print(f"  {'model':<22} {'reports with a verdict':>24}  verdicts over all signals")
    for spec in MODELS:
        counts: collections.Counter[str] = collections.Counter()
        moved = 0
        for seed in range(args.seeds):
            (report,) = verifier(seed).compare(*slices(spec, seed))
            said = verdicts(report)
            counts += said
            moved += any(said[v] for v in MOVED)
        print(f"  {spec.name:<22} {f'{moved} / {args.seeds}':>24}  {dict(sorted(counts.items()))}", flush=True)

    hours = (2, 8, 12, 18, 21)
    print(f"hours: hour h against hour h+1 of a simulated day (h = {', '.join(map(str, hours))}), {args.days} days")
    found: list[str] = []
    total = 0
    for day in range(1, args.days + 1):
        workload = TraceWorkload(phases=cycle_phases(86_400.0), models=PAGER_FLEET, seed=day)
        rows = list(workload.records())
        for hour in hours:
            for spec in PAGER_FLEET:
                first = workload.start + hour * 3600.0
                mine = [row for row in rows if row["model"] == spec.name and first <= row["timestamp"] < first + 7200]
                before = [row for row in mine if row["timestamp"] < first + 3600]
                after = [row for row in mine if row["timestamp"] >= first + 3600]
                (report,) = verifier(day).compare(before, after)
                total += 1
                found += [f"day {day} hour {hour} {spec.name}: {row.signal} {row.verdict}"
                          for row in report.signals if row.verdict in MOVED]  # fmt: skip
    print(f"  {len(found)} verdicts in {total} reports")
    for line in found:
        print(f"    {line}")

    changes = max(1, min(args.seeds, 5))
    print(f"changes: half an hour as usual, then half an hour changed, {changes} seeds: expected signals regressed")
    for spec in (PAGER_CODE_MODEL, PAGER_CHAT_MODEL):
        for name, (condition, expected) in CHANGES.items():
            hits: collections.Counter[str] = collections.Counter()
            wrong = 0
            for seed in range(changes):
                phases = (SimPhase("usual", HALF_HOUR), SimPhase(name, HALF_HOUR, **condition))
                workload = TraceWorkload(phases=phases, models=(spec,), seed=seed)
                (report,) = verifier(seed).compare(*split(list(workload.records()), workload.start + HALF_HOUR))
                by_signal = {row.signal: row.verdict for row in report.signals}
                hits.update(signal for signal in expected if by_signal.get(signal) == "regressed")
                wrong += sum(row.verdict == "improved" for row in report.signals)
            cells = ", ".join(f"{signal} {hits[signal]}/{changes}" for signal in expected)
            print(f"  {spec.name:<22} {name:<20} {cells}; 'improved' anywhere: {wrong}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
