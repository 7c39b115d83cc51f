"""Records for the triage page's tests: an incident group, its incident with evidence, and a
segment's judged windows with a band and an anomalous stretch (tests/test_web*.py)."""

from __future__ import annotations

from typing import Any

from servewatch.schemas.anomaly import AnomalyEvent, Facets, Hint, Severity, Signal, Status
from servewatch.schemas.incident_group import GroupMember, IncidentGroup
from servewatch.schemas.series import SeriesPoint, SignalPoint

SCRIPT = "<script>window.__xss=2;alert(1)</script>"
IMG = '<img src=x onerror="window.__xss=1;alert(1)">'
WINDOW_S = 10.0


def segment(model: str, route: str = "chat") -> dict[str, str]:
    return {"model": model, "route": route, "prompt_band": "4k-32k", "output_band": "<1k"}


def key_of(labels: dict[str, str]) -> str:
    return "|".join(f"{k}={v}" for k, v in labels.items())


def evidence(
    start: float, request_id: str = "req-slow-1", excerpt: str = "the answer starts here"
) -> list[dict[str, Any]]:
    slow = {"request_id": request_id, "timestamp": start + 5, "prompt_tokens": 9000, "cached_tokens": 0,
            "completion_tokens": 120, "ttft_s": 2.4, "queue_s": 0.1, "e2e_s": 4.2, "finish_reason": "stop",
            "instance": "gpu-1", "content_excerpt": excerpt, "sample": "slowest"}  # fmt: skip
    base = {"request_id": "req-base-1", "timestamp": start - 600, "prompt_tokens": 8800, "cached_tokens": 7400,
            "completion_tokens": 110, "ttft_s": 0.5, "e2e_s": 2.1, "finish_reason": "stop", "instance": "gpu-1",
            "content_excerpt": "a normal answer", "sample": "baseline"}  # fmt: skip
    return [slow, base]


def incident(
    model: str,
    group: str,
    start: float,
    *,
    status: str = "firing",
    labels: dict[str, str] | None = None,
    rows: list[dict[str, Any]] | None = None,
    summary: str = "TTFT is 2.2 s against 0.55 s expected at this load; not explained by load.",
    event_id: str | None = None,
    change: str = "cached share of prompt tokens 0% against 83%",
) -> AnomalyEvent:
    return AnomalyEvent(
        id=event_id or f"{group}-ev-{status}",
        fingerprint=f"{group}-fp",
        status=Status(status),
        transition="firing" if status == "firing" else "resolved",
        signal=Signal.TTFT,
        segment=labels or segment(model),
        window_start=start,
        window_end=start + WINDOW_S,
        observed=2.2,
        expected=0.55,
        score=9.1,
        severity=Severity.CRITICAL,
        load={"requests_per_s": 4.3, "prompt_tokens_per_s": 38000.0, "output_tokens_per_s": 520.0},
        explained_by_load=False,
        hints=[Hint(code="prefix_cache_ineffective", message="prefix cache hit rate fell to 0%")],
        evidence=rows if rows is not None else evidence(start),
        facets=Facets(changes=[change]),
        summary=summary,
        group=group,
    )


def incident_group(
    event: AnomalyEvent, *, title: str | None = None, status: str = "firing", summary: str | None = None
) -> IncidentGroup:
    model = event.segment["model"]
    member = GroupMember(fingerprint=event.fingerprint, signal=event.signal, segment=event.segment,
                         status=Status(status), severity=event.severity)  # fmt: skip
    return IncidentGroup(
        id=f"{event.group}-{status}",
        group=event.group or "g",
        status=Status(status),
        transition="firing" if status == "firing" else "resolved",
        cause="prefix_cache_ineffective",
        model=model,
        severity=event.severity,
        window_start=event.window_start,
        window_end=event.window_end + (0 if status == "firing" else 300),
        members=[member],
        signals=[event.signal],
        segments=1,
        title=title or f"prefix_cache_ineffective on {model}: 1 segment, ttft",
        summary=summary or event.summary,
    )


def series(labels: dict[str, str], start: float, count: int, anomalous_from: int) -> list[SeriesPoint]:
    """``count`` windows of TTFT around 0.55 s with a band, 2.2 s from ``anomalous_from`` on."""
    points = []
    for i in range(count):
        t = start + i * WINDOW_S
        bad = i >= anomalous_from
        ttft = SignalPoint(observed=2.2 if bad else 0.55 + 0.03 * (i % 5), expected=0.55, low=0.3, high=0.9,
                           score=9.0 if bad else 0.4, anomalous=bad, firing=bad)  # fmt: skip
        hits = SignalPoint(observed=0.0 if bad else 0.83, expected=0.83, low=0.6, high=None, score=0.1,
                           anomalous=bad, firing=bad)  # fmt: skip
        points.append(SeriesPoint(
            key=key_of(labels), segment=labels, window_start=t, window_end=t + WINDOW_S,
            load={"requests_per_s": 4.0 + 0.1 * (i % 3), "prompt_tokens_per_s": 36000.0, "output_tokens_per_s": 500.0},
            signals={"ttft": ttft, "cache_hit_rate": hits},
        ))  # fmt: skip
    return points
