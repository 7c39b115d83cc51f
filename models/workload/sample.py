"""Requests and arrival times drawn from a ``WorkloadProfile``: what ``servewatch loadgen``
sends, and when. Seeded, so a load test can be run again with the same requests.

Lengths come from the profile's joint histogram (a cell by its count, then a value
log-uniform within the cell), so long prompts keep their own answer lengths. A request
starts with a shared prefix as often as the profile says, picked by the prefixes'
popularity, with the prefix's shared length (cut to the prompt, which it cannot exceed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from servewatch.schemas.workload_profile import WorkloadProfile

#: Inter-arrival CVs outside this range are clipped (gamma shapes 1/16 .. 16).
CV_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    ``finish`` says where it should end: at ``output_tokens`` because of its limit
    (``"length"``), or there of its own accord (``"stop"``). ``prefix`` is the index of the
    shared prefix it starts with (0: the most popular; ``None``: none), ``shared_tokens``
    how many leading prompt tokens are that prefix's.
    """

    prompt_tokens: int
    output_tokens: int
    finish: Literal["stop", "length"]
    prefix: int | None
    shared_tokens: int
    route: str | None


def _log_uniform(rng: np.random.Generator, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Integers in ``[low, high)``, log-uniform (the density a log-spaced bin assumes)."""
    value = np.floor(np.exp(rng.uniform(np.log(low), np.log(high))))
    return np.clip(value, low, high - 1).astype(np.int64)


class WorkloadSampler:
    """Draws ``RequestSpec`` s and arrival times like the profile's.

    Failed requests (``error``, ``abort``) are not replayed as failures: a load generator
    cannot make a server fail, so ``finish`` is drawn from the other reasons, any reason but
    ``length`` counting as a stop.

    Examples
    --------
    >>> from servewatch.models.workload.profile import WorkloadProfiler
    >>> logs = [{"model": "m", "timestamp": 1_767_225_600.0 + i, "e2e_s": 0.5, "prompt_tokens": 200 + 800 * (i % 2),
    ...          "completion_tokens": 20 + 180 * (i % 2), "finish_reason": "length" if i % 5 == 0 else "stop",
    ...          "prefix_hash": "sys" if i % 4 == 0 else None, "cached_tokens": 128} for i in range(1000)]
    >>> sampler = WorkloadSampler(WorkloadProfiler().learn_many(logs).profile("m"), seed=3)
    >>> specs = sampler.requests(2000)
    >>> long = [s.output_tokens for s in specs if s.prompt_tokens >= 800]   # long prompts, long answers
    >>> min(long) >= 160, max(s.output_tokens for s in specs if s.prompt_tokens < 800) < 30
    (True, True)
    >>> round(sum(s.prefix is not None for s in specs) / 2000, 2), {s.shared_tokens for s in specs if s.prefix == 0}
    (0.26, {128})
    >>> round(sum(s.finish == "length" for s in specs) / 2000, 2)
    0.2
    >>> arrivals = sampler.arrivals(rate=5.0, duration_s=400.0)
    >>> round(len(arrivals) / 400.0, 1), bool(np.all(np.diff(arrivals) >= 0))
    (5.0, True)
    """

    def __init__(self, profile: WorkloadProfile, seed: int = 0) -> None:
        self.profile = profile
        self._rng = np.random.default_rng(seed)
        lengths = profile.lengths
        counts = np.asarray(lengths.counts, dtype=np.float64)
        if counts.sum() <= 0:
            raise ValueError(f"profile of {profile.model} has no successful request to draw lengths from")
        self._cells = counts.ravel() / counts.sum()
        self._shape = counts.shape
        self._prompt_edges = np.asarray(lengths.prompt_edges, dtype=np.float64)
        self._output_edges = np.asarray(lengths.output_edges, dtype=np.float64)

        sharing = profile.prefixes
        weights = [float(p.requests) for p in sharing.top]
        tokens = [p.tokens for p in sharing.top]
        if sharing.other_prefixes:  # the long tail, spread evenly over its prefixes
            weights += [sharing.other_requests / sharing.other_prefixes] * sharing.other_prefixes
            tokens += [sharing.other_tokens] * sharing.other_prefixes
        self._shared_share = sharing.shared_share if weights else 0.0
        self._prefix_p = np.asarray(weights) / sum(weights) if weights else np.ones(0)
        self._prefix_tokens = np.asarray(tokens, dtype=np.int64)

        reasons = {r: s for r, s in profile.finish_reasons.items() if r not in ("error", "abort")}
        total = sum(reasons.values())
        self._p_length = reasons.get("length", 0.0) / total if total > 0 else 0.0
        self._routes = list(profile.routes)
        self._route_p = np.asarray(list(profile.routes.values())) if profile.routes else np.ones(0)

    def requests(self, n: int) -> list[RequestSpec]:
        """``n`` requests, independent of each other."""
        rng = self._rng
        cell = rng.choice(len(self._cells), size=n, p=self._cells)
        row, col = np.unravel_index(cell, self._shape)
        prompt = _log_uniform(rng, self._prompt_edges[row], self._prompt_edges[row + 1])
        output = _log_uniform(rng, self._output_edges[col], self._output_edges[col + 1])
        length = rng.random(n) < self._p_length
        shared = rng.random(n) < self._shared_share
        prefix = rng.choice(len(self._prefix_p), size=n, p=self._prefix_p) if len(self._prefix_p) else np.zeros(n, int)
        route = rng.choice(len(self._routes), size=n, p=self._route_p) if self._routes else np.zeros(n, int)
        specs = []
        for i in range(n):
            p = int(prefix[i]) if shared[i] else None
            specs.append(
                RequestSpec(
                    prompt_tokens=int(prompt[i]),
                    output_tokens=int(output[i]),
                    finish="length" if length[i] else "stop",
                    prefix=p,
                    shared_tokens=0 if p is None else int(min(self._prefix_tokens[p], prompt[i] - 1)),
                    route=self._routes[route[i]] if self._routes else None,
                )
            )
        return specs

    def arrivals(self, rate: float, duration_s: float, bursty: bool = True) -> np.ndarray:
        """Arrival offsets in ``[0, duration_s)`` seconds at a mean of ``rate`` requests/s.

        A gamma renewal process: gaps are Gamma(k, 1 / (k * rate)) with k = 1 / cv², so they
        average 1 / rate and vary as much as the profile's gaps did (cv = 1 is Poisson, the
        default when the profile could not say or ``bursty`` is off). Why not a doubly
        stochastic (Cox) process, whose rate itself wanders: it would also reproduce the
        dispersion of counts over longer windows, but needs a timescale for the wander that
        the profile does not pin down; a renewal process matches the gaps exactly, and its
        counts' dispersion tends to cv² over long windows.
        """
        if rate <= 0 or duration_s <= 0:
            return np.zeros(0)
        cv = self.profile.arrivals.interarrival_cv if bursty else None
        shape = 1.0 / float(np.clip(cv, *CV_RANGE)) ** 2 if cv else 1.0
        expected = rate * duration_s
        times = np.zeros(0)
        while not len(times) or times[-1] < duration_s:
            gaps = self._rng.gamma(shape, 1.0 / (shape * rate), size=int(expected + 5 * expected**0.5 + 10))
            times = np.concatenate([times, (times[-1] if len(times) else 0.0) + np.cumsum(gaps)])
        return times[times < duration_s]
