"""The fleet simulation's vLLM ``/metrics``, as ``servewatch scrape --record`` would have recorded them.

Why: a fleet that ships no request logs is judged on its engines' Prometheus scrapes alone
(``servewatch replay --scrapes``, the worker's engine stage), and fed scrapes of normal
bursty traffic that path paged falsely. To reproduce that in the detection bench, without a
real fleet, this module renders what each vLLM V1 engine of a simulated
``pipeline.dev.serving_sim.TraceWorkload`` would expose at each scrape, and replays them
through ``pipeline.replay.scrapes.ScrapeReplay`` as the command does: rendered as text and
recorded as JSON lines (``iter_scrape_lines``), or, in the bench and the tests, read from their
metric families as the text parser would read the text (``iter_scrape_families``, several
times faster, the same snapshots: a test compares them scrape by scrape).

A series changes when vLLM V1 records it (``vllm/v1/metrics``), not when the request
finishes, because that timing is what the detectors see between two scrapes:

* at scheduling (the request's start): ``prefix_cache_queries``/``hits``, in tokens;
* at the first token (prefill done): ``prompt_tokens`` and ``time_to_first_token`` (from arrival);
* per decode step: ``generation_tokens`` and ``inter_token_latency``, one observation per step
  (so its count is tokens, not requests), spread evenly over the request's decode;
* at finish: ``request_success{finished_reason}`` and the e2e, queue, prefill and decode histograms;
* gauges at the scrape: requests running (scheduled, unfinished) and waiting (arrived, not
  scheduled), and KV usage: running requests' prompt plus generated tokens over the engine's
  KV budget (a shared cached prefix is counted per request; vLLM counts its blocks once); on
  a model whose simulated engines reserve each request's whole answer at admission (a
  ``kv_tokens`` budget), what they reserved, so that the gauge shows the cache as full
  exactly when the simulated scheduler finds it so.

Preemptions stay 0: the simulator's limit is its slots, not KV memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import orjson
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.dev.serving_sim import CACHE_BLOCK_TOKENS, TraceWorkload, load_trace
from servewatch.pipeline.replay.scrapes import ScrapeReplay, ScrapeReplayStats
from servewatch.pipeline.settings import Settings
from servewatch.schemas.anomaly import AnomalyEvent, Severity
from servewatch.schemas.incident_group import IncidentGroup

# vLLM's default bucket boundaries (``vllm/v1/metrics/loggers.py``; PR #48866 keeps them).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
#: vLLM's buckets of a size per request (``build_1_2_5_buckets`` up to the context length).
PROMPT_LENGTH_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
#: vLLM pre-creates one ``request_success`` child per reason, so zero-valued series exist.
FINISHED_REASONS = ("stop", "length", "abort", "error")
#: Without a ``kv_tokens`` on the model's spec, its engines hold ``max_num_seqs`` contexts of
#: this quantile of its trace's prompt + output lengths: sized for nearly all requests, as an
#: operator sets ``max_num_seqs`` for the KV memory the GPUs leave.
KV_CONTEXT_QUANTILE = 0.9
ENGINE_LABELS = ("engine", "model_name")


@dataclass(frozen=True, eq=False)
class EngineRequests:
    """One engine's simulated requests, times in seconds from the workload's start."""

    instance: str
    model: str
    kv_budget_tokens: float
    arrival: np.ndarray
    start: np.ndarray  # scheduled: a slot was free
    first_token: np.ndarray  # prefill done
    end: np.ndarray
    prompt: np.ndarray
    cached: np.ndarray
    output: np.ndarray
    finish: np.ndarray  # finish reason per request (str)
    reserved: np.ndarray | None = None  # KV tokens reserved at admission, where the engine reserves them

    @property
    def itl(self) -> np.ndarray:
        """Each request's inter-token latency (the simulator's is constant per request)."""
        steps = np.maximum(self.output - 1, 0).astype(np.float64)
        return np.divide(self.end - self.first_token, steps, out=np.zeros(len(steps)), where=steps > 0)

    def generated(self, t: float, among: np.ndarray) -> np.ndarray:
        """Tokens generated by time ``t`` by the requests ``among`` (indices): none before the
        first token, then one per decode step, spread evenly over the decode."""
        out, first, decode = self.output[among], self.first_token[among], (self.end - self.first_token)[among]
        share = np.clip((t - first) / np.where(decode > 0, decode, 1.0), 0.0, 1.0)
        made = np.where(t >= self.end[among], out, 1 + np.floor((out - 1) * share))
        return np.where((t < first) | (out == 0), 0, np.minimum(made, out)).astype(np.int64)


def engine_requests(workload: TraceWorkload) -> list[EngineRequests]:
    """Every engine's requests, after the workload simulated. Reads ``TraceWorkload._runs``
    (private: the simulator keeps its per-request arrays nowhere else)."""
    next(iter(workload.records()), None)  # simulates once, if not yet
    engines = []
    for index, spec in enumerate(workload.models):
        run = workload._runs[spec.name]
        budget = getattr(spec, "kv_tokens", None)
        if not budget:
            trace = load_trace(spec.trace)
            budget = spec.max_num_seqs * float(
                np.quantile(trace.prompt_tokens + trace.output_tokens, KV_CONTEXT_QUANTILE)
            )
        first = run.start + run.prefill
        finish = np.array(run.finish)
        for engine in range(spec.instances):
            mine = run.instance == engine
            engines.append(EngineRequests(
                instance=f"10.0.{index}.{10 + engine}:8000",  # as the request logs name it (``_to_records``)
                model=spec.name, kv_budget_tokens=float(budget), arrival=run.arrival[mine], start=run.start[mine],
                first_token=first[mine], end=(first + run.decode)[mine], prompt=run.prompt[mine],
                cached=run.cached[mine], output=run.output[mine], finish=finish[mine],
                reserved=run.kv_held[mine] if getattr(spec, "kv_tokens", None) else None,
            ))  # fmt: skip
    return engines


def _cumulative(at: np.ndarray, times: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Per scrape, the sum of ``weights`` (1 each by default) of what happened at or before it."""
    slot = np.searchsorted(times, at, side="left")  # the first scrape that sees it
    return np.cumsum(np.bincount(slot, weights, minlength=len(times) + 1)[: len(times)])


