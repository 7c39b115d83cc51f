"""``servewatch loadgen``: replay a workload profile against an OpenAI-compatible server
at a rate (``--rate``, ``--duration``) or up a concurrency ramp (``--ramp``).

Every request becomes a ``RequestLog`` line on ``--out`` (tenant ``loadgen``), so servewatch
can watch the test as it watches production; the run's summary (and, for a ramp, each step
and the knee) goes to stderr. The API key, if the server wants one, is
``SERVEWATCH_LOADGEN_API_KEY``: never a flag, so it stays out of shell history.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import IO, TYPE_CHECKING

import orjson
from pydantic import ValidationError

from servewatch.models.workload.knee import DEFAULT_LEVELS, KNEE_FACTOR, StepSummary
from servewatch.pipeline.cli.common import CommandError, Progress, Subcommands, add_out_flag, load_settings, output
from servewatch.schemas.workload_profile import WorkloadProfile

if TYPE_CHECKING:  # httpx: loaded when the command runs
    from servewatch.pipeline.loadgen.client import Outcome
    from servewatch.pipeline.loadgen.run import LoadGenerator, RampReport, RunSummary


def add_loadgen_parser(sub: Subcommands) -> None:
    p = sub.add_parser("loadgen", help="replay a workload profile against an OpenAI-compatible server, logging "
                       "each request")  # fmt: skip
    p.add_argument("--profile", metavar="PATH", required=True, help="a workload profile (`servewatch profile` "
                   "writes it)")  # fmt: skip
    p.add_argument("--target", metavar="URL", required=True, help="the server's API base, e.g. http://host:8000/v1")
    p.add_argument("--model", help="model name to send (default: the profile's); picks the profile in a file of "
                   "several")  # fmt: skip
    p.add_argument("--rate", type=float, help="requests/s, sent on schedule whatever the answers take (open loop)")
    p.add_argument("--duration", default="60s", help="how long to send at --rate: 60s (default), 5m")
    p.add_argument("--ramp", nargs="?", const=",".join(map(str, DEFAULT_LEVELS)), metavar="LIST",
                   help="instead of --rate: closed-loop concurrency levels, each for --step-duration "
                   f"(default {','.join(map(str, DEFAULT_LEVELS))}); reports the knee")  # fmt: skip
    p.add_argument("--step-duration", default="30s", help="how long each --ramp level lasts (default 30s)")
    p.add_argument("--max-in-flight", type=int, default=256, help="open requests at most; an arrival beyond is "
                   "not sent, and counted (default 256)")  # fmt: skip
    p.add_argument("--api", choices=("chat", "completions"), default="chat", help="POST /chat/completions "
                   "(default) or /completions")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the requests, arrivals and prompt text (0)")
    add_out_flag(p, "a RequestLog JSON line per request")
    p.set_defaults(func=cmd_loadgen)


def _seconds(value: str, flag: str) -> float:
    from servewatch.pipeline.durations import parse_duration

    try:
        seconds = parse_duration(value)
    except ValueError:
        raise CommandError(f"{flag} {value!r}: not a duration (30s, 500ms, 5m)", "loadgen") from None
    if not seconds > 0:
        raise CommandError(f"{flag} must be above 0", "loadgen")
    return seconds


def _levels(value: str) -> list[int]:
    try:
        levels = [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        raise CommandError(f"--ramp {value!r}: not a comma-separated list of concurrencies", "loadgen") from None
    if not levels or min(levels) < 1:
        raise CommandError("--ramp needs concurrencies of 1 or more", "loadgen")
    return sorted(set(levels))


def load_profile(path: str, model: str | None) -> WorkloadProfile:
    """The profile in ``path`` (one JSON object, or one per line) to replay as ``model``."""
    try:
        with open(path, "rb") as stream:
            text = stream.read().strip()
        if b"\n{" in text:  # one profile a line (an indented object has no line starting with "{")
            documents = [orjson.loads(line) for line in text.splitlines() if line.strip()]
        else:
            documents = [orjson.loads(text)]
        profiles = [WorkloadProfile.model_validate(document) for document in documents]
    except (OSError, orjson.JSONDecodeError, ValidationError) as exc:
        raise CommandError(f"--profile {path}: {str(exc).splitlines()[0]}", "loadgen") from None
    named = [p for p in profiles if p.model == model]
    if named or len(profiles) == 1:
        return (named or profiles)[0]
    names = ", ".join(p.model for p in profiles)
    raise CommandError(f"--profile {path} holds several models ({names}): pick one with --model", "loadgen")


def cmd_loadgen(args: argparse.Namespace) -> int:
    if (args.rate is None) == (args.ramp is None):
        raise CommandError("give --rate (open loop) or --ramp (concurrency steps), one of them", "loadgen")
    if args.rate is not None and not args.rate > 0:
        raise CommandError("--rate must be above 0", "loadgen")
    if args.max_in_flight < 1:
        raise CommandError("--max-in-flight must be at least 1", "loadgen")
    if not args.target.startswith(("http://", "https://")):
        raise CommandError(f"--target {args.target!r} needs http:// or https://", "loadgen")
    duration = _seconds(args.duration, "--duration")
    step_s = _seconds(args.step_duration, "--step-duration")
    levels = _levels(args.ramp) if args.ramp is not None else []
    profile = load_profile(args.profile, args.model)

    from servewatch.models.workload.sample import WorkloadSampler
    from servewatch.pipeline.loadgen.client import Target
    from servewatch.pipeline.loadgen.run import LoadGenerator

    key = load_settings().loadgen.api_key
    target = Target(args.target, args.model or profile.model, args.api, key.get_secret_value() if key else None)
    try:
        sampler = WorkloadSampler(profile, seed=args.seed)
    except ValueError as exc:
        raise CommandError(str(exc), "loadgen") from None
    try:
        with output(args.out, "w") as out:
            writer = _Writer(out)
            generator = LoadGenerator(target, sampler, seed=args.seed, max_in_flight=args.max_in_flight,
                                      on_outcome=writer.write)  # fmt: skip
            if levels:
                report = asyncio.run(_ramp(generator, levels, step_s, writer.progress))
                writer.progress.done()
                print(_knee_line(report), file=sys.stderr)
            else:
                summary = asyncio.run(_open_loop(generator, args.rate, duration))
                writer.progress.done()
                print(_run_line(summary, args.rate), file=sys.stderr)
    except OSError as exc:
        raise CommandError(str(exc), "loadgen") from None
    return 0 if writer.ok else 1  # every request failed: the target is down or refuses us


class _Writer:
    """Writes each request's log line; keeps a progress line (on a terminal) and the counts."""

    def __init__(self, out: IO[str]) -> None:
        self.out, self.progress = out, Progress()
        self.done = self.errors = 0
        self._shown = 0.0

    @property
    def ok(self) -> bool:
        return self.done > self.errors

    def write(self, outcome: Outcome) -> None:
        self.out.write(outcome.log.model_dump_json(exclude_none=True) + "\n")
        self.done += 1
        self.errors += outcome.log.finish_reason == "error"
        if time.monotonic() - self._shown > 0.5:
            self._shown = time.monotonic()
            self.progress.show(f"loadgen: {self.done:,} requests done, {self.errors:,} failed")


