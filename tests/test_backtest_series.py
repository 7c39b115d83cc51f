"""``servewatch backtest-series``: an exported series in, scores out, no look-ahead."""

from __future__ import annotations

import csv
import math
import random
from pathlib import Path

import pytest

from servewatch.models.detect.backtest_series import ScoredPoint, score_series
from servewatch.pipeline.cli.main import main
from servewatch.schemas.anomaly import Signal


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
    assert list(rows[0]) == ["timestamp", "value", "anomaly_score", "is_anomaly", "status", "explained_by_load"]
    # One page where the incident starts (its second anomalous point), firing while it lasts.
    assert [i for i, row in enumerate(rows) if row["is_anomaly"] == "true"] == [151]
    assert {rows[i]["status"] for i in range(151, 160)} == {"firing"} and rows[150]["status"] == "pending"
    assert "resolved" in {row["status"] for row in rows[160:]}
    assert all(float(row["anomaly_score"]) < 4 for row in rows[:150])
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
    points += [{"timestamp": 52, "value": 30, "trials": 1000}]
    scored = list(score_series(points, Signal.ERROR_RATE))
    assert scored[50].anomaly_score < 4 and scored[51].anomaly_score > 10
    assert [p.is_anomaly for p in scored[50:]] == [False, False, True]  # 2 anomalous points of 3


def test_a_grafana_export_and_an_error_ratio_work_without_editing(tmp_path: Path) -> None:
    rows = [(1_767_225_600_000 + 60_000 * i, 0.002 if i < 200 else 0.05) for i in range(230)]
    with (tmp_path / "grafana.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([("time", "errors / requests"), *rows])
    out = tmp_path / "out.csv"
    args = ["backtest-series", "--in", str(tmp_path / "grafana.csv"), "--out", str(out), "--signal", "error_rate"]
    assert main([*args, "--value-kind", "ratio", "--trials", "500"]) == 0
    scored = read_scores(out)
    pages = [i for i, row in enumerate(scored) if row["is_anomaly"] == "true"]
    assert len(pages) == 1 and 200 <= pages[0] <= 203 and scored[-1]["status"] == "firing"


def test_a_ratio_taken_for_counts_and_an_unknown_signal_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "ratio.csv").write_text("timestamp,value\n1767225600,0.002\n")
    assert main(["backtest-series", "--in", str(tmp_path / "ratio.csv"), "--signal", "error_rate"]) == 2
    assert "--value-kind ratio" in capsys.readouterr().err
    assert main(["backtest-series", "--in", str(tmp_path / "ratio.csv"), "--signal", "latency"]) == 2
    err = capsys.readouterr().err
    assert "unknown --signal 'latency'" in err and "ttft" in err and "error_rate" in err


@pytest.mark.parametrize("nu", [None, 5.0])
def test_null_series_page_at_most_twice_as_often_as_promised(nu: float | None) -> None:
    """Heavy-tailed, autocorrelated, wandering latency (``bench/calibration.py``'s streams) and
    an overdispersed error rate: pages (incidents starting) per point, against 1 in 10,000."""
    from bench.calibration import null_stream

    pages = points = 0
    for seed in range(8):
        values = null_stream(seed, 3000, nu, 0.5, 0.05)
        scored = list(score_series([{"timestamp": i, "value": float(v)} for i, v in enumerate(values)]))
        pages += sum(p.is_anomaly for p in scored)
        points += len(scored)
    rng = random.Random(9)
    for _ in range(4):  # errors at 0.2 % whose rate itself wanders (a Beta of strength 2,000 around it)
        rate_points = []
        for i in range(3000):
            p = rng.betavariate(4.0, 1996.0)
            rate_points.append({"timestamp": i, "value": sum(rng.random() < p for _ in range(500)), "trials": 500})
        pages += sum(p.is_anomaly for p in score_series(rate_points, Signal.ERROR_RATE))
        points += len(rate_points)
    assert pages <= 2 * 1e-4 * points, (pages, points)


def test_a_bad_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.csv").write_text("when,latency,other\n1,2,3\n")
    assert main(["backtest-series", "--in", str(tmp_path / "bad.csv")]) == 2
    assert "no time column" in capsys.readouterr().err
    (tmp_path / "worse.csv").write_text("timestamp,value\n1767225600,abc\n")
    assert main(["backtest-series", "--in", str(tmp_path / "worse.csv")]) == 2
    assert "worse.csv:2" in capsys.readouterr().err


