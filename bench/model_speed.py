"""Model speed: each registered model judging and learning a seeded stream of windows, alone.

    python -m bench.model_speed [--windows 20000] [--runs 5] [--against /tmp/before]

Every model of ``servewatch.models.REGISTRY`` is fed the same seeded windows (``STREAMS``:
load-conditioned latencies with a few slow windows, rates, shares, cache hits, hourly
traffic, a bare series) through river's contract, ``score_one`` then ``learn_one`` per
window, and the bench prints microseconds per window (the median of ``--runs``) and a hash
of every score: equal hashes mean the same arithmetic. ``--against``: another checkout
(a ``git worktree`` of an older commit) timed in turn with this one, a fresh process per run,
and the ratio of their medians per model. Judging is most of a realistic replay's time
(``bench.replay_realistic``), and a replay's spread from run to run hides a few per cent;
one model alone shows them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Window = tuple[dict[str, Any], float]


def latency_windows(rng: random.Random, n: int) -> list[Window]:
    """Demand wandering around its usual level; latency rising with it, 1 % of windows 3x slow,
    a third of them with the within-window spread instead of a sampling variance."""
    out = []
    for i in range(n):
        demand = math.exp(rng.gauss(0, 0.3))
        x: dict[str, Any] = {"requests_per_s": 5.0 * demand, "saturated": 0.0,
                             "prompt_tokens_per_s": 5000.0 * demand * math.exp(rng.gauss(0, 0.2))}  # fmt: skip
        if i % 3:
            x["sampling_var"] = 0.01 * rng.random()
        else:
            x["n"], x["within_var"] = float(rng.randint(1, 40)), 0.05 + 0.1 * rng.random()
        slow = 3.0 if rng.random() < 0.01 else 1.0
        out.append((x, 0.2 * demand**0.3 * math.exp(rng.gauss(0, 0.1)) * slow))
    return out


def rate_windows(rng: random.Random, n: int) -> list[Window]:
    out: list[Window] = []
    for i in range(n):
        trials = rng.randint(5, 300)
        rate = 0.002 * (1 + 0.5 * math.sin(i / 30)) * (20.0 if rng.random() < 0.01 else 1.0)
        out.append(({"trials": trials, "seconds": 10.0}, float(sum(rng.random() < rate for _ in range(trials)))))
    return out


def share_windows(rng: random.Random, n: int) -> list[Window]:
    return [({"trials": rng.randint(20, 200)}, min(max(rng.gauss(0.85, 0.03), 0.0), 1.0)) for _ in range(n)]


def cache_windows(rng: random.Random, n: int) -> list[Window]:
    """Hit rates around 0.4, and 1 % of windows with the cache failing: few hits, and most
    requests that reuse a prefix seen before missing it."""
    out: list[Window] = []
    for _ in range(n):
        failing = rng.random() < 0.01
        trials = rng.randint(20, 200)
        reused = int(trials * rng.uniform(0.3, 0.9))
        missed = sum(rng.random() < (0.9 if failing else 0.03) for _ in range(reused))
        hit_rate = rng.uniform(0.0, 0.05) if failing else rng.uniform(0.3, 0.5)
        out.append(({"trials": trials, "reused": reused, "reused_missed": missed}, hit_rate))
    return out


def traffic_windows(rng: random.Random, n: int) -> list[Window]:
    return [({"hour": (i // 360) % 24}, float(rng.randint(30, 70))) for i in range(n)]


def series_windows(rng: random.Random, n: int) -> list[Window]:
    return [({}, 0.5 * (1 + 0.3 * math.sin(i / 40)) * math.exp(rng.gauss(0, 0.1))) for i in range(n)]


#: How each registered model is fed (by its ``REGISTRY`` name); a model not listed is skipped.
STREAMS: dict[str, Callable[[random.Random, int], list[Window]]] = {
    "load_conditioned_latency": latency_windows,
    "beta_binomial_rate": rate_windows,
    "share_level": share_windows,
    "cache_hit_rate": cache_windows,
    "traffic": traffic_windows,
    "series_level": series_windows,
}


def time_models(windows: int, runs: int) -> dict[str, tuple[float, str]]:
    """Per registered model: (median µs per window, hash of its scores)."""
    from servewatch.models import REGISTRY

    results = {}
    for name, model_type in REGISTRY.items():
        stream = STREAMS.get(name)
        if stream is None:
            continue
        data = stream(random.Random(7), windows)
        times, digest = [], ""
        for _ in range(runs):
            model, scores = model_type(), []
            started = time.perf_counter()
            for x, y in data:
                scores.append(model.score_one(x, y))
                model.learn_one(x, y)
            times.append((time.perf_counter() - started) / windows * 1e6)
            digest = hashlib.sha256(struct.pack(f"{len(scores)}d", *scores)).hexdigest()[:12]
        results[name] = (statistics.median(times), digest)
    return results


def in_checkout(checkout: Path, windows: int, runs: int) -> dict[str, tuple[float, str]]:
    """``time_models`` in a fresh process importing ``checkout``'s code (this file's source runs
    there, so the other checkout needs no copy of it)."""
    code = (
        "import json\n"
        "bench = {'__name__': 'model_speed'}\n"
        f"exec(compile(open({str(Path(__file__).resolve())!r}).read(), 'model_speed', 'exec'), bench)\n"
        f"print(json.dumps(bench['time_models']({windows}, {runs})))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"model_speed in {checkout} failed:\n{done.stderr[-2000:]}")
    return {name: (float(us), str(digest)) for name, (us, digest) in json.loads(done.stdout).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout, timed in turn with this one")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    if args.against is None:
        print(f"{'model':26} {'µs/window':>10}  scores")
        for name, (us, digest) in in_checkout(here, args.windows, args.runs).items():
            print(f"{name:26} {us:10.2f}  {digest}")
        return
    # In turn, one run each, so that the machine's drift falls on both alike.
    rounds = [
        (in_checkout(args.against.resolve(), args.windows, 1), in_checkout(here, args.windows, 1))
        for _ in range(args.runs)
    ]
    other, this = ({name: (statistics.median(r[side][name][0] for r in rounds), rounds[0][side][name][1])
                    for name in rounds[0][side]} for side in (0, 1))  # fmt: skip
    print(f"{'model':26} {'other µs':>9} {'this µs':>9} {'ratio':>6}  scores")
    for name, (us, digest) in this.items():
        if name not in other:
            print(f"{name:26} {'-':>9} {us:9.2f} {'-':>6}  {digest} (not in the other checkout)")
            continue
        other_us, other_digest = other[name]
        same = "same" if digest == other_digest else f"DIFFER ({other_digest} there)"
        print(f"{name:26} {other_us:9.2f} {us:9.2f} {other_us / us:6.2f}  {digest} {same}")


if __name__ == "__main__":
    main()
