"""The benchmarks still run (tiny sizes; figures are printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.long
def test_scale_benchmark_runs_and_the_cap_holds() -> None:
    out = run("-m", "bench.scale", "--segments", "5", "1000", "1200", "--windows", "3")
    rows = [line.split() for line in out.splitlines() if "µs  cap" in line]
    # Raised cap for the memory rows, then the default cap: 1,000 segments + the overflow one.
    assert [row[1].replace(",", "") for row in rows] == ["5", "1000", "1200", "1001"]
    assert "capped" in rows[-1] and "RSS per live segment" in out


def test_compare_on_the_real_gpu_runs_reads_the_degradation_and_no_verdict_between_healthy_halves() -> None:
    out = run("-m", "bench.compare_real", "--resamples", "200")
    lines = out.splitlines()

    def verdicts(what: str) -> list[str]:
        cells = next(line for line in lines if what in line).split()
        rates = next(i for i, token in enumerate(cells) if ">" in token)
        return cells[rates + 1 :: 3]  # verdict, change, unit per signal

    assert verdicts("across the real degradation")[:3] == ["regressed"] * 3  # TTFT p50, p95, e2e p95
    for healthy in ("dram_only            healthy halves", "healthy halves (mild drift)"):
        assert not {"regressed", "improved"} & set(verdicts(healthy)), healthy
    assert "load differs: 4.9 vs 1.5 req/s, 23 % of requests comparable" in out


def test_model_speed_times_every_registered_model() -> None:
    from servewatch.models import REGISTRY

    out = run("-m", "bench.model_speed", "--windows", "300", "--runs", "1")
    timed = {line.split()[0] for line in out.splitlines()[1:]}
    assert timed == set(REGISTRY)


@pytest.mark.integration
def test_throughput_benchmark_runs() -> None:
    out = run("-m", "bench.throughput", "--records", "3000", "--single", "300", "--repeat", "1")
    assert "batched (500/msg)" in out and "one record per message" in out and "replay" in out


def test_the_naive_baselines_fire_once_on_a_jump_and_look_only_backwards() -> None:
    import random

    from bench.baselines import fixed_threshold, fixed_threshold_incidents, rolling_z_incidents

    rng = random.Random(3)
    points = [(10.0 * i, 0.5 * rng.uniform(0.9, 1.1)) for i in range(40)] + [(400.0 + 10 * i, 5.0) for i in range(5)]
    series = {"model=m": points}
    threshold = fixed_threshold(series, warmup_end=400.0)
    assert 0.5 < threshold < 0.6
    assert fixed_threshold_incidents(series, threshold) == [("model=m", 410.0)]  # 2 anomalous windows of 3
    assert rolling_z_incidents(series) == [("model=m", 410.0)]
    assert rolling_z_incidents({"model=m": points[:40]}) == []


@pytest.mark.long
def test_the_replica_benchmark_runs_a_real_run_case_and_its_scale_rows() -> None:
    out = run("-m", "bench.replicas", "--only", "real_gds_dram_healthy", "--scrapes", "--scale", "--replicas", "4",
              "--models", "2", "--seconds", "60")  # fmt: skip
    assert "real_gds_dram_healthy_of_4" in out and "(request logs only)" in out
    assert "ratio" in out and "state per instance" in out
