"""The notifier without Kafka: anomaly records in, planned notifications out to sink runners.

``Notifier`` keeps one ``ModelState`` per model it owns, folds anomaly-topic records into
it, and on every ``tick`` asks the plan what is due, hands sends to each sink's runner,
and books outcomes. Where state is stored, what this process owns, and where deliveries
and dead letters go are injected (``agent`` passes the Faust table and topics; tests pass
dicts and lists), so all of it runs and is tested without a broker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import orjson

from servewatch.pipeline.notify.config import NotifyConfig
from servewatch.pipeline.notify.delivery import NOTIFICATIONS, REPORTS_DROPPED, Result, SinkRunner
from servewatch.pipeline.notify.plan import Planned, due, settle
from servewatch.pipeline.notify.silences import SilenceBook
from servewatch.pipeline.notify.sinks.base import Sink
from servewatch.pipeline.notify.state import ModelState
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.delivery import Delivery
from servewatch.schemas.incident_group import IncidentGroup

logger = logging.getLogger(__name__)


@dataclass
class Storage:
    """Where model states live (the changelog-backed table, in the agent)."""

    load: Callable[[str], bytes | None]
    save: Callable[[str, bytes], None]
    keys: Callable[[], Iterable[str]]
    #: Waits until what ``save`` wrote is on the broker (the table's changelog). Every write
    #: is flushed before the next one: a delivery is durable before it is reported, and each
    #: changelog batch holds one record, which Tansu's end offsets need (see ``_store``).
    flush: Callable[[], Awaitable[None]] | None = None


class Notifier:
    def __init__(
        self,
        config: NotifyConfig,
        sinks: list[Sink],
        storage: Storage,
        *,
        publish_delivery: Callable[[Delivery], Awaitable[None]],
        dead_letter: Callable[[DeadLetter], Awaitable[None]],
        silences: SilenceBook | None = None,
        owns: Callable[[str], bool] = lambda model: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.storage = storage
        self.silences = silences or SilenceBook()
        self.owns = owns
        self.clock = clock
        self._publish_delivery = publish_delivery
        self._dead_letter = dead_letter
        self._states: dict[str, ModelState] = {}
        self._saved: dict[str, bytes] = {}
        self._in_flight: set[tuple[str, str]] = set()
        self._writing = asyncio.Lock()
        self._reporting = asyncio.Lock()
        by_name = {sink.name: sink for sink in sinks}
        self.runners = {
            cfg.name: SinkRunner(by_name[cfg.name], config.retry_of(cfg), cfg.min_interval, self._booked)
            for cfg in config.enabled_sinks
        }

    def state(self, model: str) -> ModelState:
        if (known := self._states.get(model)) is not None:
            return known
        stored = self.storage.load(model)
        state = ModelState.model_validate_json(stored) if stored else ModelState(model=model)
        self._states[model] = state
        self._saved[model] = stored or b""
        return state

    def forget(self) -> None:
        """Drop cached states (after a rebalance): the table is read again for what is owned now."""
        self._states.clear()
        self._saved.clear()

    async def receive(self, record: AnomalyEvent | IncidentGroup) -> None:
        model = record.model if isinstance(record, IncidentGroup) else record.segment.get("model", "other")
        state = self.state(model)
        if state.apply(record):
            await self._store(state)

    async def tick(self) -> int:
        """Plan what is due now; returns how many notifications were handed to sinks."""
        now = self.clock()
        handed = 0
        models = set(self._states) | set(self.storage.keys())
        for model in sorted(m for m in models if self.owns(m)):
            state = self.state(model)
            for item in due(state, self.config, self.silences, now, frozenset(self._in_flight)):
                if item.kind == "silenced":
                    NOTIFICATIONS.labels(item.sink.name, "silenced").inc()
                    silence = item.silence.id if item.silence else None
                    logger.info("sink %s: %s silenced by %s", item.sink.name, item.note.idempotency_key, silence)
                    self._report_later(state, self._delivery(item, "silenced", now, silence=silence))
                else:
                    self._in_flight.add((item.sink.name, item.note.key))
                    self.runners[item.sink.name].submit(item)
                    handed += 1
            await self._store(state)
            if state.unreported:  # this tick's silences, and what a crash left unreported
                await self._report(model)
        return handed

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    async def _store(self, state: ModelState) -> None:
        """Write a changed state and wait until it is on the broker, one write at a time.

        One at a time because the embedded broker (Tansu) under-reports a partition's end
        offset when its newest batch holds several records, and a restarted notifier that
        trusts it would miss the latest state and resend what that state says was sent.
        """
        raw = state.model_dump_json().encode()
        if raw == self._saved.get(state.model):
            return
        async with self._writing:
            self.storage.save(state.model, raw)
            self._saved[state.model] = raw
            if self.storage.flush is not None:
                try:
                    await self.storage.flush()
                except BaseException:
                    self._saved.pop(state.model, None)  # not on the broker: the next _store writes it again
                    raise

    async def _booked(self, item: Planned, result: Result) -> None:
        """A runner's outcome: booked in the state together with its report (stored at once),
        then reported, and dead-lettered when it failed."""
        now = self.clock()
        self._in_flight.discard((item.sink.name, item.note.key))
        state = self.state(item.model)
        settle(state, item, result.outcome, now, result.memo)
        self._report_later(state, self._delivery(item, result.outcome, now, result.attempts, result.detail))
        await self._store(state)
        await self._report(item.model)

    @staticmethod
    def _report_later(state: ModelState, delivery: Delivery) -> None:
        dropped = state.report_later(delivery)
        if dropped:
            REPORTS_DROPPED.inc(dropped)
            logger.error("notifier: %d outcome(s) of %s dropped unreported: %d more wait for the notifications "
                         "topic, which refuses records (servewatch_notify_reports_dropped_total)",
                         dropped, state.model, len(state.unreported))  # fmt: skip

    async def _report(self, model: str) -> None:
        """Publish the model's unreported outcomes (each on the broker before the next), then
        drop them from its stored state. A crash in between publishes them again after the
        restart: a report, like Kafka, is at least once; a notification stays exactly once."""
        async with self._reporting:
            pending = list(self.state(model).unreported)
            if not pending:
                return
            try:
                for delivery in pending:
                    await self._publish_delivery(delivery)
                    if delivery.outcome in ("rejected", "abandoned"):
                        await self._dead_letter(_letter(delivery))
            except Exception as exc:  # kept in the state: the next tick publishes them again
                logger.warning("notifier: %d outcomes for %s not reported yet (%r)", len(pending), model, exc)
                return
            state = self.state(model)
            state.unreported = [d for d in state.unreported if d not in pending]
            await self._store(state)

    def _delivery(
        self, item: Planned, outcome: str, now: float, attempts: int = 0, detail: str = "", silence: str | None = None
    ) -> Delivery:
        return Delivery(
            sink=item.sink.name, sink_type=item.sink.type, group=item.note.key, model=item.model,
            status=item.note.status, seq=item.note.seq, idempotency_key=item.note.idempotency_key,
            outcome=outcome, at=now, attempts=attempts, silence=silence, detail=detail,  # type: ignore[arg-type]
        )  # fmt: skip


def _letter(delivery: Delivery) -> DeadLetter:
    """The dead letter of a notification its sink refused or never took."""
    return DeadLetter(
        reason=f"notify_{delivery.outcome}", error=f"sink {delivery.sink}: {delivery.detail}",
        raw=orjson.dumps({"sink": delivery.sink, "group": delivery.group, "status": delivery.status,
                          "seq": delivery.seq}).decode(),
        received_at=delivery.at,
    )  # fmt: skip
