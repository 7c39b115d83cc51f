"""``servewatch demo``: broker + worker + a scripted workload, anomaly events printed live.

The workload plays a compressed scenario in event time: normal traffic, a 3x traffic
surge, recovery, then prefix caching switched off at flat traffic. Expected: the surge is
reported as ``explained_by_load`` (``info``, no page) and the cache-off incident fires a
paging ``ttft`` anomaly within a few windows. The worker is a separate process, exactly
as in production; this module only produces, reads and prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from servewatch.models.explain.event_text import event_text, group_text
from servewatch.pipeline import topics
from servewatch.pipeline.changes.render import render
from servewatch.pipeline.changes.store import parse_change_record, write_marker
from servewatch.pipeline.dev.broker import free_loopback_port
from servewatch.pipeline.dev.simulator import EPOCH, Workload, demo_phases
from servewatch.pipeline.kafka import PLAINTEXT, KafkaAuth, producer, read_topic
from servewatch.schemas.anomaly import AnomalyEvent, Status
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport
from servewatch.schemas.incident_group import IncidentGroup, parse_anomaly_record

logger = logging.getLogger(__name__)


@dataclass
class DemoOutcome:
    events: list[AnomalyEvent] = field(default_factory=list)
    groups: list[IncidentGroup] = field(default_factory=list)  # the groups' records, as they came
    records: int = 0
    phase_of: dict[str, str] = field(default_factory=dict)  # event id -> phase name
    reports: list[ChangeReport] = field(default_factory=list)  # the change watcher's, as they came

    def paging_in(self, phase: str) -> list[AnomalyEvent]:
        return [e for e in self.events if self.phase_of.get(e.id) == phase and e.pages]

    @property
    def surge_explained(self) -> bool:
        surge = [e for e in self.events if self.phase_of.get(e.id) == "surge" and e.status is Status.FIRING]
        return bool(surge) and all(e.explained_by_load for e in surge) and not self.paging_in("surge")

    @property
    def cache_off_paged(self) -> bool:
        return any(e.signal.value == "ttft" and not e.explained_by_load for e in self.paging_in("cache_off"))

    def groups_that_paged(self) -> dict[str, IncidentGroup]:
        """Each group that paged, by key, as its latest record tells it."""
        latest = {g.group: g for g in self.groups}
        paged = {g.group for g in self.groups if g.pages}
        return {key: group for key, group in latest.items() if key in paged}


def format_event(event: AnomalyEvent, phase: str, update: bool = False) -> str:
    """Two or three lines for a terminal, led by the demo's clock and phase."""
    offset = int(event.window_start - EPOCH)
    return event_text(event, f"t+{offset // 60:02d}:{offset % 60:02d} {phase:>9}", update)


def start_worker(
    bootstrap: str, extra_env: dict[str, str] | None = None, command: tuple[str, ...] = ("worker",)
) -> subprocess.Popen[bytes]:
    """The worker (or another long-running ``command``, e.g. ``notify``) as a child process on
    ``bootstrap``: the embedded broker's profile unless the environment names another."""
    env = {
        **os.environ,
        "SERVEWATCH_BROKER": bootstrap,
        "SERVEWATCH_BROKER_PROFILE": os.environ.get("SERVEWATCH_BROKER_PROFILE", "tansu"),
        "SERVEWATCH_LOG_LEVEL": os.environ.get("SERVEWATCH_LOG_LEVEL", "WARNING"),
        **(extra_env or {}),
    }
    # Its own free metrics port unless one is given: a taken port stops a command.
    env.setdefault("SERVEWATCH_METRICS_PORT", str(free_loopback_port()))
    return subprocess.Popen(
        [sys.executable, "-m", "servewatch", *command], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )


