"""Records for the triage page's tests: an incident group, its incident with evidence, a
segment's judged windows with a band and an anomalous stretch, and a change marker with a
report verifying it (tests/test_web*.py)."""

from __future__ import annotations

from typing import Any

from servewatch.schemas.anomaly import AnomalyEvent, Facets, Hint, Severity, Signal, Status
from servewatch.schemas.change_marker import ChangeMarker, ChangeRef
from servewatch.schemas.change_report import ChangeReport, Period, RollbackCheck, SignalChange
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
    after_change: ChangeRef | None = None,
) -> AnomalyEvent:
    hints = [Hint(code="prefix_cache_ineffective", message="prefix cache hit rate fell to 0%")]
    if after_change is not None:
        said = f"started {after_change.windows_after} windows after change {after_change.id} on {model}: "
        hints.insert(0, Hint(code="change_marker", message=said + repr(after_change.description)))
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
        hints=hints,
        evidence=rows if rows is not None else evidence(start),
        facets=Facets(changes=[change]),
        summary=summary,
        group=group,
        change=after_change,
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


def marker(model: str, at: float, *, change_id: str = "c1", description: str = "enable prefix caching") -> ChangeMarker:
    return ChangeMarker(id=change_id, at=at, model=model, description=description, by="ana",
                        labels={"deploy": "d-42", "ticket": "OPS-7"})  # fmt: skip


def report(model: str, at: float, *, change_id: str = "c1", final: bool = True, requests: int = 4800) -> ChangeReport:
    """Before 30 min, after 30 min: TTFT p95 +38 % (regressed), throughput up, cache hit rate down 40 points,
    errors unchanged, leak share without enough requests; one rollback condition holds, one does not."""
    rows = [
        SignalChange(signal="ttft_p95", kind="ratio", better="lower", before=0.8, after=1.104, change=1.38,
                     ci_low=1.25, ci_high=1.52, verdict="regressed", segments_used=6, coverage_before=0.97,
                     coverage_after=0.95),
        SignalChange(signal="tokens_per_s_p50", kind="ratio", better="higher", before=41.0, after=44.3, change=1.08,
                     ci_low=1.03, ci_high=1.12, verdict="improved", segments_used=6, coverage_before=0.97,
                     coverage_after=0.95),
        SignalChange(signal="cache_hit_rate", kind="points", better="higher", before=0.83, after=0.43, change=-40.0,
                     ci_low=-42.5, ci_high=-37.1, verdict="regressed", segments_used=6, coverage_before=0.97,
                     coverage_after=0.95),
        SignalChange(signal="error_share", kind="points", better="lower", before=0.002, after=0.0021, change=0.01,
                     ci_low=-0.08, ci_high=0.1, verdict="no change", segments_used=6, coverage_before=0.97,
                     coverage_after=0.95),
        SignalChange(signal="leak_share", kind="points", better="lower", before=None, after=None, change=None,
                     ci_low=None, ci_high=None, verdict="insufficient data", segments_used=0, coverage_before=0.0,
                     coverage_after=0.0),
    ]  # fmt: skip
    checks = [
        RollbackCheck(condition="ttft_p95 +20 % on any segment with at least 200 requests", holds=True,
                      where="chat / 4k-32k", change=1.41, ci_low=1.22, ci_high=1.63,
                      detail="ttft_p95 +41 % on chat / 4k-32k"),
        RollbackCheck(condition="error_share +0.5 pt on the model with at least 200 requests", holds=False,
                      where="model", change=0.01, ci_low=-0.08, ci_high=0.1, detail="within the limit"),
    ]  # fmt: skip
    return ChangeReport(
        model=model, before=Period(first=at - 1800, last=at - 1, requests=5000),
        after=Period(first=at + 1, last=at + 1800, requests=requests), segments=7, confidence=0.95, resamples=1000,
        min_requests=50, signals=rows, change=change_id, description="enable prefix caching", final=final,
        rollback=checks,
    )  # fmt: skip
