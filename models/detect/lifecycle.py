"""Incident lifecycle: from a stream of per-window verdicts to a few state changes.

Paging on every anomalous window would flood people; paging on none until the window
closes for good would be late. Like Alertmanager's ``for:`` and Prometheus' hysteresis:
an incident *fires* after ``fire_after`` anomalous windows among the last ``fire_within``,
sends an *update* every ``update_every`` windows while it lasts (or at once when its
severity steps up), and *resolves* after ``resolve_after`` normal windows in a row.
Flapping is damped: an incident that fires again within ``reopen_within`` windows of
resolving is the same incident (same start, so the same fingerprint), and each such
reopening doubles the normal windows it needs to resolve (up to 8x).
Pure logic: no clock but the windows it is given.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Transition(StrEnum):
    FIRING = "firing"
    UPDATE = "update"
    RESOLVED = "resolved"


def fingerprint(segment_key: str, signal: str, incident_start: float) -> str:
    """Stable identity of one incident of one signal in one segment."""
    raw = f"{segment_key}\x1f{signal}\x1f{incident_start:.3f}".encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


#: Severities in order (``Severity`` values): a step up is announced at once, a step down at
#: the next update.
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


@functools.cache
def _all_normal(n: int) -> tuple[None, ...]:
    return (None,) * n


@dataclass(slots=True)
class IncidentTracker:
    """Hysteresis over window verdicts.

    >>> t = IncidentTracker(fire_after=2, fire_within=3, resolve_after=2)
    >>> [t.step(bad, window_start=w, severity="warning") for w, bad in enumerate([1, 0, 1, 1, 0, 0])]
    [None, None, <Transition.FIRING: 'firing'>, None, None, <Transition.RESOLVED: 'resolved'>]
    """

    fire_after: int = 2
    fire_within: int = 3
    resolve_after: int = 3
    update_every: int = 6
    reopen_within: int = 30
    # The last fire_within windows: an anomalous one as its start, a normal one as None
    # (a normal window's start is never needed; this is kept per segment and signal).
    recent: tuple[float | None, ...] = ()
    firing: bool = False
    incident_start: float | None = None
    severity: str | None = None
    normal_streak: int = 0
    windows_since_event: int = 0
    flaps: int = 0  # reopenings of the current incident
    since_resolved: int | None = None  # windows since the last resolve (None: none, or long ago)

    def __post_init__(self) -> None:
        if not 1 <= self.fire_after <= self.fire_within:
            raise ValueError("need 1 <= fire_after <= fire_within")
        if self.resolve_after < 1:
            raise ValueError("resolve_after must be at least 1")
        self.recent = tuple(self.recent)[-self.fire_within :]

    def step(
        self, anomalous: bool, *, window_start: float, severity: str | None = None, sustained: bool = False
    ) -> Transition | None:
        """Feed one window's verdict; return the state change it causes, if any. A
        ``sustained`` window (its evidence spans windows already: a sequential test) acts at
        once: anomalous, it fires without waiting for ``fire_after`` of them; normal inside
        an incident, it resolves without waiting for ``resolve_after``."""
        recent = (*self.recent, window_start if anomalous else None)[-self.fire_within :]
        # Mostly all normal: share one tuple of Nones rather than keep a new one per segment.
        self.recent = _all_normal(len(recent)) if not anomalous and recent.count(None) == len(recent) else recent
        self.windows_since_event += 1
        if not self.firing:
            if self.since_resolved is not None:
                self.since_resolved += 1
                if self.since_resolved > self.reopen_within:
                    self.since_resolved, self.flaps = None, 0
            if anomalous and (sustained or sum(start is not None for start in self.recent) >= self.fire_after):
                self.firing, self.normal_streak, self.windows_since_event = True, 0, 0
                if self.since_resolved is not None and self.incident_start is not None:
                    self.flaps += 1  # back soon after resolving: the same incident, reopened
                else:
                    # The incident started at the first anomalous window still in view.
                    self.incident_start = next(start for start in self.recent if start is not None)
                self.since_resolved = None
                self.severity = severity
                return Transition.FIRING
            return None
        if anomalous:
            self.normal_streak = 0
            # Only a step up is news at once (warning to critical); a severity that moves back
            # and forth around a bound would otherwise send an event every window. The regular
            # update carries the severity as it is then.
            escalated = SEVERITY_RANK.get(severity or "", -1) > SEVERITY_RANK.get(self.severity or "", -1)
            if escalated or self.windows_since_event >= self.update_every:
                self.severity = severity or self.severity
                self.windows_since_event = 0
                return Transition.UPDATE
            return None
        self.normal_streak += 1
        if sustained or self.normal_streak >= self.resolve_after * 2 ** min(self.flaps, 3):
            self.firing, self.recent = False, ()
            self.windows_since_event, self.since_resolved = 0, 0
            return Transition.RESOLVED
        return None

    def end_by_adoption(self) -> None:
        """The incident's level was adopted as the new normal: it ends now, and is no
        incident that a flare soon after could reopen."""
        self.firing, self.recent, self.since_resolved = False, (), None

    def reopens(self, *, paging: bool) -> bool | None:
        """Whether an anomalous window now would reopen the incident that resolved recently
        (None: none did). Only the same kind reopens: a paging window does not reopen an
        incident that load explained (severity ``info``), nor the reverse."""
        if self.firing or self.since_resolved is None:
            return None
        return (self.severity != "info") == paging

    @property
    def idle(self) -> bool:
        """Nothing to remember: not firing, no anomalous window in view, no reopening possible."""
        return not self.firing and self.since_resolved is None and all(start is None for start in self.recent)

    def state(self) -> dict[str, Any]:
        return {
            "recent": list(self.recent),
            "firing": self.firing,
            "incident_start": self.incident_start,
            "severity": self.severity,
            "normal_streak": self.normal_streak,
            "windows_since_event": self.windows_since_event,
            "flaps": self.flaps,
            "since_resolved": self.since_resolved,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.recent = tuple(None if s is None else float(s) for s in state["recent"])[-self.fire_within :]
        self.firing = bool(state["firing"])
        self.incident_start = state["incident_start"]
        self.severity = state["severity"]
        self.normal_streak = int(state["normal_streak"])
        self.windows_since_event = int(state["windows_since_event"])
        self.flaps = int(state.get("flaps", 0))
        since = state.get("since_resolved")
        self.since_resolved = None if since is None else int(since)
