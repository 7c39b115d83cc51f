"""Getting a notification to its receiver: one queue per sink, retries, outcomes.

Each sink has its own queue and one task that sends in order, so a group's firing always
reaches a receiver before its resolve, and a receiver that is slow or down holds up its own
queue only, never another sink's. A failed attempt is retried with exponential backoff and
jitter (tenacity), never sooner than the receiver's ``Retry-After``; after the sink's
``give_up_after`` the notification is ``abandoned``. A receiver that refuses a payload for
good (4xx other than 429) gets it ``rejected`` at once, and so does one that cannot even be
turned into a request (a URL that does not parse, a bug). Either way the outcome is handed
to ``on_outcome`` (which books it and dead-letters failures) and counted per sink.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter, Gauge
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

from servewatch.pipeline.notify.config import Retry
from servewatch.pipeline.notify.plan import Planned
from servewatch.pipeline.notify.sinks.base import RejectedError, RetryableError, Sink
from servewatch.schemas.delivery import Outcome

logger = logging.getLogger(__name__)

NOTIFICATIONS = Counter(
    "servewatch_notifications",
    "Notifications per sink and outcome: sent, retried (one per failed attempt that is tried again), "
    "failed (rejected by the receiver or abandoned after give_up_after) and silenced.",
    ["sink", "outcome"],
)
REPORTS_DROPPED = Counter(
    "servewatch_notify_reports_dropped",
    "Delivery records never published: the oldest of a model's outcomes beyond what its state keeps "
    "unreported while the notifications topic refuses records.",
)
QUEUED = Gauge("servewatch_notify_queued", "Notifications waiting for their sink, in flight included.", ["sink"])
#: Enough of an unexpected failure's message to say what broke.
_DETAIL_CHARS = 500


@dataclass(frozen=True)
class Result:
    outcome: Outcome
    attempts: int
    memo: dict[str, str]
    detail: str = ""


OnOutcome = Callable[[Planned, Result], Awaitable[None]]


class SinkRunner:
    def __init__(
        self,
        sink: Sink,
        retry: Retry,
        min_interval: float,
        on_outcome: OnOutcome,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.sink = sink
        self.retry = retry
        self.min_interval = min_interval
        self.on_outcome = on_outcome
        self._clock = clock
        self._sleep = sleep
        self._queue: asyncio.Queue[Planned] = asyncio.Queue()
        self._last_request: float | None = None

    def submit(self, item: Planned) -> None:
        self._queue.put_nowait(item)
        QUEUED.labels(self.sink.name).inc()

    async def run(self) -> None:
        """Deliver queued notifications one at a time until cancelled."""
        while True:
            item = await self._queue.get()
            try:
                result = await self.deliver(item)
                NOTIFICATIONS.labels(self.sink.name, "sent" if result.outcome == "sent" else "failed").inc()
                await self.on_outcome(item, result)
            except Exception:  # a bug here must cost one notification, never the sink's queue
                logger.exception("sink %s: delivering %s failed", self.sink.name, item.note.idempotency_key)
            finally:
                QUEUED.labels(self.sink.name).dec()

    async def deliver(self, item: Planned) -> Result:
        attempts = 0
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(RetryableError),
            wait=self._wait,
            stop=stop_after_delay(self.retry.give_up_after),
            sleep=self._sleep,
            before_sleep=self._count_retry,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    await self._pace()
                    memo = await self.sink.send(item.note)
            return Result("sent", attempts, memo)
        except RejectedError as exc:
            logger.warning("sink %s rejected %s: %s", self.sink.name, item.note.idempotency_key, exc)
            return Result("rejected", attempts, {}, str(exc))
        except RetryableError as exc:
            logger.error("sink %s: gave up on %s after %d attempts: %s", self.sink.name,
                         item.note.idempotency_key, attempts, exc)  # fmt: skip
            return Result("abandoned", attempts, {}, str(exc))
        except Exception as exc:
            return self._unsendable(item, attempts, exc)

    def _unsendable(self, item: Planned, attempts: int, exc: Exception) -> Result:
        """A notification the sink could not even turn into a request (a bug, or a config the
        loader let through): rejected, so it is booked, reported and dead-lettered like any
        other failure instead of escaping as a traceback and staying in flight for good."""
        detail = f"could not send: {type(exc).__name__}: {exc}"[:_DETAIL_CHARS]
        logger.error("sink %s: %s dead-lettered: %s", self.sink.name, item.note.idempotency_key, detail)
        logger.debug("sink %s: the failure", self.sink.name, exc_info=exc)  # the traceback, with --verbose
        return Result("rejected", attempts, {}, detail)

    def _wait(self, state: RetryCallState) -> float:
        # initial·2^n plus up to one ``initial`` of jitter, so that notifiers that failed together
        # do not all come back at the same instant.
        backoff = wait_exponential_jitter(multiplier=self.retry.initial, max=self.retry.max_wait,
                                          jitter=self.retry.initial)(state)  # fmt: skip
        error = state.outcome.exception() if state.outcome is not None else None
        asked = error.retry_after if isinstance(error, RetryableError) else None
        return max(backoff, min(asked, self.retry.give_up_after)) if asked is not None else backoff

    def _count_retry(self, state: RetryCallState) -> None:
        NOTIFICATIONS.labels(self.sink.name, "retried").inc()
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.info("sink %s: attempt %d failed (%s); again in %.1f s", self.sink.name, state.attempt_number,
                    error, wait)  # fmt: skip

    async def _pace(self) -> None:
        """Keep ``min_interval`` between requests (Slack: about one message a second per webhook)."""
        if self._last_request is not None:
            gap = self._last_request + self.min_interval - self._clock()
            if gap > 0:
                await self._sleep(gap)
        self._last_request = self._clock()
