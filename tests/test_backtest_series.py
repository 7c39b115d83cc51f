"""``servewatch backtest-series``: an exported series in, scores out, no look-ahead."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

import pytest

from models.series import score_series
from pipeline.cli import main
from schemas.anomaly import Signal


def write_series(path: Path, values: list[float], *, ms: bool = False, load: list[float] | None = None) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["timestamp", "value", *(["requests_per_s"] if load else [])])
        for i, value in enumerate(values):
            t = 1_767_225_600 + 60 * i
            writer.writerow([t * 1000 if ms else t, value, *([load[i]] if load else [])])


def read_scores(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def ttft_series(seed: int = 1, n: int = 200) -> list[float]:
    rng = random.Random(seed)
    return [0.8 * math.exp(rng.gauss(0, 0.08)) for _ in range(n)]


def test_a_step_in_the_series_is_flagged_and_the_flat_part_is_not(tmp_path: Path) -> None:
    values = ttft_series()
    values[150:160] = [v * 6 for v in values[150:160]]
    write_series(tmp_path / "in.csv", values, ms=True)  # Grafana exports milliseconds
    assert main(["backtest-series", "--in", str(tmp_path / "in.csv"), "--out", str(tmp_path / "out.csv")]) == 0
    rows = read_scores(tmp_path / "out.csv")
    assert list(rows[0]) == ["timestamp", "value", "anomaly_score", "is_anomaly"]
    flagged = [i for i, row in enumerate(rows) if row["is_anomaly"] == "true"]
    assert set(range(150, 160)) <= set(flagged) and len(flagged) <= 12
    assert float(rows[0]["timestamp"]) == 1_767_225_600


def test_load_columns_explain_a_rise_that_follows_demand(tmp_path: Path) -> None:
    values, load = ttft_series(), [10.0] * 200
    for i in range(150, 160):
        values[i], load[i] = values[i] * 2.5, 30.0  # 3x demand, 2.5x latency
    write_series(tmp_path / "in.csv", values, load=load)
    assert main(["backtest-series", "--in", str(tmp_path / "in.csv"), "--out", str(tmp_path / "out.csv")]) == 0
    assert not [row for row in read_scores(tmp_path / "out.csv") if row["is_anomaly"] == "true"]


def test_no_look_ahead() -> None:
    points = [{"timestamp": i, "value": v} for i, v in enumerate(ttft_series(seed=3))]
    full = list(score_series(points, Signal.TTFT))
    assert list(score_series(points[:120], Signal.TTFT)) == full[:120]


def test_rate_series_use_trials_and_count_aware_scores() -> None:
    points = [{"timestamp": i, "value": 1, "trials": 1000} for i in range(50)]
    points += [{"timestamp": 50, "value": 1, "trials": 3}, {"timestamp": 51, "value": 30, "trials": 1000}]
    scored = list(score_series(points, Signal.ERROR_RATE))
    assert not scored[50].is_anomaly and scored[51].is_anomaly


def test_a_bad_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.csv").write_text("time,latency\n1,2\n")
    assert main(["backtest-series", "--in", str(tmp_path / "bad.csv")]) == 2
    assert "needs 'timestamp' and 'value'" in capsys.readouterr().err
    (tmp_path / "worse.csv").write_text("timestamp,value\n1767225600,abc\n")
    assert main(["backtest-series", "--in", str(tmp_path / "worse.csv")]) == 2
    assert "worse.csv:2" in capsys.readouterr().err
