"""Whether the broker answers, for the waits that take silence for idleness.

Both stages wait on silence: a requests partition silent for ``idle_flush_s`` is taken as
idle (its event time then follows the clock) and stage 2 stops waiting for partials from a
source silent for ``assembler_max_wait_s``. A broker that does not answer silences every
partition at once, and the records it holds back would be late when it comes back. So the
worker asks the broker when its input goes quiet; while it gets no answer, every such wait
starts over, and once more when the broker is heard from again, so that the waits are
counted from its return.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)


class BrokerWatch:
    """Tells the worker's waits (``restart_waits``) to start over while the broker is silent.

    ``ask`` is a probe (``BrokerProbe.answers``); ``heard`` is for any other sign of life
    (a message read), which ends a silence without a probe.

    >>> import asyncio
    >>> restarts = []
    >>> answer = False
    >>> async def ask() -> bool:
    ...     return answer
    >>> watch = BrokerWatch(ask, lambda: restarts.append("restart"))
    >>> asyncio.run(watch.answers()), asyncio.run(watch.answers()), watch.silent
    (False, False, True)
    >>> watch.heard(); watch.silent, len(restarts)
    (False, 3)
    >>> watch.heard(); len(restarts)  # heard while answering: nothing to restart
    3
    """

    def __init__(self, ask: Callable[[], Awaitable[bool]], restart_waits: Callable[[], None]) -> None:
        self.ask = ask
        self.restart_waits = restart_waits
        self.silent = False

    async def answers(self) -> bool:
        """Ask the broker; while it does not answer, the waits start over at every asking."""
        if await self.ask():
            self.heard()
            return True
        self.restart_waits()
        if not self.silent:
            self.silent = True
            logger.warning("the broker does not answer: quiet partitions are held, not taken as idle")
        return False

    def heard(self) -> None:
        """The broker answered (a probe, a message): a silence ends, its waits start over once more."""
        if self.silent:
            self.silent = False
            self.restart_waits()
            logger.warning("the broker answers again: quiet partitions are idle again")
