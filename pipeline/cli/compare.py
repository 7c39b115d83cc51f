"""``servewatch compare``: did a change help or hurt? The requests after a marker against
those before it, per model and signal, reweighted to the same segment mix.

Two files (``--before``, ``--after``), or one file split at a time (``--in``, ``--at``). The
verdicts come from ``models.compare``; this module reads the files and renders the table.
"""

from __future__ import annotations

import argparse
from typing import IO

from servewatch.pipeline.changes.render import render
from servewatch.pipeline.cli.common import (
    CommandError,
    Subcommands,
    add_out_flag,
    output,
    parse_time,
    read_request_logs,
)
from servewatch.schemas.change_report import ChangeReport


def add_compare_parser(sub: Subcommands) -> None:
    p = sub.add_parser("compare", help="verify a change: requests after a marker against those before, per signal")
    p.add_argument("--before", metavar="PATH", help="JSONL request logs of the period before the change")
    p.add_argument("--after", metavar="PATH", help="JSONL request logs of the period after the change")
    p.add_argument("--in", dest="input", metavar="PATH", help="one JSONL file of request logs, split at --at "
                   "('-': stdin)")  # fmt: skip
    p.add_argument("--at", metavar="TIME", help="the change's time with --in: ISO-8601 (UTC unless a zone is given) "
                   "or unix seconds; requests finished before it are the period before")  # fmt: skip
    p.add_argument("--model", help="only this model (default: every model)")
    p.add_argument("--format", choices=("text", "json"), default="text", help="a table per model (default) or a "
                   "ChangeReport JSON object per model, one a line")  # fmt: skip
    add_out_flag(p, "the report")
    p.add_argument("--min-requests", type=int, default=30, help="requests a segment needs on both sides (30)")
    p.add_argument("--resamples", type=int, default=500, help="bootstrap resamples (500)")
    p.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (0)")
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    if args.min_requests < 1 or args.resamples < 1:
        raise CommandError("--min-requests and --resamples must be at least 1", "compare")
    if args.input is not None:
        if args.before or args.after or args.at is None:
            raise CommandError("give --in with --at, or --before and --after (not both)", "compare")
        at = parse_time(args.at, "compare")
        records = list(read_request_logs(args.input, "compare"))
        before = [r for r in records if r.timestamp < at]
        after = [r for r in records if r.timestamp >= at]
    else:
        if not (args.before and args.after) or args.at is not None:
            raise CommandError("give --before and --after (or --in and --at)", "compare")
        before, after = list(read_request_logs(args.before, "compare")), list(read_request_logs(args.after, "compare"))
    for name, period in (("before", before), ("after", after)):
        if not period:
            raise CommandError(f"no valid request logs in the period {name}", "compare")
    from servewatch.models.compare.report import ChangeVerifier  # numpy: loaded when the command runs

    verifier = ChangeVerifier(min_requests=args.min_requests, resamples=args.resamples, seed=args.seed)
    reports = verifier.compare(before, after, model=args.model)
    if not reports:
        raise CommandError(f"no requests of model {args.model!r}", "compare")
    try:
        with output(args.out, "w") as out:
            _write(out, reports, args.format)
    except OSError as exc:
        raise CommandError(str(exc), "compare") from None
    return 0


def _write(out: IO[str], reports: list[ChangeReport], form: str) -> None:
    if form == "json":
        for report in reports:
            out.write(report.model_dump_json() + "\n")
        return
    out.write("\n\n".join(render(report) for report in reports) + "\n")


__all__ = ["add_compare_parser", "render"]