def test_an_incident_resolves_only_once_back_near_the_baseline_not_merely_short_of_paging() -> None:
    """A fault that eases to just below paging is still the fault."""
    values = ttft_series(seed=5)
    values[150:160] = [v * 6 for v in values[150:160]]

    def eased_to(level: float) -> list[ScoredPoint]:  # the fault eases to ``level`` for 15 points, then goes
        eased = [*values[:160], *[level] * 15, *values[175:]]
        return list(score_series([{"timestamp": i, "value": v} for i, v in enumerate(eased)]))

    # A level whose points score between 2 and 4 there: short of paging, not near the baseline.
    scored = next(s for s in map(eased_to, (0.8 * (1.1 + 0.01 * k) for k in range(60)))
                  if all(2 <= p.anomaly_score < 4 for p in s[161:175]))  # fmt: skip
    assert {p.status for p in scored[151:175]} == {"firing"}, [p.status for p in scored[151:176]]
    assert "resolved" in {p.status for p in scored[175:185]}
    assert sum(p.is_anomaly for p in scored) == 1  # one page, not one per flare


# -- a series without load columns: its own recent level (``SeriesLevel``) ---------------------


def pages_of(values: list[float], **kwargs: object) -> list[int]:
    points = [{"timestamp": i, "value": v} for i, v in enumerate(values)]
    return [i for i, p in enumerate(score_series(points, **kwargs)) if p.is_anomaly]  # type: ignore[arg-type]


def test_a_short_spike_and_a_level_shift_are_flagged_and_a_noisy_flat_series_is_not() -> None:
    rng = random.Random(11)
    noisy = [45.0 * math.exp(rng.gauss(0, 0.05)) for _ in range(3000)]  # 5 % noise, like ec2 latency
    assert pages_of(noisy) == []
    spike = [*noisy[:1000], 120.0, 95.0, 110.0, *noisy[1003:]]  # three points at 2-3x
    assert pages_of(spike) == [1001]
    shift = [*noisy[:2000], *[1.3 * v for v in noisy[2000:2050]], *noisy[2050:]]  # +30 %: 5 sds, held
    scored = list(score_series([{"timestamp": i, "value": v} for i, v in enumerate(shift)]))
    pages = [i for i, p in enumerate(scored) if p.is_anomaly]
    # It fires within a few points and holds to the end of the shift (later pages are steps up
    # in severity, warning to critical, as the live detector sends them), then resolves.
    assert 2000 < pages[0] <= 2004 and all(i < 2050 for i in pages)
    assert {p.status for p in scored[pages[0] : 2050]} == {"firing"}
    assert "resolved" in {p.status for p in scored[2050:2060]}


def test_a_lone_wild_point_is_anomalous_but_pages_only_with_a_second() -> None:
    """The lifecycle is the live detector's: 2 anomalous points of 3 fire an incident."""
    values = [0.5 * math.exp(random.Random(i).gauss(0, 0.05)) for i in range(300)]
    values[200] = 2.0
    scored = list(score_series([{"timestamp": i, "value": v} for i, v in enumerate(values)]))
    assert scored[200].anomaly_score >= 4 and scored[200].status == "pending"
    assert not any(p.is_anomaly for p in scored)


def test_the_scale_follows_the_series_within_hours_not_days() -> None:
    """A wild start (a deploy's warm-up, log sd 0.5) must not blind the model to a 2x rise
    once the series has settled to 5 % noise (NAB's network series did that to the
    load-conditioned model, whose noise forgets over hundreds of windows)."""
    rng = random.Random(4)
    values = [math.exp(rng.gauss(0, 0.5)) for _ in range(100)] + [math.exp(rng.gauss(0, 0.05)) for _ in range(400)]
    values[450:460] = [2 * v for v in values[450:460]]
    assert pages_of(values) == [451]


def test_load_columns_choose_the_load_conditioned_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    values = ttft_series(seed=6)
    plain = [{"timestamp": i, "value": v} for i, v in enumerate(values)]
    loaded = [{**p, "requests_per_s": 10.0} for p in plain]
    assert list(score_series(plain)) == list(score_series(plain, model="series"))
    assert list(score_series(loaded)) == list(score_series(loaded, model="load"))
    assert list(score_series(plain, model="series")) != list(score_series(plain, model="load"))
    write_series(tmp_path / "in.csv", values)
    assert main(["backtest-series", "--in", str(tmp_path / "in.csv"), "--out", str(tmp_path / "out.csv")]) == 0
    assert "against its own recent level" in capsys.readouterr().err
    write_series(tmp_path / "loaded.csv", values, load=[10.0] * len(values))
    assert main(["backtest-series", "--in", str(tmp_path / "loaded.csv"), "--out", str(tmp_path / "out.csv")]) == 0
    assert "conditioned on its load columns" in capsys.readouterr().err


def test_a_throughput_series_pages_on_a_drop() -> None:
    """The series model keeps the signal's tail: lower decode throughput is the fault."""
    rng = random.Random(8)
    values = [40.0 * math.exp(rng.gauss(0, 0.05)) for _ in range(400)]
    values[300:310] = [v / 2 for v in values[300:310]]
    assert pages_of(values, signal=Signal.THROUGHPUT) == [301]
    values[300:310] = [v * 4 for v in values[300:310]]  # faster than usual: no fault
    assert pages_of(values, signal=Signal.THROUGHPUT) == []