async def _open_loop(generator: LoadGenerator, rate: float, duration: float) -> RunSummary:
    async with generator:
        return await generator.open_loop(rate, duration)


async def _ramp(generator: LoadGenerator, levels: list[int], step_s: float, progress: Progress) -> RampReport:
    print(_step_line(None), file=sys.stderr)

    def show(step: StepSummary) -> None:
        progress.done()
        print(_step_line(step), file=sys.stderr)

    async with generator:
        return await generator.ramp(levels, step_s, KNEE_FACTOR, on_step=show)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.1f} ms"


def _step_line(step: StepSummary | None) -> str:
    if step is None:
        return f"{'concurrency':>11}  {'requests':>8}  {'errors':>6}  {'tok/s':>9}  {'TTFT p50':>10}  " \
               f"{'TTFT p95':>10}  {'ITL p50':>9}"  # fmt: skip
    return (f"{step.concurrency:>11}  {step.requests:>8,}  {step.errors:>6,}  {step.output_tokens_per_s:>9,.0f}  "
            f"{_ms(step.ttft_p50):>10}  {_ms(step.ttft_p95):>10}  {_ms(step.itl_p50):>9}")  # fmt: skip


#: Below this many answered requests in a step, its p95 is close to its maximum: say so.
_STEADY_REQUESTS = 20


def _knee_line(report: RampReport) -> str:
    bend = f"p95 TTFT or p50 ITL above {report.factor:g}x the lowest level's"
    if report.knee is None:
        line = f"knee: not found up to concurrency {report.steps[-1].concurrency} (no step's {bend})"
    else:
        line = f"knee: concurrency {report.knee} (the next level's {bend})"
    fewest = min(step.requests - step.errors for step in report.steps)
    if fewest < _STEADY_REQUESTS:
        line += f"; a step had only {fewest} answered requests: a longer --step-duration gives a steadier p95"
    return line


def _run_line(summary: RunSummary, rate: float) -> str:
    s = summary.stats
    line = (f"loadgen: {s.requests:,} requests ({s.errors:,} failed) in {s.seconds:.1f} s at {rate:g}/s; TTFT p50 "
            f"{_ms(s.ttft_p50)} p95 {_ms(s.ttft_p95)}, ITL p50 {_ms(s.itl_p50)}, {s.output_tokens_per_s:,.0f} "
            "output tok/s")  # fmt: skip
    if summary.shed:
        line += f"; {summary.shed:,} arrivals not sent (--max-in-flight reached)"
    if summary.late_s > 1.0:
        line += f"; sends fell up to {summary.late_s:.1f} s behind schedule (this machine is the bottleneck)"
    return line
