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


def test_scale_benchmark_runs_and_the_cap_holds() -> None:
    out = run("bench/scale.py", "--segments", "5", "1000", "1200", "--windows", "3")
    rows = [line.split() for line in out.splitlines() if "µs  cap" in line]
    # Raised cap for the memory rows, then the default cap: 1,000 segments + the overflow one.
    assert [row[1].replace(",", "") for row in rows] == ["5", "1000", "1200", "1001"]
    assert "capped" in rows[-1] and "RSS per live segment" in out


@pytest.mark.integration
def test_throughput_benchmark_runs() -> None:
    out = run("bench/throughput.py", "--records", "3000", "--single", "300", "--repeat", "1")
    assert "batched (500/msg)" in out and "one record per message" in out and "replay" in out
