"""Daily and weekly traffic cycles as phase lists for the trace-driven fleet simulation.

A serving fleet's demand follows the clock: busy afternoons, quiet nights, quieter weekends.
A detector that learns "usual" demand must ride that swing without paging, and a bench that
counts false pages per day must include it, or it counts pages on an hour that never ends.
``pipeline/dev/serving_sim.py`` plays a real arrival trace at a phase's ``traffic``
multiplier, so a cycle is a list of short phases whose multiplier follows a smooth curve;
the bursts stay the trace's own (the multiplier only speeds up or slows down its clock).

The curve is normalised to its peak: traffic 1.0 at the busiest hour of a weekday, which is
the load the models' engines are sized for (``ModelSpec.utilisation``), and ``1 - depth``
at the quietest hour, twelve hours later. Weekends take ``weekend_dip`` off the whole day.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from servewatch.pipeline.dev.serving_sim import SimPhase

DAY_S = 86_400.0
WEEK_S = 7 * DAY_S
#: ``EPOCH`` (2026-01-01 00:00 UTC, where simulations start) is a Thursday (Monday is 0).
EPOCH_WEEKDAY = 3


def diurnal_multiplier(
    t_s: float | np.ndarray, *, depth: float = 0.6, peak_hour: float = 15.0, weekend_dip: float = 0.0,
    start_weekday: int = EPOCH_WEEKDAY,
) -> np.ndarray:  # fmt: skip
    """Traffic at ``t_s`` seconds after midnight of the first day: 1.0 at ``peak_hour`` on a
    weekday, ``1 - depth`` twelve hours away, a cosine between; on Saturdays and Sundays
    (counted from ``start_weekday``) all of it ``1 - weekend_dip`` times as much.

    >>> [round(float(x), 2) for x in diurnal_multiplier(np.array([15, 21, 3]) * 3600.0)]
    [1.0, 0.7, 0.4]
    """
    t = np.asarray(t_s, dtype=np.float64)
    hour = (t / 3600.0) % 24.0
    daily = 1.0 - depth * (1.0 - np.cos(2.0 * math.pi * (hour - peak_hour) / 24.0)) / 2.0
    weekday = (start_weekday + np.floor(t / DAY_S).astype(np.int64)) % 7
    return daily * np.where(weekday >= 5, 1.0 - weekend_dip, 1.0)


def cycle_phases(
    duration_s: float, *, step_s: float = 600.0, start_s: float = 0.0, base: SimPhase | None = None,
    depth: float = 0.6, peak_hour: float = 15.0, weekend_dip: float = 0.0, start_weekday: int = EPOCH_WEEKDAY,
) -> tuple[SimPhase, ...]:  # fmt: skip
    """``duration_s`` of traffic following ``diurnal_multiplier`` from ``start_s`` seconds after
    midnight, as phases of ``step_s`` (each at the curve's value at its middle; 10 minutes move
    traffic by at most 8 % of the peak at the default depth, far less than a trace's own
    bursts). Each phase is ``base`` (normal conditions by default) with its ``traffic`` scaled.

    >>> phases = cycle_phases(86_400.0, step_s=3600.0)
    >>> len(phases), round(max(p.traffic for p in phases), 2), round(min(p.traffic for p in phases), 2)
    (24, 1.0, 0.4)
    """
    base = base or SimPhase("normal", 0.0)
    edges = np.arange(0.0, duration_s, step_s)
    lengths = np.minimum(edges + step_s, duration_s) - edges
    traffic = diurnal_multiplier(
        start_s + edges + lengths / 2, depth=depth, peak_hour=peak_hour, weekend_dip=weekend_dip,
        start_weekday=start_weekday,
    )  # fmt: skip
    return tuple(
        replace(base, name=f"{base.name}@{_clock(start_s + edge)}", duration_s=float(length),
                traffic=base.traffic * float(level))
        for edge, length, level in zip(edges, lengths, traffic, strict=True)
    )  # fmt: skip


def splice(phases: tuple[SimPhase, ...], injected: SimPhase, at_s: float) -> tuple[SimPhase, ...]:
    """``phases`` with ``injected`` in force from ``at_s`` for its duration, the phases it
    overlaps cut around it; its ``traffic`` multiplies the cycle's level where it starts (a
    2.5x surge at 14:00 is 2.5 times 14:00's traffic). Returns the phases and keeps the total
    length.

    >>> cycle = cycle_phases(3 * 3600.0, step_s=3600.0, start_s=12 * 3600.0)
    >>> spliced = splice(cycle, SimPhase("surge", 1800.0, traffic=2.5), 4500.0)
    >>> [(p.name, p.duration_s) for p in spliced][1:]
    [('normal@d0 13:00', 900.0), ('surge', 1800.0), ('normal@d0 13:00', 900.0), ('normal@d0 14:00', 3600.0)]
    >>> round(spliced[2].traffic / spliced[1].traffic, 2), sum(p.duration_s for p in spliced)
    (2.5, 10800.0)
    """
    end = at_s + injected.duration_s
    before, after, level, t = [], [], 1.0, 0.0
    for phase in phases:
        first, last = t, t + phase.duration_s
        t = last
        if first < at_s:
            before.append(replace(phase, duration_s=min(last, at_s) - first))
        if first <= at_s < last:
            level = phase.traffic
        if last > end:
            after.append(replace(phase, duration_s=last - max(first, end)))
    return (*before, replace(injected, traffic=injected.traffic * level), *after)


def _clock(t_s: float) -> str:
    """'d2 15:40': day (from 0) and time of day, for phase names a person can read."""
    day, rest = divmod(int(t_s), int(DAY_S))
    return f"d{day} {rest // 3600:02d}:{rest % 3600 // 60:02d}"


__all__ = ["DAY_S", "WEEK_S", "cycle_phases", "diurnal_multiplier", "splice"]
