"""``WorkloadProfile``: one model's real request mix, enough to replay it against a server.

Written by ``servewatch profile`` (``models.workload.profile``) from request logs, read by
``servewatch loadgen`` (``models.workload.sample``), so a load test sends what production
sends: the same lengths together (a long prompt with a short answer is not a short prompt
with a long one), the same burstiness, prefixes shared as often and as long as in real
traffic, and the same finish reasons. It holds counts and shares only, never text or
prefix hashes, so a profile can leave the production network.

Arrival times are estimated as ``timestamp - e2e_s`` (``RequestLog.timestamp`` is the finish).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servewatch.schemas.version import SCHEMA_VERSION


class Quantiles(BaseModel):
    """Quantiles and mean of a token count, from the raw values (not the histogram)."""

    model_config = ConfigDict(frozen=True)

    p10: float
    p50: float
    p90: float
    p99: float
    mean: float


class Arrivals(BaseModel):
    """When requests arrive: the daily shape (UTC) and how bursty arrivals are within an hour.

    Burstiness is measured within clock hours (gaps scaled by their hour's mean rate, counts
    compared with their hour's mean) so that a daily swing does not read as bursts. A Poisson
    process has a coefficient of variation and indices of dispersion of 1; bursty traffic is
    above 1, evenly paced traffic below.
    """

    model_config = ConfigDict(frozen=True)

    mean_rate: float | None = Field(description="requests/s over the period (None: a single request)")
    hourly_rate: list[float | None] = Field(
        min_length=24, max_length=24, description="requests/s by hour of day, UTC; None: the period has no such hour"
    )
    hourly_seconds: list[float] = Field(
        min_length=24, max_length=24, description="seconds of the period in each hour of day (the rates' weight)"
    )
    interarrival_cv: float | None = Field(
        description="coefficient of variation of inter-arrival gaps, each scaled by its hour's mean rate"
    )
    dispersion_1s: float | None = Field(description="variance / mean of per-second arrival counts, within hours")
    dispersion_10s: float | None = Field(description="variance / mean of per-10 s arrival counts, within hours")


class LengthHistogram(BaseModel):
    """Prompt and output tokens together: counts on log-spaced integer bins.

    Cell ``counts[i][j]`` holds requests with ``prompt_edges[i] <= prompt_tokens <
    prompt_edges[i + 1]`` and ``output_edges[j] <= completion_tokens < output_edges[j + 1]``.
    To sample: draw a cell by its count, then a value log-uniform within each edge pair,
    rounded down. Failed requests are left out (their output stopped early); counts below
    1 token are counted as 1.
    """

    model_config = ConfigDict(frozen=True)

    bins_per_doubling: int = Field(ge=1, description="bin edges are round(2 ** (k / bins_per_doubling)), deduplicated")
    prompt_edges: list[int] = Field(min_length=2)
    output_edges: list[int] = Field(min_length=2)
    counts: list[list[int]] = Field(description="len(prompt_edges) - 1 rows of len(output_edges) - 1 counts")
    prompt: Quantiles | None = Field(description="prompt tokens of the same requests (None: no request)")
    output: Quantiles | None = Field(description="completion tokens of the same requests (None: no request)")


class SharedPrefix(BaseModel):
    """One prefix that at least two requests started with, and how long the shared part is."""

    model_config = ConfigDict(frozen=True)

    requests: int = Field(ge=2)
    tokens: int = Field(ge=0, description="estimated length of the shared part")
    estimated_from: Literal["cached_tokens", "shortest_prompt"] = Field(
        description="the median cached_tokens of its requests that hit the cache; without any, the shortest "
        "prompt among its requests (an upper bound: the shared part cannot be longer)"
    )


class PrefixSharing(BaseModel):
    """How often requests start with a prefix another request also sent (``prefix_hash``).

    The shared part's length is estimated from ``cached_tokens``: a server's prefix cache
    serves exactly the leading tokens it has seen before, so the median over a prefix's
    requests that hit the cache is the usable shared length (rounded to the server's cache
    blocks). Logs without ``cached_tokens`` (or with the cache off) only bound it by the
    shortest prompt that carried the prefix.
    """

    model_config = ConfigDict(frozen=True)

    hashed_share: float = Field(ge=0.0, le=1.0, description="share of requests with a prefix_hash at all")
    shared_share: float = Field(
        ge=0.0, le=1.0, description="share of requests whose prefix_hash at least one other request has"
    )
    distinct_shared: int = Field(ge=0, description="distinct prefixes shared by two requests or more")
    top: list[SharedPrefix] = Field(description="the most popular shared prefixes, most requests first")
    other_prefixes: int = Field(ge=0, description="shared prefixes beyond ``top``")
    other_requests: int = Field(ge=0, description="their requests")
    other_tokens: int = Field(ge=0, description="median shared length among them")


class WorkloadProfile(BaseModel):
    """One model's request mix: arrivals, prompt/output lengths, prefix sharing, finish reasons."""

    model_config = ConfigDict(frozen=True)

    schema_version: int = SCHEMA_VERSION
    kind: Literal["workload_profile"] = "workload_profile"
    model: str
    requests: int = Field(ge=1)
    first: float = Field(description="first arrival, unix seconds")
    last: float = Field(description="last arrival, unix seconds")
    arrivals: Arrivals
    lengths: LengthHistogram
    prefixes: PrefixSharing
    finish_reasons: dict[str, float] = Field(description="share of requests per finish reason (errors included)")
    routes: dict[str, float] = Field(description="share of requests per route (requests without one left out)")
