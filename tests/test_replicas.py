"""Which replica: each serving instance against its peers (``models.detect.replicas``), from
stage 1's replica rows to the instance in Slack, PagerDuty and Alertmanager."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servewatch.models.detect.bank import DetectorBank
from servewatch.models.detect.engine_peers import MIN_COUNT, EnginePeers
from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.models.detect.peer_incidents import tail_spread
from servewatch.models.detect.replicas import ReplicaWatch, _peers
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.stats.prefill_cost import PrefillCost
from servewatch.models.windows.engine_window import EngineWindow
from servewatch.models.windows.window import COLUMN_OF, RECENT_COLUMNS, WindowStats, log_seconds
from servewatch.pipeline.dev.replica_scenarios import FAULTY_HOST, rolling_restart, slow_replica
from servewatch.pipeline.dev.scenarios import run_scenario
from servewatch.pipeline.dev.sim_scrapes import run_scrape_scenario
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.notify.config import Timing
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.sinks.alertmanager import build_alerts
from servewatch.pipeline.notify.sinks.pagerduty import build_event
from servewatch.pipeline.notify.sinks.slack import build_message
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.web.store import Filters, TriageStore
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.engine_interval import LatencySummary
from tests.conftest import MakeClient

WINDOW = 10.0


def rows(
    start: float, itl_s: dict[str, float], rng: np.random.Generator, n: int = 12, recent: bool = False,
    change: tuple[str, float, float] | None = None, sigma: float = 0.5,
) -> list[WindowStats]:  # fmt: skip
    """One window's replica rows of model m: ``n`` requests per instance whose inter-token
    latency is log-normal (``sigma`` 0.5: heavy for a per-request mean) around its instance's.

    With ``recent``, each request also carries the share of its life (0.5 to 30 s) that fell
    in the window (as stage 1 folds it: ``recent_columns``). ``change``: (instance, time,
    factor), an instance whose latency rose that many times at that time (its figure in
    ``itl_s`` is the one after): a request ending after it was slowed for the share of its
    life since."""
    out = []
    for instance, typical in itl_s.items():
        row = WindowStats(f"~replica|model=m|route=-|instance={instance}", start, WINDOW, requests=n, itl_n=n)
        seconds = typical * rng.lognormal(0.0, sigma, n)
        if recent or change is not None:
            life, end = rng.uniform(0.5, 30.0, n), start + rng.uniform(0.0, WINDOW, n)
        if change is not None and change[0] == instance:
            slowed = np.clip((end - change[1]) / life, 0.0, 1.0)
            seconds *= (1.0 + (change[2] - 1.0) * slowed) / change[2]
        logs = log_seconds(seconds)
        row.block.sums[0, [COLUMN_OF["itl_log"], COLUMN_OF["itl_log2"]]] = logs.sum(), (logs**2).sum()
        if recent:
            share = np.minimum((end - start) / life, 1.0)
            add_recent(row, logs, share)
        out.append(row)
    return out


def add_recent(row: WindowStats, logs: np.ndarray, share: np.ndarray) -> None:
    """The row's inter-token latency summed weighed by each request's share of its life in the
    window, as stage 1 folds it (``recent_columns``)."""
    row.block.sums[0, list(RECENT_COLUMNS["itl"])] = share.sum(), (share * logs).sum(), (share**2).sum()


def run(watch: ReplicaWatch, windows: int, itl_at: object, seed: int = 1, first: int = 0) -> list[AnomalyEvent]:
    rng = np.random.default_rng(seed)
    events = []
    for w in range(first, first + windows):
        events += watch.observe(rows(w * WINDOW, itl_at(w), rng))  # type: ignore[operator]
    return events


def fleet(n: int, slow: dict[int, float] | None = None, base: float = 0.02) -> dict[str, float]:
    return {f"10.0.0.{k}:8000": base * (slow or {}).get(k, 1.0) for k in range(n)}


def firings(events: list[AnomalyEvent]) -> list[tuple[str, str]]:
    return [(e.segment["instance"], e.signal.value) for e in events if e.transition == "firing"]


def test_a_slow_replica_among_sixteen_is_named_and_a_fleet_wide_shift_is_not() -> None:
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    # A day of healthy windows: no replica pages, whatever the heavy tails do.
    assert run(watch, 600, lambda w: fleet(16)) == []
    # Every replica 2x slower (a fleet-wide fault): no instance differs from its peers.
    assert run(watch, 60, lambda w: fleet(16, base=0.04), first=600) == []
    # One of 16 replicas 1.5x slower: named within 6 windows, nobody else.
    events = run(watch, 6, lambda w: fleet(16, {5: 1.5}), first=660)
    assert firings(events) == [("10.0.0.5:8000", "itl")]
    assert "10.0.0.5:8000" in events[0].hints[0].message and events[0].hints[0].code == "replica_outlier"
    assert watch.view("m")["10.0.0.5:8000"]["itl"] > 1.3


def test_a_named_replica_does_not_widen_the_spread_its_peers_are_judged_with() -> None:
    """One replica of four 2.5x slower is a quarter of the differences: kept in the spread,
    it becomes the spread's 90th percentile (three times the healthy one here) and hides
    the next replica to go bad for minutes. Named, its differences are left out, in the
    request logs' comparison and in the scrapes'; a second replica 1.6x slower is named
    within a few windows of its start."""
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    run(watch, 60, lambda w: fleet(4))
    healthy = watch.calibration["m|itl"].inflation()
    events = run(watch, 90, lambda w: fleet(4, {1: 2.5}), first=60)
    assert watch.calibration["m|itl"].inflation() == pytest.approx(healthy, rel=0.2)
    events += run(watch, 60, lambda w: fleet(4, {1: 2.5, 3: 1.6}), first=150)
    assert firings(events) == [("10.0.0.1:8000", "itl"), ("10.0.0.3:8000", "itl")]
    second = next(e for e in events if e.segment["instance"] == "10.0.0.3:8000")
    assert second.window_end <= (150 + 6) * 10.0

    peers, found = EnginePeers(DetectorConfig()), []
    rng = np.random.default_rng(9)
    for t in range(0, 3600, 10):
        if t == 1200:
            spread = tail_spread(peers.spread["m"][Signal.ITL])
        if t == 2400:
            assert tail_spread(peers.spread["m"][Signal.ITL]) == pytest.approx(spread, rel=0.2)
        for k in range(4):
            slow = 2.5 if k == 1 and t >= 1200 else 1.6 if k == 3 and t >= 2400 else 1.0
            found += peers.observe(engine(k, float(t), itl=0.02 * slow * float(rng.lognormal(0.0, 0.1))))
    assert firings(found) == [("10.0.0.1:8000", "itl"), ("10.0.0.3:8000", "itl")]
    assert next(e for e in found if e.segment["instance"] == "10.0.0.3:8000").window_end <= 2400 + 6 * 10


def bimodal_rows(start: float, instances: int, rng: np.random.Generator) -> list[WindowStats]:
    """One window of healthy replicas whose requests are fast or 4x slower by the moment (as
    the real ``dram_only`` run's prefill), the mix moving from window to window, 1-4 requests
    each, each with the share of its life in the window (``recent_columns``)."""
    slow_share = rng.beta(1.0, 2.0)
    out = []
    for k in range(instances):
        n = int(rng.integers(1, 5))
        itl = np.where(rng.random(n) < slow_share, 0.08, 0.02) * rng.lognormal(0.0, 0.02, n)
        row = WindowStats(f"~replica|model=m|route=-|instance=10.0.0.{k}:8000", start, WINDOW, requests=n, itl_n=n)
        logs, share = log_seconds(itl), rng.uniform(0.05, 1.0, n)
        row.block.sums[0, [COLUMN_OF["itl_log"], COLUMN_OF["itl_log2"]]] = logs.sum(), (logs**2).sum()
        add_recent(row, logs, share)
        out.append(row)
    return out


@pytest.mark.parametrize(("instances", "seed", "windows"), [(4, 4, 1000), (8, 2, 800)])
def test_healthy_replicas_whose_latency_has_two_modes_page_no_one(instances: int, seed: int, windows: int) -> None:
    # The median of a few peers' means sits on the majority mode: against it, every replica
    # whose few requests mix the modes read slower, window after window (against the median,
    # both cases paged within these windows).
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    rng = np.random.default_rng(seed)
    events = [e for w in range(windows) for e in watch.observe(bimodal_rows(w * WINDOW, instances, rng))]
    assert firings(events) == []


def test_a_replica_far_faster_than_its_peers_makes_none_of_them_read_slower() -> None:
    # A newer GPU among older ones: in a plain mean of the peers, it pulled each one's
    # reference down by a third of its lead, and all three were named.
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    assert firings(run(watch, 600, lambda w: fleet(4, {0: 0.4}))) == []


def test_two_replicas_say_they_differ_not_which_one_is_faulty() -> None:
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    events = run(watch, 40, lambda w: fleet(2, {1: 2.5} if w >= 30 else None))
    assert firings(events)[0] == ("10.0.0.1:8000", "itl")
    assert "not which one is faulty" in events[0].hints[0].message
    # No majority says which one to drain: the triage feed hears of it, no pager does.
    assert events[0].severity == "info" and not any(e.pages for e in events)


def test_a_replica_that_completes_few_slow_requests_is_named_without_waiting_for_more() -> None:
    """A replica slowed down finishes few requests for a while (the rest are still running):
    its few are judged as they come, not pooled as a quiet replica's would be. A drained
    replica finishing as few, as fast as its peers, is not named."""

    def window(w: int, instance_n: int, slow: float, rng: np.random.Generator) -> list[WindowStats]:
        out = []
        for k, typical in fleet(8).items():
            n, factor = (instance_n, slow) if k == "10.0.0.5:8000" else (12, 1.0)
            out += rows(w * WINDOW, {k: typical * factor}, rng, n=n)
        return out

    for slow, named in ((2.5, True), (1.0, False)):
        watch, rng = ReplicaWatch(DetectorConfig(), warmup_requests=0), np.random.default_rng(4)
        for w in range(300):
            assert watch.observe(window(w, 12, 1.0, rng)) == []
        events = [e for w in range(300, 303) for e in watch.observe(window(w, 2, slow, rng))]
        assert firings(events) == ([("10.0.0.5:8000", "itl")] if named else [])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_quiet_replica_that_slows_down_is_compared_every_window_its_few_requests_say_enough(seed: int) -> None:
    """Every replica completes 4 requests a window, fewer than a comparison waits for. Once
    one window's few hold as much evidence as a window may add, they are compared rather
    than pooled: a 2.5x slower replica is named within 4 windows (pooled until it had served
    ``MIN_BLOCK_REQUESTS``, it would be named in the sixth on each of these seeds), and
    healthy ones never."""
    for factor, named in ((2.5, True), (1.0, False)):
        watch, rng = ReplicaWatch(DetectorConfig(), warmup_requests=0), np.random.default_rng(seed)
        for w in range(300):
            assert watch.observe(rows(w * WINDOW, fleet(8), rng, n=4)) == []
        events = [e for w in range(300, 304) for e in watch.observe(rows(w * WINDOW, fleet(8, {5: factor}), rng, n=4))]
        assert firings(events) == ([("10.0.0.5:8000", "itl")] if named else [])


def test_a_replica_slowed_a_moment_ago_is_named_sooner_by_the_requests_that_ran_mostly_since() -> None:
    """A request log is written when the request ends: for a while after a replica slows
    down, its requests were slowed for the part of their life since. Weighed by the share of
    its life each spent in its window, the recent ones show the change in full. Over 8 seeds
    of a quiet fleet (6 requests a replica a window, a per-request spread as tight as the
    simulator's), a replica 2.5x slower is named no later on any seed, and sooner on some,
    than by all its requests alike; healthy ones are never named."""

    def named_after(seed: int, recent: bool, factor: float) -> int | None:
        watch, rng = ReplicaWatch(DetectorConfig(), warmup_requests=0), np.random.default_rng(seed)
        for w in range(300):
            assert watch.observe(rows(w * WINDOW, fleet(4), rng, n=6, recent=recent, sigma=0.1)) == []
        change = ("10.0.0.2:8000", 300 * WINDOW, factor)
        for k in range(8):
            window = rows((300 + k) * WINDOW, fleet(4, {2: factor}), rng, n=6, recent=recent, change=change, sigma=0.1)
            if found := firings(watch.observe(window)):
                assert found == [("10.0.0.2:8000", "itl")]
                return k + 1
        return None

    plain = [named_after(seed, False, 2.5) or 99 for seed in range(8)]
    weighed = [named_after(seed, True, 2.5) or 99 for seed in range(8)]
    assert max(weighed) <= 2 and all(w <= p for w, p in zip(weighed, plain, strict=True)) and sum(weighed) < sum(plain)
    assert all(named_after(seed, True, 1.0) is None for seed in range(8))


def test_a_new_replica_is_judged_once_it_has_served_its_warmup() -> None:
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=100)
    run(watch, 30, lambda w: fleet(4))
    # A fifth replica joins, warming up 3x slower for its first windows: not judged yet.
    assert run(watch, 8, lambda w: {**fleet(4), "10.0.0.9:8000": 0.06}, first=30) == []
    assert watch.models["m"]["10.0.0.9:8000"].served == 96


def test_a_rolling_restart_pages_no_one_from_request_logs_or_scrapes() -> None:
    """Each of 4 replicas in turn restarted with an empty prefix cache, which fills again as it
    prefills (``SimPhase.cold_instances``): its first requests miss the cache, nothing is wrong."""
    scenario = rolling_restart()
    assert run_scenario(scenario, seed=7).group_pages == []
    assert run_scrape_scenario(scenario.build(7)).paging_groups == []


def test_a_drained_replica_resolves_and_a_restarted_watch_goes_on_from_its_state() -> None:
    stored: dict[str, dict] = {}
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    events = run(watch, 30, lambda w: fleet(4, {2: 2.5} if w >= 20 else None))
    assert firings(events) == [("10.0.0.2:8000", "itl")]
    stored.update((key, json.loads(json.dumps(state))) for key, state in watch.states())
    restarted = ReplicaWatch(DetectorConfig(), warmup_requests=0, restore=stored.get)
    # Replayed windows are not judged again; the drained replica resolves, once.
    assert run(restarted, 30, lambda w: fleet(4, {2: 2.5} if w >= 20 else None)) == []
    later = run(restarted, 5, lambda w: {k: v for k, v in fleet(4).items() if k != "10.0.0.2:8000"}, first=30)
    assert [(e.segment["instance"], e.transition) for e in later] == [("10.0.0.2:8000", "resolved")]


def test_a_restarted_watch_keeps_the_spread_and_calibration_it_learned() -> None:
    """Stored with the model's instances and read back: the restarted watch judges the next
    windows as the one that never stopped does, not from the prior."""
    stored: dict[str, dict] = {}
    steady = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    run(steady, 60, lambda w: fleet(4))
    stored.update((key, json.loads(json.dumps(state))) for key, state in steady.states())
    restarted = ReplicaWatch(DetectorConfig(), warmup_requests=0, restore=stored.get)
    run(restarted, 1, lambda w: fleet(4), first=60, seed=2)  # meets the model, from the store
    run(steady, 1, lambda w: fleet(4), first=60, seed=2)
    assert restarted.spread["m"] and restarted.spread["m"] == pytest.approx(steady.spread["m"], rel=1e-4)
    assert restarted.calibration.keys() == steady.calibration.keys()
    for phase, kept in steady.calibration.items():
        assert list(restarted.calibration[phase].seen) == pytest.approx(list(kept.seen), abs=1e-3)
    later = [run(watch, 20, lambda w: fleet(4, {1: 1.6} if w >= 65 else None), first=61, seed=3)
             for watch in (steady, restarted)]  # fmt: skip
    assert later[0] and [(e.id, e.transition) for e in later[0]] == [(e.id, e.transition) for e in later[1]]


def test_replica_rows_change_no_segment_verdict_and_no_count() -> None:
    workload = Workload((Phase("normal", 900), Phase("slow", 300, decode_slowdown=3.0)), seed=3)
    batches = [orjson.dumps(batch) for _, batch in workload.seconds() if batch]
    results = []
    for compare in (False, True):
        replay = Replay(Settings(compare_replicas=compare))
        events = [e for offset, raw in enumerate(batches) for e in replay.feed(raw, offset)] + replay.finish()
        segment_events = [(e.fingerprint, e.transition) for e in events if "replica_" not in e.summary.lower()]
        results.append((segment_events, replay.stats.records, replay.stage_two.judged_records))
    assert results[0] == results[1] and results[0][1] > 0


@pytest.mark.parametrize("seed", [7, 9])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_one_slow_replica_of_four_on_real_arrivals_is_named_within_three_windows(kind: str, seed: int) -> None:
    result = run_scenario(slow_replica(4, 2.5, kind), seed)
    named = [e for e in result.pages if e.segment.get("instance") == FAULTY_HOST and e.window_end > result.injected_at]
    assert named and {h.code for e in named for h in e.hints} >= {"replica_outlier"}
    onset = WINDOW * (result.injected_at // WINDOW)
    assert (min(e.window_end for e in named) - onset) / WINDOW <= 3
    others = {e.segment.get("instance") for e in result.pages if "instance" in e.segment} - {FAULTY_HOST}
    assert not others and not result.false_group_pages


@pytest.fixture(scope="module")
def replica_note() -> Notification:
    watch = ReplicaWatch(DetectorConfig(), warmup_requests=0)
    events = run(watch, 40, lambda w: fleet(4, {3: 2.5} if w >= 30 else None))
    grouper = IncidentGrouper()
    event, [group] = grouper.add(events[0])
    return Notification(sink="s", group=group, members=(event,), seq=1, sent_at=group.window_end + 1)


def test_a_replica_incident_groups_per_instance(replica_note: Notification) -> None:
    assert replica_note.group.cause == "replica_outlier 10.0.0.3:8000"


def test_the_instance_is_a_slack_field(replica_note: Notification) -> None:
    payload = build_message(replica_note).model_dump(mode="json", exclude_none=True)
    fields = [f["text"] for block in payload["blocks"] for f in block.get("fields", [])]
    assert "*Instance*\n10.0.0.3:8000" in fields


def test_the_instance_is_a_pagerduty_custom_detail(replica_note: Notification) -> None:
    details = json.loads(build_event(replica_note, "k" * 32).body())["payload"]["custom_details"]
    assert details["instance"] == "10.0.0.3:8000" and details["lead"]["signal"] == Signal.ITL.value


def test_the_instance_is_an_alertmanager_label(replica_note: Notification) -> None:
    [alert] = build_alerts(replica_note, Timing())
    assert alert.labels["instance"] == "10.0.0.3:8000" and alert.labels["model"] == "m"


def engine(k: int, t: float, *, itl: float = 0.02, prefill_per_token: float = 1e-4, hit: float = 0.6,
           errors: float = 0.0) -> EngineWindow:  # fmt: skip
    """One engine's interval: 20 requests of 2,000 prompt tokens, ``hit`` of them cached."""
    uncached = 2000 * (1 - hit)
    return EngineWindow(
        key=f"10.0.0.{k}:8000|m", labels={"model": "m", "instance": f"10.0.0.{k}:8000"}, start=t - 10,
        end=t + 0.3 * k, requests=20, prompt_tokens_per_s=4000, output_tokens_per_s=400, running=4, waiting=0,
        kv_cache_usage=0.3, cache_hit_rate=hit, preempted=0, errors=errors,
        latency={"itl": LatencySummary(count=2000, mean_s=itl),
                 "prefill_time": LatencySummary(count=20, mean_s=prefill_per_token * uncached)},
    )  # fmt: skip


def test_from_scrapes_a_cold_restarted_engine_is_not_named_and_a_failing_one_is() -> None:
    peers, events = EnginePeers(DetectorConfig()), []
    rng = np.random.default_rng(3)
    for t in range(0, 3600, 10):
        for k in range(4):
            noise = float(rng.lognormal(0.0, 0.1))
            # Engine 2 restarted at 1,800 s: its cache is empty, so it prefills 2.5x the tokens.
            cold = k == 2 and 1800 <= t < 2400
            failing = k == 3 and t >= 3000
            events += peers.observe(engine(k, float(t), prefill_per_token=1e-4 * noise, hit=0.0 if cold else 0.6,
                                           itl=0.02 * noise, errors=2.0 if failing else 0.0))  # fmt: skip
    assert firings(events) == [("10.0.0.3:8000", "error_rate")]


def test_from_scrapes_an_interval_of_few_requests_is_judged_with_the_error_few_requests_have() -> None:
    """Scraped intervals hold from 3 to 60 requests (night and day): the mean prefill of 3
    strays far more than the mean of 60, and a spread learned without the counts takes one
    such interval for a slow replica. Judged per request, six hours page no one, and a replica
    prefilling 2.5x slower is still named."""
    peers, events = EnginePeers(DetectorConfig()), []
    rng = np.random.default_rng(11)
    for t in range(0, 6 * 3600, 10):
        busy = 3 + int(57 * (0.5 + 0.5 * np.sin(t / 3600)))  # requests per interval: 3 to 60
        for k in range(4):
            n = max(int(rng.poisson(busy)), MIN_COUNT)
            per_token = float(np.exp(rng.normal(0.0, 0.8, n)).mean())  # heavy per-request spread
            slow = 2.5 if k == 1 and t >= 5 * 3600 else 1.0
            window = engine(k, float(t), prefill_per_token=1e-4 * per_token * slow)
            window.latency["prefill_time"] = LatencySummary(count=n, mean_s=window.latency["prefill_time"].mean_s)
            events += peers.observe(window)
    assert firings(events) == [("10.0.0.1:8000", "prefill_per_token")]
    assert min(e.window_end for e in events) > 5 * 3600


def test_from_scrapes_prefill_per_token_is_read_on_the_requests_the_histogram_holds() -> None:
    """An interval's mean prefill time follows the few long, uncached prompts that finished in
    it. Divided by the engine's pooled tokens per request, a healthy engine swings by several
    x from one interval to the next; divided by the uncached tokens of the very requests that
    finished (``request_prefill_kv_computed_tokens``), it holds still, and a replica prefilling
    2.5x slower is named on its second interval, as one engine's evidence may be (half the bar
    per interval)."""
    rng = np.random.default_rng(5)

    def run(matched: bool) -> tuple[list[AnomalyEvent], list[float]]:
        peers, events, healthy = EnginePeers(DetectorConfig()), [], []
        for t in range(0, 3600, 10):
            for k in range(4):
                n = 12
                prompts = np.exp(rng.normal(7.0, 1.3, n))  # heavy-tailed prompt lengths
                uncached = prompts * (rng.random(n) < 0.4)  # most prompts are served from the cache
                slow = 2.5 if k == 1 and t >= 3000 else 1.0
                window = replace(
                    engine(k, float(t)),
                    latency={"prefill_time": LatencySummary(count=n, mean_s=float(2e-4 * slow * uncached.mean()))},
                    uncached_per_finished=float(uncached.mean()) if matched else math.nan,
                )
                events += peers.observe(window)
                if k != 1 and t >= 600:
                    healthy += [r for s, r in peers.states["m"][f"10.0.0.{k}:8000"].ratio.items()
                                if s == "prefill_per_token"]  # fmt: skip
        return events, healthy

    events, healthy = run(matched=True)
    assert firings(events) == [("10.0.0.1:8000", "prefill_per_token")]
    assert min(e.window_end for e in events) <= 3000 + 2 * 10 + 1
    assert max(healthy) < 1.05 and min(healthy) > 1 / 1.05
    _, pooled = run(matched=False)
    assert max(pooled) / min(pooled) > 10  # what the same mix did to the old reading


def test_from_scrapes_an_engine_that_served_short_prompts_awhile_is_not_a_slow_replica() -> None:
    """Every prefill costs some time whatever its length (here 0.02 s, 167 tokens' worth), so
    per uncached token a quiet engine's interval of short prompts reads slow, and from scrapes
    one engine may serve the short ones for a minute. The model's fixed cost is learned from
    its engines' intervals: read with it, eight hours of heavy-tailed prompt lengths page no
    one, and a replica prefilling 2.5x slower is still named; read without it, they page."""

    def run(learned: bool) -> tuple[list[AnomalyEvent], EnginePeers]:
        peers, events = EnginePeers(DetectorConfig()), []
        if not learned:
            peers.prefill_cost["m"] = PrefillCost(min_intervals=10**9)
        rng = np.random.default_rng(2)
        for t in range(0, 8 * 3600, 10):
            for k in range(4):
                n = max(int(rng.poisson(5)), MIN_COUNT)
                uncached = rng.lognormal(6.5, 1.2, n)
                slow = 2.5 if k == 1 and t >= 7 * 3600 else 1.0
                prefill = slow * (0.02 + 1.2e-4 * uncached * rng.lognormal(0.0, 0.1, n))
                window = replace(
                    engine(k, float(t)),
                    latency={"prefill_time": LatencySummary(count=n, mean_s=float(prefill.mean()))},
                    uncached_per_finished=float(uncached.mean()),
                )
                events += peers.observe(window)
        return events, peers

    events, peers = run(learned=True)
    assert firings(events) == [("10.0.0.1:8000", "prefill_per_token")]
    assert min(e.window_end for e in events) > 7 * 3600
    assert 120 < peers.prefill_cost["m"].overhead_tokens < 220
    plain, _ = run(learned=False)
    assert any(e.window_end < 7 * 3600 for e in plain if e.transition == "firing")


def test_from_scrapes_a_restarted_worker_resolves_the_replica_incident_its_predecessor_fired() -> None:
    stored: dict[str, dict[str, object]] = {}
    first = EnginePeers(DetectorConfig(), save_every=30)
    events = []
    for t in range(0, 900, 10):
        for k in range(4):
            events += first.observe(engine(k, float(t), itl=0.05 if k == 2 and t >= 600 else 0.02))
        stored.update(orjson.loads(orjson.dumps(first.states_to_save())))  # as the state table holds them
    assert firings(events) == [("10.0.0.2:8000", "itl")]
    # Killed; a successor reads the table and sees engine 2 healthy again.
    successor = EnginePeers(DetectorConfig(), save_every=30, restore=stored.get)  # type: ignore[arg-type]
    successor._meet("m")
    assert successor.prefill_cost["m"].intervals >= 4 * 60  # the prefill cost it learned goes on too
    after = []
    for t in range(900, 1200, 10):
        for k in range(4):
            after += successor.observe(engine(k, float(t)))
    assert [(e.segment["instance"], e.transition) for e in after] == [("10.0.0.2:8000", "resolved")]
    # A model nobody stored (or stored by another version) starts fresh.
    assert EnginePeers(restore={"~engine-peers|m": {"instances": 3}}.get)._meet("m") == {}  # type: ignore[arg-type]


def test_from_scrapes_a_worker_killed_while_an_interval_is_held_pages_it_after_the_restart() -> None:
    """One engine's single slow interval is held until its peers report over the same time;
    the worker is killed before they do. Its successor restores the hold from the table,
    waits for the peers, and pages the interval as the worker would have."""

    def play(kill_at_hold: bool) -> list[AnomalyEvent]:
        stored: dict[str, dict[str, object]] = {}
        peers, events = EnginePeers(DetectorConfig(), save_every=30), []
        for t in range(0, 1200, 10):
            for k in range(4):
                events += peers.observe(engine(k, float(t), itl=0.06 if (k, t) == (2, 1000) else 0.02))
                stored.update(orjson.loads(orjson.dumps(peers.states_to_save())))  # as the table holds them
                if kill_at_hold and (k, t) == (2, 1000):
                    assert stored["~engine-peers|m"]["held"]  # type: ignore[index]
                    peers = EnginePeers(DetectorConfig(), save_every=30, restore=stored.get)  # type: ignore[arg-type]
        return events

    uninterrupted = play(kill_at_hold=False)
    assert firings(uninterrupted) == [("10.0.0.2:8000", "itl")]
    restarted = play(kill_at_hold=True)
    assert [(e.window_end, e.transition) for e in restarted] == [(e.window_end, e.transition) for e in uninterrupted]


def _out_of_step(change_at: float, slowed: set[int]) -> list[AnomalyEvent]:
    """Four engines scraped every 10 s, 2.5 s apart; from ``change_at`` the engines of
    ``slowed`` decode 2.5x slower (an interval spanning the change shows it in part)."""
    peers, events = EnginePeers(DetectorConfig()), []
    rng = np.random.default_rng(5)
    for t in range(0, 1200, 10):
        for k in range(4):
            end = t + 2.5 * k
            after = min(max((end - change_at) / 10.0, 0.0), 1.0) if k in slowed else 0.0
            itl = 0.02 * float(rng.lognormal(0.0, 0.05)) * (1 + 1.5 * after)
            events += peers.observe(replace(engine(k, float(t), itl=itl), start=end - 10.0, end=end))
    return events


def test_from_scrapes_one_interval_pages_alone_only_against_the_peers_over_the_same_time() -> None:
    """Engines are scraped out of step: when every engine slows down at once, the first
    interval to span the change meets peers whose latest intervals end before it. Judged
    again against the peers' intervals over its own span, it is no outlier, and nothing
    pages. One engine slowing down alone differs as much over the same span: its first
    interval that is wholly slow pages alone, not the one after it."""
    assert firings(_out_of_step(1005.0, {0, 1, 2, 3})) == []
    events = _out_of_step(1005.0, {2})
    assert firings(events) == [("10.0.0.2:8000", "itl")]
    first = min(e.window_end for e in events if e.transition == "firing")
    assert first == 1015.0  # its interval 1005-1015, the first after the change


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_from_scrapes_one_slow_replica_of_four_is_named_alone(phase: str) -> None:
    """Named alone, and within 3 windows of the fault's: a request's prefill time is scraped
    when it finishes, so the prefill case shows a request's length later than the decode case
    does, and each of this quiet engine's intervals holds a handful of finished requests."""
    scenario = slow_replica(4, 2.5, phase)
    workload = scenario.build(7)
    run = run_scrape_scenario(workload)
    injected_at = workload.start + scenario.warmup_s
    causes = [(g.cause, g.window_end > injected_at) for g in run.paging_groups]
    assert causes[0] == (f"replica_outlier {FAULTY_HOST}", True) and all(after for _, after in causes)
    assert run.paging_groups[0].window_end - 10.0 * (injected_at // 10.0) <= 3 * 10.0


async def test_the_replica_table_shows_the_scrapes_comparison_beside_the_request_logs(
    make_client: MakeClient,
) -> None:
    peers, store = EnginePeers(DetectorConfig(), series=[]), TriageStore()
    for t in range(0, 900, 10):
        for k in range(4):
            for event in peers.observe(engine(k, float(t), itl=0.05 if k == 2 and t >= 600 else 0.02)):
                store.add(event)
    assert peers.series
    for point in peers.series:
        store.add(point)
    rows = store.replicas("m")
    assert [row.point.segment["instance"] for row in rows] == [f"10.0.0.{k}:8000" for k in range(4)]
    assert {row.point.segment["source"] for row in rows} == {"scrapes"}
    page = await (await (await make_client(store)).get("/replicas", params={"model": "m"})).text()
    assert page.count("<td>scrapes</td>") == 4 and re.search(r'class="num firing">2\.\d\dx', page)


async def test_the_triage_page_has_a_replica_table_linked_from_the_incident(make_client: MakeClient) -> None:
    bank = DetectorBank(DetectorConfig(replica_warmup_requests=0), series=[])
    rng = np.random.default_rng(5)
    store, grouper = TriageStore(), IncidentGrouper()
    for w in range(40):
        for event in bank.observe_all(rows(w * WINDOW, fleet(4, {3: 2.5} if w >= 28 else None), rng)):
            event, groups = grouper.add(event)
            for record in (event, *groups):
                store.add(record)
    for point in bank.series or []:
        store.add(point)
    client = await make_client(store)
    page = await (await client.get("/replicas", params={"model": "m"})).text()
    assert page.count("<code>10.0.0.") == 4 and re.search(r'class="num firing">2\.\d\dx', page)
    assert "10.0.0.3:8000" not in await (await client.get("/segments")).text()
    [group] = store.groups(Filters())
    assert 'href="/replicas?model=m"' in await (await client.get(f"/groups/{group.group}")).text()


# The comparison's shortcuts give what the plain computations give (the peers' totals, one
# subtraction from the segment's, up to rounding; the tail spread to the last bit): the
# detectors' decisions (and the golden replay) must not move with them.
FINITE = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 50), FINITE, st.booleans()), min_size=2, max_size=70),
    st.floats(min_value=1e-4, max_value=1e4),
)
def test_the_peers_reference_is_the_others_less_the_named_while_any_is_left(
    rows: list[tuple[int, float, bool]], variance: float
) -> None:
    means = {f"i{k}": (float(n), mean) for k, (n, mean, _) in enumerate(rows)}
    named = frozenset(f"i{k}" for k, (_, _, is_named) in enumerate(rows) if is_named)
    plain = _peers(means, named, 1e300)  # no mean is far from the rest: every weight is 1
    for instance, (peer_n, peer_sum) in _peers(means, named, variance).items():
        others = [means[other] for other in means if other != instance]
        chosen = [means[other] for other in means if other != instance and other not in named] or others
        assert plain[instance][0] == sum(n for n, _ in chosen)
        assert math.isclose(plain[instance][1], math.fsum(n * m for n, m in chosen), rel_tol=1e-9, abs_tol=1e-3)
        # Weighed down, never up: a level among the chosen peers' means, from no more requests.
        assert peer_n <= sum(n for n, _ in chosen) * (1 + 1e-12)
        level = peer_sum / peer_n
        low, high = min(m for _, m in chosen), max(m for _, m in chosen)
        assert low - 1e-6 * (1 + abs(low)) <= level <= high + 1e-6 * (1 + abs(high))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1, max_size=600))
def test_tail_spread_is_numpys_percentile(values: list[float]) -> None:
    assert tail_spread(values) == float(np.quantile(np.array(values), 0.9)) / 1.645
