"""Real GPU load tests replayed as request logs, healthy or with a fault injected.

The three runs of callanjfox/kv-cache-tester (Apache-2.0) bundled in
``pipeline/dev/trace_samples/real_runs.csv.gz`` are the only public per-request latencies of a
real LLM server we know of: a closed-loop tester keeps ``concurrency`` requests in flight
against a tensor-parallel-4 server with KV offload, each prompt a fixed size of which a
designed share is a cached prefix, each answer one token. So they test what a simulator
cannot: real TTFT noise, and TTFT that rises with concurrency at a flat request rate.
There are no finish reasons, errors, queue/prefill split or prefix hashes in the data;
records carry ``finish_reason`` "stop" and status 200, and no ``prefix_hash``.

What the runs show (TTFT medians per concurrency level, by launch time; completions/s):

* ``cacherate_sustained`` (32,000-token prompts, 30,976 cached; 3 minutes, 2,101 requests):
  concurrency 2, 22, 32, 42, 48, 52 for ~30 s each. From 22 up the server is saturated:
  ~12 completions/s at every level while TTFT grows with concurrency (Little's law): 0.20 s
  at 2, 1.73 s at 22, 2.42 s at 32, 3.49 s at 42, 3.72 s at 48, 4.19 s at 52. Healthy
  throughout, but the request rate does not explain its TTFT: only the concurrency does.
  Too short (184 s) for a detector's usual warm-up.
* ``dram_only`` (64,000-token prompts, 61,440 cached; 30 minutes, 3,470 requests):
  healthy until launch 779 s: concurrency 9-13 gives TTFT 1.59 s (9), 2.04 s (11),
  2.19 s (13) at ~5.5 completions/s; concurrency 1 gives 0.42 s. From 779 s on, the DRAM
  offload tier thrashes: concurrency 11 gives 8.71 s (4.3x what it gave before), 7 gives
  6.3 s, 3 gives 3.1 s, and completions fall to ~1.1/s; from ~1,160 s even concurrency 1
  takes 1.70 s (0.42 s before). A real degradation at lower load: a detector should page.
* ``gds_dram`` (64,000-token prompts, 61,440 cached; 30 minutes, 7,053 requests):
  concurrency 19-27 after the first 30 s (1: 0.37 s). Healthy throughout with a mild
  drift: per level, the second half's TTFT is ~10 % above the first's (21: 4.45 -> 4.85 s,
  23: 4.96 -> 5.44 s) at 4.05 -> 3.77 completions/s; 30-second stretches range 4.1-7.4 s.

``HEALTHY_S`` holds each run's healthy launch-time stretch. A detector replaying a healthy
stretch should page nothing; ``Injection`` adds a fault at constant concurrency (TTFT x4 and
``cached_tokens`` 0, or a share of answers cut at the length limit) that it must catch.
An injection is open-loop: it changes the chosen requests, not when later ones were sent.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servewatch.pipeline.dev.serving_sim import per_second, read_sample
from servewatch.pipeline.dev.simulator import EPOCH

SAMPLE = "real_runs.csv.gz"
#: The runs in the sample, in the order of their rows.
RUN_NAMES = ("cacherate_sustained", "dram_only", "gds_dram")
#: Per run, the launch-time stretch (seconds from its first launch) in which the server is healthy.
HEALTHY_S: dict[str, tuple[float, float]] = {
    "cacherate_sustained": (0.0, 184.0),
    "dram_only": (0.0, 779.0),
    "gds_dram": (0.0, 1806.0),
}


def run_columns(run: str) -> dict[str, np.ndarray]:
    """One run's rows as numpy columns (``launch_s``, ``finish_s``, ``prompt_tokens``,
    ``cached_tokens``, ``output_tokens``, ``ttft_s``, ``total_s``, ``concurrency``), by launch."""
    if run not in RUN_NAMES:
        raise ValueError(f"unknown run {run!r}; one of {', '.join(RUN_NAMES)}")
    _, columns = read_sample(SAMPLE)
    keep = np.array(columns["run"]) == run
    out: dict[str, np.ndarray] = {}
    for name, values in columns.items():
        if name == "run":
            continue
        kind = np.float64 if name.endswith("_s") else np.int64
        out[name] = np.array(values, dtype=kind)[keep]
    return out


@dataclass(frozen=True)
class Injection:
    """A fault applied to the requests launched in [start_s, end_s) (seconds from the run's start).

    ``ttft_factor``: their TTFT is that many times longer, and their end-to-end time longer by
    the same seconds. ``drop_cache``: their ``cached_tokens`` is 0 (prefix caching off).
    ``truncate_share``: that share of them is cut at ``max_tokens`` (finish_reason "length",
    ``completion_tokens`` = ``max_tokens``; a longer answer than recorded takes ``itl_s`` per
    extra token).
    """

    start_s: float
    end_s: float
    ttft_factor: float = 1.0
    drop_cache: bool = False
    truncate_share: float = 0.0
    max_tokens: int = 1
    itl_s: float = 0.02

    @classmethod
    def middle_third(cls, run: str, **fault: Any) -> Injection:
        """The fault over the middle third of ``run``'s healthy stretch."""
        first, last = HEALTHY_S[run]
        third = (last - first) / 3
        return cls(first + third, first + 2 * third, **fault)


@dataclass
class RealRunWorkload:
    """A real run's requests as ``RequestLog`` dicts, with the ``Workload`` interface
    (``start``, ``duration_s``, ``seconds()``, ``records()``).

    ``healthy_only`` keeps the requests launched in the run's healthy stretch. The model is
    ``kvtest-<run>`` unless given: each run is its own server.
    """

    run: str
    injection: Injection | None = None
    healthy_only: bool = False
    model: str | None = None
    seed: int = 7  # picks the truncated requests
    start: float = EPOCH
    _records: list[dict[str, Any]] | None = field(init=False, repr=False, default=None)
    _duration_s: float = field(init=False, repr=False, default=0.0)
    _first_faulty: float | None = field(init=False, repr=False, default=None)

    @property
    def first_faulty_log_s(self) -> float | None:
        """When (event time) the first request the injection changed was logged: a detector
        cannot know of the fault before (an inflated TTFT is logged when it ends)."""
        self._built()
        return None if self._first_faulty is None else self.start + self._first_faulty

    @property
    def first_faulty_logs(self) -> dict[str, float]:
        """``first_faulty_log_s`` as the simulators give theirs, per way a request shows the
        fault (``simulator.FAULT_SHOWS``): an injection changes a request's service."""
        first = self.first_faulty_log_s
        return {} if first is None else {"served": first}

    @property
    def duration_s(self) -> float:
        """Seconds from the first launch to the last launch kept (later finishes are the drain)."""
        self._built()
        return self._duration_s

    def records(self) -> Iterator[dict[str, Any]]:
        """All records, ordered by finish time."""
        yield from self._built()

    def seconds(self) -> Iterator[tuple[float, list[dict[str, Any]]]]:
        """Per second: (its end, the records that finished in it), in finish order."""
        return per_second(self._built(), self.start, self.duration_s)

    def _built(self) -> list[dict[str, Any]]:
        if self._records is not None:
            return self._records
        c = run_columns(self.run)
        n = len(c["launch_s"])
        keep = np.ones(n, dtype=bool)
        if self.healthy_only:
            first, last = HEALTHY_S[self.run]
            keep = (c["launch_s"] >= first) & (c["launch_s"] < last)
        ttft, e2e, finish_s = c["ttft_s"].copy(), c["total_s"].copy(), c["finish_s"].copy()
        cached, output = c["cached_tokens"].copy(), c["output_tokens"].copy()
        truncated = np.zeros(n, dtype=bool)
        injection = self.injection
        if injection is not None:
            hit = keep & (c["launch_s"] >= injection.start_s) & (c["launch_s"] < injection.end_s)
            added = ttft * (injection.ttft_factor - 1.0) * hit
            if injection.truncate_share:
                draws = np.random.default_rng(self.seed).random(n)
                truncated = hit & (draws < injection.truncate_share)
                added += np.where(truncated, np.maximum(injection.max_tokens - output, 0) * injection.itl_s, 0.0)
                output = np.where(truncated, injection.max_tokens, output)
            ttft = ttft + ttft * (injection.ttft_factor - 1.0) * hit
            e2e, finish_s = e2e + added, finish_s + added
            if hit.any():
                self._first_faulty = float(finish_s[hit].min())
            if injection.drop_cache:
                cached = np.where(hit, 0, cached)
        model = self.model or f"kvtest-{self.run}"
        records: list[dict[str, Any]] = []
        for i in np.flatnonzero(keep):
            record: dict[str, Any] = {
                "request_id": f"{self.run}-{i}",
                "timestamp": round(self.start + float(finish_s[i]), 4),
                "model": model,
                "route": "loadtest",
                "engine": "vllm",
                "prompt_tokens": int(c["prompt_tokens"][i]),
                "cached_tokens": int(cached[i]),
                "completion_tokens": int(output[i]),
                "ttft_s": round(float(ttft[i]), 5),
                "e2e_s": round(float(e2e[i]), 5),
                "finish_reason": "length" if truncated[i] else "stop",
                "status_code": 200,
            }
            if truncated[i]:
                record["max_tokens"] = int(output[i])
            records.append(record)
        records.sort(key=lambda r: r["timestamp"])
        launches = c["launch_s"][keep]
        self._duration_s = float(math.ceil(launches.max())) if len(launches) else 0.0
        self._records = records
        return records