def _histogram(
    at: np.ndarray, values: np.ndarray, bounds: tuple[float, ...], times: np.ndarray, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per scrape, cumulative bucket counts (``le`` bounds, then +Inf) and the sum of the
    observations made at or before it; ``weights``: observations per value."""
    weights = np.ones(len(at)) if weights is None else weights.astype(np.float64)
    counts = np.zeros((len(times) + 1, len(bounds) + 1))
    np.add.at(counts, (np.searchsorted(times, at, side="left"), np.searchsorted(bounds, values)), weights)
    return counts[: len(times)].cumsum(axis=0).cumsum(axis=1), _cumulative(at, times, weights * values)


@dataclass(frozen=True, eq=False)
class EngineScrapes:
    """One engine's series at each of its scrapes (index ``k``), cumulative where vLLM's are."""

    engine: EngineRequests
    times: np.ndarray  # seconds from the workload's start
    counters: dict[str, np.ndarray]
    finished: dict[str, np.ndarray]
    histograms: dict[str, tuple[tuple[float, ...], np.ndarray, np.ndarray]]  # bounds, buckets, sums
    gauges: dict[str, np.ndarray]

    @classmethod
    def build(cls, engine: EngineRequests, times: np.ndarray) -> EngineScrapes:
        e, n = engine, len(times)
        answered = e.output > 0
        itl, steps = e.itl, np.maximum(e.output - 1, 0)
        counters = {
            "vllm:prefix_cache_queries": _cumulative(e.start, times, e.prompt.astype(np.float64)),
            "vllm:prefix_cache_hits": _cumulative(e.start, times, e.cached.astype(np.float64)),
            "vllm:prompt_tokens": _cumulative(e.first_token, times, e.prompt.astype(np.float64)),
            "vllm:generation_tokens": _cumulative(e.end, times, e.output.astype(np.float64)),  # + in flight below
            "vllm:num_preemptions": np.zeros(n),
        }
        finished = {reason: _cumulative(e.end[e.finish == reason], times) for reason in FINISHED_REASONS}
        at_finish = {
            "vllm:e2e_request_latency_seconds": e.end - e.arrival,
            "vllm:request_queue_time_seconds": e.start - e.arrival,
            "vllm:request_prefill_time_seconds": e.first_token - e.start,
            "vllm:request_decode_time_seconds": e.end - e.first_token,
        }
        histograms = {
            "vllm:time_to_first_token_seconds": (TTFT_BUCKETS, *_histogram(
                e.first_token[answered], (e.first_token - e.arrival)[answered], TTFT_BUCKETS, times)),
            "vllm:inter_token_latency_seconds": (ITL_BUCKETS, *_histogram(e.end, itl, ITL_BUCKETS, times, steps)),
            **{name: (REQUEST_LATENCY_BUCKETS, *_histogram(e.end, values, REQUEST_LATENCY_BUCKETS, times))
               for name, values in at_finish.items()},
            "vllm:request_prompt_tokens": (PROMPT_LENGTH_BUCKETS, *_histogram(
                e.end, e.prompt.astype(np.float64), PROMPT_LENGTH_BUCKETS, times)),
            "vllm:request_prefill_kv_computed_tokens": (PROMPT_LENGTH_BUCKETS, *_histogram(
                e.end, (e.prompt - e.cached).astype(np.float64), PROMPT_LENGTH_BUCKETS, times)),
        }  # fmt: skip
        running, waiting, kv = np.zeros(n), np.zeros(n), np.zeros(n)
        # The requests in flight at each scrape: their generated tokens and decode steps so
        # far add to the counters of the finished ones, and they hold the KV cache.
        by_start = np.argsort(e.start, kind="stable")
        starts, arrivals = e.start[by_start], np.sort(e.arrival)
        longest = float(np.max(e.end - e.start, initial=0.0))
        itl_bucket = np.searchsorted(ITL_BUCKETS, itl)
        gen = counters["vllm:generation_tokens"]
        _, itl_counts, itl_sums = histograms["vllm:inter_token_latency_seconds"]
        for k, t in enumerate(times):
            lo, hi = np.searchsorted(starts, (t - longest, t), side="right")
            inside = by_start[lo:hi]
            inside = inside[(e.end[inside] > t)]
            made = e.generated(float(t), inside)
            running[k] = len(inside)
            waiting[k] = np.searchsorted(arrivals, t, side="right") - hi
            held = e.reserved[inside] if e.reserved is not None else e.prompt[inside] + made
            kv[k] = min(float(np.sum(held)) / e.kv_budget_tokens, 1.0)
            gen[k] += made.sum()
            observed = np.maximum(made - 1, 0)
            step_counts = np.bincount(itl_bucket[inside], observed, minlength=len(ITL_BUCKETS) + 1)
            itl_counts[k] += np.cumsum(step_counts)
            itl_sums[k] += float(np.sum(observed * itl[inside]))
        gauges = {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting,
                  "vllm:kv_cache_usage_perc": kv}  # fmt: skip
        return cls(engine, times, counters, finished, histograms, gauges)

    def families(self, k: int) -> list[Metric]:
        """Scrape ``k`` as metric families, in vLLM's names and labels."""
        labels = ["0", self.engine.model]
        out: list[Metric] = []
        for name, bounds_counts_sums in self.histograms.items():
            bounds, counts, sums = bounds_counts_sums
            family = HistogramMetricFamily(name, name, labels=ENGINE_LABELS)
            uppers = (*bounds, float("inf"))
            buckets = [(floatToGoString(le), float(c)) for le, c in zip(uppers, counts[k], strict=True)]
            family.add_metric(labels, buckets, float(sums[k]))
            out.append(family)
        for name, values in self.counters.items():
            counter = CounterMetricFamily(name, name, labels=ENGINE_LABELS)
            counter.add_metric(labels, float(values[k]))
            out.append(counter)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by reason.",
                                      labels=[*ENGINE_LABELS, "finished_reason"])  # fmt: skip
        for reason, values in self.finished.items():
            success.add_metric([*labels, reason], float(values[k]))
        out.append(success)
        for name, values in self.gauges.items():
            gauge = GaugeMetricFamily(name, name, labels=ENGINE_LABELS)
            gauge.add_metric(labels, float(values[k]))
            out.append(gauge)
        config_labels = ["block_size", "enable_prefix_caching", "engine", "num_gpu_blocks"]
        config = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig.", labels=config_labels
        )
        blocks = int(self.engine.kv_budget_tokens // CACHE_BLOCK_TOKENS)
        config.add_metric([str(CACHE_BLOCK_TOKENS), "True", "0", str(blocks)], 1.0)
        out.append(config)
        return out

    def text(self, k: int) -> str:
        """Scrape ``k`` as exposition text, rendered by prometheus-client as an engine's is."""
        return generate_latest(_Families(self.families(k))).decode()


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def engine_scrapes(
    workload: TraceWorkload, interval_s: float = 10.0, jitter_s: float = 0.05, drain: bool = False
) -> list[EngineScrapes]:
    """Every engine's series at its scrapes, every ``interval_s`` of event time until the
    phases end (with ``drain``, until after the last request finished). Like Prometheus, the
    scraper gives each target its own fixed offset within the interval (so engines are not
    scraped at the same instant), and each scrape lands up to ``jitter_s`` late."""
    engines = engine_requests(workload)
    rng = np.random.default_rng([workload.seed, 0x5C2A])
    last = workload.duration_s
    if drain:
        last = max([last, *(float(np.max(e.end, initial=0.0)) + interval_s for e in engines)])
    out = []
    for engine in engines:
        ticks = np.arange(float(rng.uniform(0.0, interval_s)), last, interval_s)
        out.append(EngineScrapes.build(engine, ticks + rng.uniform(0.0, jitter_s, len(ticks))))
    return out


def _in_time_order(
    workload: TraceWorkload, interval_s: float, jitter_s: float, drain: bool
) -> Iterator[tuple[float, EngineScrapes, int]]:
    """Every engine's scrapes, in time order: (timestamp, the engine's series, scrape index)."""
    scrapes = engine_scrapes(workload, interval_s, jitter_s, drain)
    order = sorted((float(t), i, k) for i, s in enumerate(scrapes) for k, t in enumerate(s.times))
    for t, i, k in order:
        yield round(workload.start + t, 3), scrapes[i], k


def iter_scrape_lines(
    workload: TraceWorkload, interval_s: float = 10.0, jitter_s: float = 0.05, drain: bool = False
) -> Iterator[bytes]:
    """``{"timestamp", "instance", "body"}`` JSON lines in time order, as ``servewatch scrape
    --record`` writes them; rendered one by one (three hours of the default fleet is ~100 MB)."""
    for timestamp, scrapes, k in _in_time_order(workload, interval_s, jitter_s, drain):
        yield orjson.dumps({"timestamp": timestamp, "instance": scrapes.engine.instance, "body": scrapes.text(k)})


def iter_scrape_families(
    workload: TraceWorkload, interval_s: float = 10.0, jitter_s: float = 0.05, drain: bool = False
) -> Iterator[tuple[float, str, list[Metric]]]:
    """The scrapes of ``iter_scrape_lines`` as (timestamp, instance, metric families), not
    rendered: read as they are (``ScrapeReplay.feed_families``) they give what their text
    parses into, without the text round trip that took most of a long scrape replay's time."""
    for timestamp, scrapes, k in _in_time_order(workload, interval_s, jitter_s, drain):
        yield timestamp, scrapes.engine.instance, scrapes.families(k)


def scrape_lines(
    workload: TraceWorkload, interval_s: float = 10.0, jitter_s: float = 0.05, drain: bool = False
) -> list[bytes]:
    """All of ``iter_scrape_lines``."""
    return list(iter_scrape_lines(workload, interval_s, jitter_s, drain))


@dataclass
class ScrapeRun:
    """A replay of a workload's scrapes: its events, the replay's counts and the incident groups."""

    events: list[AnomalyEvent]
    stats: ScrapeReplayStats
    groups: list[IncidentGroup]  # the grouper's records, in order

    @property
    def pages(self) -> list[AnomalyEvent]:
        return [e for e in self.events if e.pages]

    @property
    def paging_groups(self) -> list[IncidentGroup]:
        """Per group that pages, its first record at warning or critical: when on-call is told."""
        first: dict[str, IncidentGroup] = {}
        for group in self.groups:
            if group.severity is not Severity.INFO and group.transition != "resolved":
                first.setdefault(group.group, group)
        return list(first.values())


def run_scrape_scenario(
    workload: TraceWorkload, settings: Settings | None = None, interval_s: float = 10.0
) -> ScrapeRun:
    """The workload's scrapes through ``ScrapeReplay`` and an ``IncidentGrouper``, as
    ``servewatch replay --scrapes`` runs them (each scrape read from its families, not its
    text: ``iter_scrape_families``)."""
    replay, grouper = ScrapeReplay(settings), IncidentGrouper()
    events, groups = [], []
    for timestamp, instance, families in iter_scrape_families(workload, interval_s):
        for event in replay.feed_families(families, instance, timestamp):
            event, told = grouper.add(event)
            events.append(event)
            groups.extend(told)
    return ScrapeRun(events, replay.stats, groups)
