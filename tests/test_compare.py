"""Change verification, offline. A shifted mix is not a regression; caching on is
an improvement; a lower ``max_tokens`` is a truncation regression; the CLI renders and parses."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from servewatch.models.compare import ChangeVerifier
from servewatch.pipeline.cli.main import main
from servewatch.pipeline.dev.simulator import DEFAULT_ROUTES, EPOCH, Phase, Route, Workload
from servewatch.schemas.change_report import ChangeReport

LATENCY = ("ttft_p50", "ttft_p95", "e2e_p95", "tokens_per_s_p50")


def logs(
    phase: Phase, seed: int, start: float, routes: tuple[Route, ...] = DEFAULT_ROUTES, rate: float = 12.0
) -> list[dict[str, Any]]:
    workload = Workload(phases=(phase,), models=("m",), routes=routes, base_rate=rate, seed=seed, start=start)
    return list(workload.records())


def verdicts(report: ChangeReport) -> dict[str, str]:
    return {row.signal: row.verdict for row in report.signals}


def row(report: ChangeReport, signal: str) -> Any:
    return next(r for r in report.signals if r.signal == signal)


def naive_p95_ttft(records: Sequence[dict[str, Any]]) -> float:
    return float(np.quantile([r["ttft_s"] for r in records], 0.95))


def test_a_shift_towards_long_prompts_is_not_a_regression() -> None:
    chat, rag = DEFAULT_ROUTES
    more_rag = (Route(**{**chat.__dict__, "share": 0.4}), Route(**{**rag.__dict__, "share": 0.6}))
    phase = Phase("flat", 200, prefix_caching=False)
    # ~6000 requests a side: the 5 % threshold is then well clear of sampling noise (with ~2400 a
    # side, about one seed in five shows a borderline p95 verdict: 5 signals, each a 95 % interval).
    before = logs(phase, 1, EPOCH, rate=30.0)
    after = logs(phase, 2, EPOCH + 1000, routes=more_rag, rate=30.0)
    share = [np.mean([r["route"] == "rag" for r in period]) for period in (before, after)]
    assert share[1] > 1.7 * share[0]
    assert naive_p95_ttft(after) > 1.1 * naive_p95_ttft(before)  # pooled, it looks like a regression

    (report,) = ChangeVerifier().compare(before, after)
    assert all(verdicts(report)[signal] == "no change" for signal in LATENCY), verdicts(report)
    ttft = row(report, "ttft_p95")
    assert abs(ttft.change - 1.0) < 0.05 and ttft.segments_used >= 2 and ttft.coverage_before > 0.9
    assert report.before.requests == len(before) and report.after.first is not None


def test_prefix_caching_on_improves_ttft_and_raises_the_hit_rate() -> None:
    before = logs(Phase("off", 150, prefix_caching=False), 3, EPOCH)
    after = logs(Phase("on", 150), 4, EPOCH + 1000)
    (report,) = ChangeVerifier().compare(before, after)
    assert verdicts(report)["ttft_p50"] == "improved" and verdicts(report)["ttft_p95"] == "improved"
    hits = row(report, "cache_hit_rate")
    assert hits.verdict == "improved" and hits.before == 0.0 and hits.after > 0.5 and hits.ci_low > 50
    assert row(report, "ttft_p50").ci_high < 0.95


def test_a_lower_max_tokens_is_a_truncation_regression() -> None:
    before = logs(Phase("wide", 150), 5, EPOCH)
    after = logs(Phase("narrow", 150, max_tokens=400), 6, EPOCH + 1000)
    (report,) = ChangeVerifier(seed=1).compare(before, after)
    truncation = row(report, "truncation_share")
    assert truncation.verdict == "regressed" and truncation.change > 5 and truncation.ci_low > 0
    assert verdicts(report)["error_share"] == "no change"


def test_too_few_requests_is_said_not_judged() -> None:
    before = logs(Phase("a", 5), 7, EPOCH)[:20]
    after = logs(Phase("b", 5), 8, EPOCH + 1000)[:20]
    (report,) = ChangeVerifier().compare(before, after)
    assert {r.verdict for r in report.signals} == {"insufficient data"}
    assert all(r.segments_used == 0 and r.change is None for r in report.signals)


def write(path: Path, records: Sequence[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_command_prints_a_table_and_json_parses_as_change_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = logs(Phase("off", 120, prefix_caching=False), 9, EPOCH)
    after = logs(Phase("on", 120), 10, EPOCH + 1000)
    files = ["--before", write(tmp_path / "before.jsonl", before), "--after", write(tmp_path / "after.jsonl", after)]

    assert main(["compare", *files, "--resamples", "200"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("model m: before 2026-01-01 00:00:")
    lines = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert "improved" in lines["ttft_p50"] and "%" in lines["ttft_p50"] and "[" in lines["ttft_p50"]
    assert "improved" in lines["cache_hit_rate"] and " pt [" in lines["cache_hit_rate"]

    assert main(["compare", *files, "--resamples", "200", "--format", "json"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    report = ChangeReport.model_validate_json(line)
    assert report.model == "m" and verdicts(report)["ttft_p50"] == "improved"

    # One file split at the change: the same report.
    both = write(tmp_path / "both.jsonl", before + after)
    out = tmp_path / "report.json"
    at = "2026-01-01T00:10:00Z"  # between the two periods (the first ends by 00:03)
    args = ["compare", "--in", both, "--at", at, "--resamples", "200", "--format", "json", "--out", str(out)]
    assert main(args) == 0
    assert ChangeReport.model_validate_json(out.read_text()) == report

    assert main(["compare", "--in", both]) == 2
    assert "--at" in capsys.readouterr().err
    assert main(["compare", *files, "--model", "nope"]) == 2
    assert "no requests of model 'nope'" in capsys.readouterr().err


def test_the_table_warns_when_the_two_periods_ran_at_different_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The mix is held fixed, not the load: a surge after the change is said, not hidden."""
    before = logs(Phase("flat", 120), 17, EPOCH)
    after = logs(Phase("surge", 120, traffic=3.0), 18, EPOCH + 1000)
    files = ["--before", write(tmp_path / "b.jsonl", before), "--after", write(tmp_path / "a.jsonl", after)]
    assert main(["compare", *files, "--resamples", "100"]) == 0
    assert "load differs:" in capsys.readouterr().out
