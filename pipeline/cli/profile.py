"""``servewatch profile``: a model's real request mix from its logs, as a ``WorkloadProfile``
JSON that ``servewatch loadgen`` replays.

One model: one indented JSON object. Several (no ``--model``): one profile per line. A
short summary per model goes to stderr. The statistics are ``models.workload.profile``'s.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime

from servewatch.pipeline.cli.common import CommandError, Subcommands, add_out_flag, output, read_request_logs
from servewatch.schemas.workload_profile import WorkloadProfile


def add_profile_parser(sub: Subcommands) -> None:
    p = sub.add_parser("profile", help="summarise request logs into a workload profile per model (for loadgen)")
    p.add_argument("--in", dest="input", metavar="PATH", required=True, help="JSONL request logs ('-': stdin)")
    p.add_argument("--model", help="only this model (default: every model, one profile a line)")
    add_out_flag(p, "the profile JSON")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from servewatch.models.workload.profile import WorkloadProfiler  # numpy: loaded when the command runs

    profiler = WorkloadProfiler()
    for record in read_request_logs(args.input, "profile"):
        if args.model is None or record.model == args.model:
            profiler.learn_one(record)
    profiles = list(profiler.profiles().values())
    if not profiles:
        raise CommandError("no valid request logs" + (f" of model {args.model!r}" if args.model else ""), "profile")
    try:
        with output(args.out, "w") as out:
            if len(profiles) == 1:
                out.write(profiles[0].model_dump_json(indent=2) + "\n")
            else:
                out.writelines(profile.model_dump_json() + "\n" for profile in profiles)
    except OSError as exc:
        raise CommandError(str(exc), "profile") from None
    for profile in profiles:
        print(summary(profile), file=sys.stderr)
    return 0


def _when(stamp: float) -> str:
    return datetime.fromtimestamp(stamp, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary(profile: WorkloadProfile) -> str:
    """A few lines a person reads: period and rate, lengths, sharing, finish reasons."""
    a, lengths, sharing = profile.arrivals, profile.lengths, profile.prefixes
    rates = [r for r in a.hourly_rate if r is not None]
    lines = [
        f"model {profile.model}: {profile.requests:,} requests, {_when(profile.first)} .. {_when(profile.last)}, "
        f"{_number(a.mean_rate)} req/s (hourly {_number(min(rates, default=None))} .. "
        f"{_number(max(rates, default=None))}); inter-arrival CV {_number(a.interarrival_cv)}, dispersion "
        f"{_number(a.dispersion_1s)} (1 s) {_number(a.dispersion_10s)} (10 s)"
    ]
    if lengths.prompt is not None and lengths.output is not None:
        p, o = lengths.prompt, lengths.output
        lines.append(f"  prompt tokens p50 {p.p50:,.0f} p90 {p.p90:,.0f} p99 {p.p99:,.0f}; output tokens p50 "
                     f"{o.p50:,.0f} p90 {o.p90:,.0f} p99 {o.p99:,.0f}")  # fmt: skip
    top = ", ".join(f"{s.requests:,}x {s.tokens:,} tok" for s in sharing.top[:3])
    lines.append(f"  shared prefix: {sharing.shared_share:.1%} of requests, {sharing.distinct_shared:,} prefixes"
                 + (f" (top: {top})" if top else ""))  # fmt: skip
    reasons = ", ".join(f"{reason} {share:.1%}" for reason, share in profile.finish_reasons.items())
    lines.append(f"  finish: {reasons}")
    return "\n".join(lines)
