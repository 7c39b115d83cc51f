"""``servewatch backtest-series``: one exported series scored by a signal's model, no look-ahead."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator
from typing import Literal

from servewatch.pipeline.cli.common import Subcommands, add_out_flag, output, settings_from


def _series_timestamp(text: str) -> float:
    """Unix seconds, unix milliseconds (Grafana's CSV export) or ISO-8601."""
    from datetime import UTC, datetime

    try:
        value = float(text)
    except ValueError:
        parsed = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
    return value / 1000.0 if value > 1e11 else value


def _series_columns(
    path: str, fieldnames: list[str], time_column: str | None, value_column: str | None
) -> tuple[str, str]:
    """The time and value columns of an export: as given, else ``timestamp``/``time`` and
    ``value`` or the one other column (a Grafana export: ``time`` and the series' name)."""
    by_name = {name.strip().lower(): name for name in fieldnames}
    from servewatch.models.detect.backtest_series import LOAD_COLUMNS

    def pick(given: str | None, candidates: tuple[str, ...], what: str) -> str:
        if given is not None:
            if given.strip().lower() not in by_name:
                raise ValueError(f"{path}: no column {given!r} for {what}; columns are {fieldnames}")
            return by_name[given.strip().lower()]
        for name in candidates:
            if name in by_name:
                return by_name[name]
        raise ValueError(f"{path}: no {what} column among {fieldnames}; name it with --{what}-column")

    time_name = pick(time_column, ("timestamp", "time"), "time")
    known = {time_name.strip().lower(), *LOAD_COLUMNS, "trials"}
    others = tuple(name for name in by_name if name not in known)
    value_name = pick(value_column, ("value",) if "value" in by_name else others[:1] if len(others) == 1 else (),
                      "value")  # fmt: skip
    return time_name, value_name


def _read_series(
    path: str, time_column: str | None = None, value_column: str | None = None
) -> Iterator[dict[str, float]]:
    import csv

    from servewatch.models.detect.backtest_series import LOAD_COLUMNS

    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        fieldnames = list(reader.fieldnames or [])
        time_name, value_name = _series_columns(path, fieldnames, time_column, value_column)
        columns = {name.strip().lower(): name for name in fieldnames}
        optional = [name for name in (*LOAD_COLUMNS, "trials") if name in columns]
        for line, row in enumerate(reader, start=2):
            try:
                point = {"timestamp": _series_timestamp(row[time_name]), "value": float(row[value_name] or "nan")}
                for name in optional:
                    if row[columns[name]] not in (None, ""):
                        point[name] = float(row[columns[name]])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from None
            if math.isfinite(point["value"]):  # gaps in an export: skipped, not scored
                yield point


def _as_counts(points: list[dict[str, float]], kind: str, trials: int | None, path: str) -> None:
    """A rate series' values as counts of bad requests out of ``trials``, in place."""
    for point in points:
        n = point.get("trials", trials)
        if kind == "ratio":
            if n is None:
                raise ValueError(f"{path}: a ratio needs its requests: a 'trials' column or --trials N")
            if not 0.0 <= point["value"] <= 1.0:
                raise ValueError(f"{path}: ratio {point['value']} outside [0, 1] (percentages: divide by 100)")
            point["value"], point["trials"] = round(point["value"] * n), n
        else:
            if point["value"] != int(point["value"]):
                raise ValueError(f"{path}: {point['value']} is not a count of requests; for an error ratio pass "
                                 "--value-kind ratio (with --trials N or a trials column)")  # fmt: skip
            if n is not None:
                point["trials"] = n


def judged_by_load(points: list[dict[str, float]]) -> bool:
    """Whether the export has load columns (on any row): they condition latency on demand;
    without them a series is judged by its own recent level (``SeriesLevel``)."""
    from servewatch.models.detect.backtest_series import LOAD_COLUMNS

    return any(name in point for point in points for name in LOAD_COLUMNS)


def cmd_backtest_series(args: argparse.Namespace) -> int:
    """Score one exported series with a signal's model and its incident lifecycle, no look-ahead."""
    import csv

    from servewatch.models.detect.backtest_series import score_series
    from servewatch.models.detect.signals import BY_SIGNAL
    from servewatch.schemas.anomaly import Signal

    settings = settings_from(args)
    try:
        if args.signal not in {s.value for s in Signal} or Signal(args.signal) not in BY_SIGNAL:
            valid = ", ".join(sorted(s.value for s in BY_SIGNAL))
            raise ValueError(f"unknown --signal {args.signal!r}; one of {valid}")
        signal = Signal(args.signal)
        points = list(_read_series(args.input, args.time_column, args.value_column))
        if BY_SIGNAL[signal].kind == "rate":
            _as_counts(points, args.value_kind, args.trials, args.input)
    except (OSError, ValueError) as exc:
        print(f"servewatch backtest-series: {exc}", file=sys.stderr)
        return 2
    points.sort(key=lambda p: p["timestamp"])
    loaded = judged_by_load(points)
    model: Literal["load", "series"] = "load" if loaded else "series"
    pages = 0
    with output(args.out, "w") as out:
        writer = csv.writer(out)
        writer.writerow(["timestamp", "value", "anomaly_score", "is_anomaly", "status", "explained_by_load"])
        for p in score_series(
            points, signal, settings.detection.threshold, settings.detection.grace_windows, model=model
        ):
            writer.writerow([f"{p.timestamp:.3f}", p.value, p.anomaly_score, str(p.is_anomaly).lower(), p.status,
                             str(p.explained_by_load).lower()])  # fmt: skip
            pages += p.is_anomaly
    how = ""
    if BY_SIGNAL[signal].kind == "latency":
        how = " (conditioned on its load columns)" if loaded else " (against its own recent level: no load columns)"
    print(f"scored {len(points):,} points with the {signal.value} model{how}: {pages:,} pages (incidents starting "
          f"or stepping up; threshold {settings.detection.threshold})", file=sys.stderr)  # fmt: skip
    return 0


def add_backtest_parser(sub: Subcommands) -> None:
    p = sub.add_parser(
        "backtest-series", help="score one exported series (timestamp,value[,load columns]) with a signal's model"
    )
    p.add_argument("--in", dest="input", metavar="PATH", required=True, help="CSV with a time and a value column, "
                   "and optional load columns (requests_per_s, prompt_tokens_per_s, output_tokens_per_s) or "
                   "trials")  # fmt: skip
    add_out_flag(p, "the scored series as CSV")
    p.add_argument("--signal", default="ttft", help="whose model to use: ttft, itl, error_rate, cache_hit_rate, ...")
    p.add_argument("--time-column", help="the time column (default: timestamp or time; Grafana exports 'time')")
    p.add_argument("--value-column", help="the value column (default: value, or the one other column)")
    p.add_argument("--value-kind", choices=("count", "ratio"), default="count",
                   help="rate signals: bad requests per point (count) or their share (ratio)")  # fmt: skip
    p.add_argument("--trials", type=int, help="rate signals: requests per point, where there is no trials column")
    p.set_defaults(func=cmd_backtest_series)
