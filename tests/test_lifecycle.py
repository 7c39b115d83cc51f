"""Incident hysteresis: fire after N of M, update while firing, resolve after K normal windows."""

from __future__ import annotations

import pytest

from servewatch.models.detect.lifecycle import IncidentTracker, Transition, fingerprint


def run(tracker: IncidentTracker, verdicts: str, severity: str = "warning") -> str:
    """One letter per window: f(iring), u(pdate), r(esolved) or '.'."""
    out = []
    for i, v in enumerate(verdicts):
        t = tracker.step(v == "x", window_start=float(i * 10), severity=severity)
        out.append(t.value[0] if t else ".")
    return "".join(out)


def test_single_anomalous_window_does_not_fire() -> None:
    assert run(IncidentTracker(), "..x....x...") == "..........."


def test_fires_after_two_of_three_and_resolves_after_three_normal() -> None:
    t = IncidentTracker(fire_after=2, fire_within=3, resolve_after=3)
    assert run(t, "x.x...") == "..f..r"
    assert t.incident_start is not None


def test_flapping_is_suppressed_while_firing() -> None:
    t = IncidentTracker(resolve_after=3, update_every=100)
    assert run(t, "xx.x.x.x....") == ".f........r."


def test_periodic_updates_and_severity_change() -> None:
    t = IncidentTracker(update_every=3)
    assert run(t, "xxxxxxx") == ".f..u.."
    assert t.step(True, window_start=100.0, severity="critical") is Transition.UPDATE


def test_incident_start_is_first_anomalous_window_in_view() -> None:
    t = IncidentTracker(fire_after=2, fire_within=3)
    t.step(True, window_start=10.0)
    t.step(False, window_start=20.0)
    assert t.step(True, window_start=30.0) is Transition.FIRING
    assert t.incident_start == 10.0


def test_state_round_trip() -> None:
    t = IncidentTracker()
    run(t, "x.x")
    clone = IncidentTracker()
    clone.load_state(t.state())
    assert clone.state() == t.state()


def test_fingerprint_is_stable_and_distinct() -> None:
    a = fingerprint("model=m", "ttft", 100.0)
    assert a == fingerprint("model=m", "ttft", 100.0)
    assert len({a, fingerprint("model=m", "ttft", 110.0), fingerprint("model=n", "ttft", 100.0)}) == 3


@pytest.mark.parametrize("bad", [dict(fire_after=0), dict(fire_after=4, fire_within=3), dict(resolve_after=0)])
def test_rejects_nonsense_config(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        IncidentTracker(**bad)


def test_a_severity_that_moves_back_and_forth_sends_one_step_up_not_an_event_a_window() -> None:
    """An incident whose score crosses the critical bound and back does not send an event at
    each crossing. Only a step up is news at once; the regular update carries the rest."""
    tracker = IncidentTracker(fire_after=2, fire_within=3, resolve_after=3, update_every=6)
    severities = ["warning", "warning"] + ["critical", "warning"] * 9  # 20 anomalous windows
    steps = [tracker.step(True, window_start=float(i), severity=s) for i, s in enumerate(severities)]
    events = [(i, t) for i, t in enumerate(steps) if t is not None]
    assert events[0] == (1, Transition.FIRING)
    assert events[1] == (2, Transition.UPDATE)  # warning -> critical: at once
    assert len(events) == 2 + (len(severities) - 3) // 6  # then one every 6 windows