def stop_worker(worker: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


async def play(
    bootstrap: str,
    workload: Workload,
    speed: float,
    on_phase: Callable[[str], None] | None = None,
    auth: KafkaAuth = PLAINTEXT,
) -> int:
    """Produce the workload, one JSON-array message per simulated second, paced at ``speed``x."""
    sent = 0
    prod = producer(bootstrap, auth=auth)
    await prod.start()
    try:
        started, current = time.monotonic(), None
        for sim_now, batch in workload.seconds():
            phase = workload.phase_at(sim_now - workload.start - 1).name
            if phase != current and on_phase is not None:
                on_phase(phase)
            current = phase
            delay = started + (sim_now - workload.start) / speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if batch:
                await prod.send(topics.REQUESTS, orjson.dumps(batch))
                sent += len(batch)
        await prod.flush()
    finally:
        await prod.stop()
    return sent


async def run_demo(
    bootstrap: str,
    *,
    speed: float = 25.0,
    scale: float = 1.0,
    out: Callable[[str], None] = print,
    auth: KafkaAuth = PLAINTEXT,
) -> DemoOutcome:
    """Play the scenario against a running worker on ``bootstrap``; print events as they come."""
    workload = Workload(demo_phases(scale))
    outcome = DemoOutcome()
    current_phase = {"name": "normal"}

    def phase_at_window(start: float) -> str:
        return workload.phase_at(start - workload.start).name

    marking: list[asyncio.Task[None]] = []

    def on_phase(name: str) -> None:
        current_phase["name"] = name
        out(f"--- simulated phase: {name} ---")
        if name == CHANGED_PHASE:  # the rollout that turned caching off, marked as a deploy pipeline would
            marking.extend(asyncio.ensure_future(write_marker(bootstrap, marker, auth))
                           for marker in change_markers(workload))  # fmt: skip

    seen: set[str] = set()

    async def watch() -> None:
        async for raw in read_topic(bootstrap, topics.ANOMALIES, auth=auth):
            record = parse_anomaly_record(raw)
            if isinstance(record, IncidentGroup):
                outcome.groups.append(record)
                if record.transition != "update":
                    out(group_text(record))
                continue
            event = record
            phase = phase_at_window(event.window_start)
            outcome.events.append(event)
            outcome.phase_of[event.id] = phase
            out(format_event(event, phase, update=event.fingerprint in seen))
            seen.add(event.fingerprint)

    async def follow_changes() -> None:
        async for raw in read_topic(bootstrap, topics.CHANGES, auth=auth):
            record = parse_change_record(raw)
            if isinstance(record, ChangeReport):
                outcome.reports.append(record)
                if record.final:
                    out(f">> change verified: {record.model}: {verdict_line(record)}")
            elif isinstance(record, ChangeMarker):
                out(f">> change marked on {record.model}: '{record.description}' ({record.id})")

    watchers = [asyncio.create_task(watch()), asyncio.create_task(follow_changes())]
    try:
        outcome.records = await play(bootstrap, workload, speed, on_phase, auth)
        await asyncio.gather(*marking)
        out(f"--- workload done: {outcome.records:,} request logs sent; waiting for the last windows ---")
        await asyncio.sleep(8.0)  # quiet-partition flush + stage 2's wait
    finally:
        for watcher in watchers:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    return outcome


#: The demo's change: the phase whose start is marked as a rollout, and what the marker says.
CHANGED_PHASE = "cache_off"
CHANGE_DESCRIPTION = "engine config rollout (enable_prefix_caching=false)"


def change_markers(workload: Workload) -> list[ChangeMarker]:
    """One marker per model at the changed phase's start (event time), with a fixed id per model."""
    start = workload.start
    for phase in workload.phases:
        if phase.name == CHANGED_PHASE:
            break
        start += phase.duration_s
    return [ChangeMarker(id=f"demo-rollout-{model}", at=start, model=model, description=CHANGE_DESCRIPTION,
                         labels={"deploy": "demo"}, by="servewatch demo") for model in workload.models]  # fmt: skip


def verdict_line(report: ChangeReport) -> str:
    """The report's verdicts that are not "no change", in one line."""
    moved = [f"{row.signal} {row.verdict}" for row in report.signals if row.verdict not in ("no change",)]
    return ", ".join(moved) or "no signal moved"


def final_reports(outcome: DemoOutcome) -> list[ChangeReport]:
    """The latest report of each change (final where one came)."""
    latest: dict[str, ChangeReport] = {}
    for report in outcome.reports:
        if report.change and (report.final or not latest.get(report.change, report).final):
            latest[report.change] = report
    return list(latest.values())


def summarise(outcome: DemoOutcome) -> list[str]:
    paging = [e for e in outcome.events if e.pages]
    groups = outcome.groups_that_paged()
    rollbacks = [e for e in paging if e.hints and e.hints[0].code == "rollback_condition_met"]
    pages = len(groups) + len(rollbacks)  # as a pager receives them: a rollback condition is a page of its own
    incidents = len({e.fingerprint for e in paging if e not in rollbacks})
    return [
        f"{pages} pages: {len(groups)} incident groups (one page each, from {incidents} incidents and "
        f"{len(outcome.events)} anomaly events) and {len(rollbacks)} rollback conditions:",
        *(f"  {group.title}" for group in groups.values()),
        f"surge explained by load, no page: {'yes' if outcome.surge_explained else 'NO'}",
        f"prefix caching off paged a ttft anomaly: {'yes' if outcome.cache_off_paged else 'NO'}",
        f"pages outside the cache-off phase: {sum(1 for e in paging if outcome.phase_of.get(e.id) != 'cache_off')}",
        f"paging events of the cache-off phase that name its change marker: "
        f"{sum(1 for e in paging if e.change is not None)} of "
        f"{sum(1 for e in paging if outcome.phase_of.get(e.id) == 'cache_off')}",
        f"rollback conditions met (critical, paged): {len(rollbacks)}"
        + "".join(f"\n  {e.segment.get('model')}: {e.hints[0].message}" for e in rollbacks),
        *(line for report in final_reports(outcome) for line in ["", *render(report).splitlines()]),
    ]
