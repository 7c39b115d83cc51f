"""Capacity detection from engine metrics: ``EngineInterval`` messages -> anomaly events.

``servewatch scrape`` publishes one ``EngineInterval`` per (instance, model) and scrape
interval to the scrapes topic, keyed ``instance|model``. Each is judged as it arrives, as
one window of that engine (``models.windows.engine_window``), by a ``DetectorBank`` that holds the
capacity signals only (KV-cache usage and waiting requests at the engine's load, and the
share of requests preempted; its phases' latency from its own histograms; its prefix-cache
hit rate), and watched for spare capacity (``models.detect.headroom``: an
``info`` event, never a page). No assembly is needed: an engine's intervals come from one
scraper, in order, on one partition. A replayed interval is judged once (the detectors
remember the last window they judged); one that fails validation is dead-lettered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import orjson
from pydantic import ValidationError

from servewatch.models.detect.bank import DetectorBank
from servewatch.models.detect.engine_peers import EnginePeers
from servewatch.models.detect.headroom import HeadroomWatch
from servewatch.models.detect.signals import ENGINE_SPECS
from servewatch.models.explain.hints import mention_engine_config
from servewatch.models.windows.engine_window import EngineMemory, engine_key
from servewatch.pipeline.messages.dead_letters import dead_letter, summarise_validation_error
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker import metrics
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.engine_interval import EngineInterval

logger = logging.getLogger(__name__)

#: The signals an engine's intervals are judged on.
ENGINE_SIGNALS = tuple(spec.signal.value for spec in ENGINE_SPECS)


@dataclass
class JudgeEngines:
    settings: Settings
    bank: DetectorBank = field(init=False)
    headroom: HeadroomWatch = field(default_factory=HeadroomWatch)
    # Each engine against the other engines of its model (``replica_outlier`` from scrapes),
    # stored beside the detectors (``EnginePeers.states_to_save``, under ``~engine-peers|<model>``).
    peers: EnginePeers = field(init=False)
    intervals: int = 0  # judged
    skipped: int = 0  # valid, but saying nothing about capacity (a restart inside, no length)
    replayed: int = 0  # judged before (at-least-once delivery, a scraper restarted on old records)
    # Per model, per instance: enable_prefix_caching as the engine's cache_config_info says it.
    prefix_caching: dict[str, dict[str, str]] = field(default_factory=dict)
    # Per engine, its recent scrapes: arrivals, busy slots and pooled per-request figures
    # (``EngineMemory``). Not stored with the detectors' state: a successor rebuilds it
    # within a few intervals, judging meanwhile on what was served, as without it.
    memory: dict[str, EngineMemory] = field(default_factory=dict)

    def __post_init__(self) -> None:
        config = replace(self.settings.detector_config(), signals=ENGINE_SIGNALS, source="engines")
        every = self.settings.windows.state_every_windows
        self.bank = DetectorBank(config, save_every=every)
        self.peers = EnginePeers(config, min_ratio=config.replica_min_ratio, save_every=every)

    def receive(
        self, raw: bytes | None, source: MessageOrigin | None = None
    ) -> tuple[list[AnomalyEvent], list[DeadLetter]]:
        """One message of the scrapes topic: an interval, or a JSON array of them."""
        source = source or MessageOrigin()
        if not raw:
            return [], [dead_letter("empty", "empty message", b"", source)]
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return [], [dead_letter("invalid_json", str(exc), raw, source)]
        items = value if isinstance(value, list) else [value]
        events: list[AnomalyEvent] = []
        letters: list[DeadLetter] = []
        for index, item in enumerate(items):
            position = index if isinstance(value, list) else None
            try:
                interval = EngineInterval.model_validate(item)
            except ValidationError as exc:
                letters.append(
                    dead_letter("validation", summarise_validation_error(exc), orjson.dumps(item), source, position)
                )
                continue
            events.extend(self.judge(interval))
        for letter in letters:
            metrics.DEAD_LETTERS.labels(letter.reason).inc()
        return events, letters

    def judge(self, interval: EngineInterval) -> list[AnomalyEvent]:
        caching = interval.cache_config.get("enable_prefix_caching")
        if caching is not None:
            self.prefix_caching.setdefault(interval.model, {})[interval.instance] = caching
        key = engine_key(interval.instance, interval.model)
        says = interval.end > interval.start and not interval.counter_reset
        if says and interval.end <= self.bank.segment(key).last_window_end:
            self.replayed += 1  # before the memory sees it: a replayed interval must not count twice
            return []
        window = self.memory.setdefault(key, EngineMemory()).window(interval)
        if window is None:
            self.skipped += 1
            return []
        self.intervals += 1
        events = self.bank.observe(window)  # type: ignore[arg-type]  # EngineWindow reads as WindowStats here
        events = self.explain(events)  # an engine's own TTFT or prefill page, too, names the engines with caching off
        if self.settings.replicas.compare_replicas:
            events += self.peers.observe(window)
        spare = self.headroom.observe(window)
        return events if spare is None else [*events, spare]

    def explain(self, events: list[AnomalyEvent]) -> list[AnomalyEvent]:
        """The events with what the engines' metrics say added: a collapsed hit rate on a
        model whose engines report prefix caching off names those engines."""
        explained = []
        for event in events:
            caching = self.prefix_caching.get(event.segment.get("model", ""))
            explained.append(mention_engine_config(event, caching) if caching else event)
        return explained
