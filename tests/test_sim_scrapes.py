"""``pipeline.dev.sim_scrapes``: the simulated fleet's vLLM /metrics are what its requests say."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from typing import Any

import numpy as np
import orjson
import pytest

from servewatch.pipeline.dev.serving_sim import SimPhase, TraceWorkload
from servewatch.pipeline.dev.sim_scrapes import (
    ITL_BUCKETS,
    TTFT_BUCKETS,
    engine_scrapes,
    iter_scrape_families,
    iter_scrape_lines,
    run_scrape_scenario,
    scrape_lines,
)
from servewatch.pipeline.ingest.scrape.exposition import Snapshot, parse, read_families

MINUTES = 20


def workload() -> TraceWorkload:
    return TraceWorkload(phases=(SimPhase("normal", MINUTES * 60),), seed=7)


@pytest.fixture(scope="module")
def drained() -> tuple[TraceWorkload, list[dict[str, Any]], list[Snapshot]]:
    """Twenty minutes of the default fleet, scraped until every request finished: the
    workload, its request logs, and every scrape parsed by the project's own parser."""
    w = workload()
    records = list(w.records())
    snapshots = []
    for line in scrape_lines(w, drain=True):
        record = orjson.loads(line)
        snapshots.append(parse(record["body"], record["instance"], record["timestamp"]))
    return w, records, snapshots


def test_a_scrape_read_from_its_families_is_the_scrape_parsed_from_its_text(drained: Any) -> None:
    """``run_scrape_scenario`` reads each simulated scrape from its metric families and skips
    the text round trip (most of a long scrape replay's time): scrape by scrape, the same."""
    w, _, parsed = drained
    read = [read_families(families, instance, t) for t, instance, families in iter_scrape_families(w, drain=True)]
    assert read == parsed


def by_instance(snapshots: list[Snapshot]) -> dict[str, list[Snapshot]]:
    out: dict[str, list[Snapshot]] = defaultdict(list)
    for snapshot in snapshots:
        out[snapshot.instance].append(snapshot)
    return out


def test_every_scrape_parses_into_one_model_with_vllm_series_and_buckets(drained: Any) -> None:
    w, records, snapshots = drained
    assert len(by_instance(snapshots)) == 6  # 4 chat engines, 2 code engines
    models = {r["instance"]: r["model"] for r in records}
    for snapshot in snapshots:
        assert list(snapshot.models) == [models[snapshot.instance]]
        figures = snapshot.models[models[snapshot.instance]]
        assert figures.engine == "vllm" and snapshot.cache_config["enable_prefix_caching"] == "True"
        assert set(figures.counters) == {"cache_queries", "cache_hits", "prompt_tokens", "generation_tokens",
                                         "preemptions"}  # fmt: skip
        assert set(figures.gauges) == {"running", "waiting", "kv_cache_usage"}
        assert 0.0 <= figures.gauges["kv_cache_usage"] <= 1.0
        assert set(figures.histograms) == {"ttft", "itl", "e2e", "queue_time", "prefill_time", "decode_time"}
        assert sorted(figures.histograms["ttft"].buckets) == [*TTFT_BUCKETS, math.inf]
        assert sorted(figures.histograms["itl"].buckets) == [*ITL_BUCKETS, math.inf]
    times = [s.timestamp for s in snapshots]
    assert times == sorted(times), "lines in time order"
    # Engines are scraped at their own offsets, not all at once.
    assert len({round(s[0].timestamp - w.start, 1) for s in by_instance(snapshots).values()}) == 6


def test_counters_and_buckets_never_go_down(drained: Any) -> None:
    _, _, snapshots = drained
    for scrapes in by_instance(snapshots).values():
        for before, after in itertools.pairwise(scrapes):
            (model, now), then = next(iter(after.models.items())), before.models[next(iter(after.models))]
            assert all(now.counters[name] >= value for name, value in then.counters.items()), model
            assert all(now.finished[reason] >= value for reason, value in then.finished.items())
            for name, histogram in now.histograms.items():
                earlier = then.histograms[name]
                assert histogram.count >= earlier.count and histogram.total >= earlier.total - 1e-6
                assert all(n >= earlier.buckets[le] for le, n in histogram.buckets.items())
                ordered = [histogram.buckets[le] for le in sorted(histogram.buckets)]
                assert ordered == sorted(ordered) and ordered[-1] == histogram.count, "cumulative le buckets"


def test_finished_requests_and_tokens_are_the_simulated_ones(drained: Any) -> None:
    _, records, snapshots = drained
    for instance, scrapes in by_instance(snapshots).items():
        mine = [r for r in records if r["instance"] == instance]
        finished = np.sort([r["timestamp"] for r in mine])
        for snapshot in scrapes:  # at every scrape: the requests that finished by then
            figures = next(iter(snapshot.models.values()))
            assert sum(figures.finished.values()) == np.searchsorted(finished, snapshot.timestamp, side="right")
            assert figures.histograms["e2e"].count == sum(figures.finished.values())
        last = next(iter(scrapes[-1].models.values()))  # after the drain: every request, every token
        assert last.finished["stop"] + last.finished["length"] == len(mine)
        assert last.counters["prompt_tokens"] == last.counters["cache_queries"] == sum(r["prompt_tokens"] for r in mine)
        assert last.counters["cache_hits"] == sum(r["cached_tokens"] for r in mine)
        assert last.counters["generation_tokens"] == sum(r["completion_tokens"] for r in mine)
        # vLLM observes inter-token latency once per decode step, not once per request.
        assert last.histograms["itl"].count == sum(max(r["completion_tokens"] - 1, 0) for r in mine)
        assert last.histograms["e2e"].total == pytest.approx(sum(r["e2e_s"] for r in mine), rel=1e-4)
        assert last.histograms["queue_time"].total == pytest.approx(sum(r["queue_s"] for r in mine), abs=0.01)


def test_running_and_waiting_gauges_are_the_simulated_concurrency_at_the_scrape(drained: Any) -> None:
    _, records, snapshots = drained
    busy = 0
    for instance, scrapes in by_instance(snapshots).items():
        mine = [r for r in records if r["instance"] == instance]
        end = np.array([r["timestamp"] for r in mine])
        arrival = end - np.array([r["e2e_s"] for r in mine])
        start = arrival + np.array([r["queue_s"] for r in mine])
        for snapshot in scrapes:
            t = snapshot.timestamp
            gauges = next(iter(snapshot.models.values())).gauges
            assert gauges["running"] == np.sum((start <= t) & (end > t))
            assert gauges["waiting"] == np.sum((arrival <= t) & (start > t))
            busy += gauges["running"] > 0
    assert busy > 100, "the fleet is busy at most scrapes"


def test_scrapes_are_deterministic_and_the_phases_bound_them() -> None:
    w = workload()
    scrapes = engine_scrapes(w)
    assert all(s.times[-1] < MINUTES * 60 and len(s.times) == MINUTES * 6 for s in scrapes)
    gaps = np.diff(scrapes[0].times)
    assert np.all((gaps > 9.9) & (gaps < 10.1))
    first, again = (list(itertools.islice(iter_scrape_lines(workload()), 12)) for _ in range(2))
    assert first == again


def test_a_healthy_run_replays_without_rejections() -> None:
    run = run_scrape_scenario(workload())
    assert run.stats.rejected == 0 and run.stats.scrapes == 6 * MINUTES * 6
    assert run.stats.intervals == run.stats.scrapes - 6
    assert len(run.paging_groups) <= len({e.fingerprint for e in run.pages})
