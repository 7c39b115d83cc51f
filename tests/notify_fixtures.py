"""A realistic notification for the notifier's tests: prefix caching lost on llama-70b.

``sample_notification()`` gives one incident group (cause ``prefix_cache_ineffective``) of
three member incidents, TTFT first, with the evidence rows the worker reads back;
``hostile=True`` plants chat markup, mentions and links in everything that comes from
requests or events, as a prompt could make a model answer.
"""

from __future__ import annotations

from typing import Any, Literal

from servewatch.pipeline.notify.notification import Notification
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.incident_group import GroupMember, IncidentGroup

MODEL = "llama-70b"
CAUSE = "prefix_cache_ineffective"
GROUP_KEY = "3f2a9c4be1d07a55"
START = 1767225600.0  # 2026-01-01T00:00:00Z
WINDOW = 60.0
#: What a hostile answer or label carries: each would act in Slack if not escaped.
HOSTILE = "<!channel> <@U123> <https://evil.example|click> *b* @here `x` ```rm -rf /```"


def _evidence(hostile: bool) -> list[dict[str, Any]]:
    excerpt = f"ok {HOSTILE}" if hostile else "Sure, here is the summary of the contract you pasted…"
    return [
        {
            "request_id": "req-uniform-01", "timestamp": START + 12.0, "instance": "gpu-node-1", "route": "chat",
            "prompt_tokens": 900, "cached_tokens": 850, "completion_tokens": 120, "ttft_s": 0.21, "e2e_s": 2.4,
            "finish_reason": "stop", "location": {"partition": 1, "offset": 5521}, "sample": "uniform",
        },
        {
            "request_id": "req-7f3a9c", "timestamp": START + 41.5, "instance": "gpu-node-3", "route": "chat",
            "prompt_tokens": 3812, "cached_tokens": 0, "completion_tokens": 256, "ttft_s": 4.21, "queue_s": 0.35,
            "prefill_s": 3.71, "e2e_s": 9.8, "finish_reason": "stop", "location": {"partition": 2, "offset": 18234},
            "sample": "slowest", "content_excerpt": excerpt,
        },
        {
            "request_id": "req-b81e02", "timestamp": START + 55.0, "instance": "gpu-node-2", "route": "chat",
            "prompt_tokens": 6120, "cached_tokens": 0, "completion_tokens": 512, "ttft_s": 3.94, "e2e_s": 14.1,
            "finish_reason": "length", "location": {"partition": 0, "offset": 7710}, "sample": "slowest",
        },
        {"location": {"partition": 3, "offset": 99}, "unavailable": True, "sample": "slowest"},
    ]  # fmt: skip


def _member(
    fp: str,
    signal: Signal,
    route: str,
    observed: float,
    expected: float,
    severity: Severity,
    resolved: bool,
    hostile: bool,
) -> AnomalyEvent:
    hint_message = "cached prompt tokens fell from 62% to 0% while prompts still share prefixes"
    summary = f"TTFT is {observed:.2f} s against {expected:.2f} s expected at this load; not explained by load."
    end = START + (5 if resolved else 1) * WINDOW
    return AnomalyEvent(
        id=f"{fp}-{'resolved' if resolved else 'firing'}",
        fingerprint=fp,
        status=Status.RESOLVED if resolved else Status.FIRING,
        transition="resolved" if resolved else "firing",
        signal=signal,
        segment={"model": MODEL, "route": route, "prompt_band": "1k-4k"},
        window_start=end - WINDOW,
        window_end=end,
        observed=observed,
        expected=expected,
        score=7.2,
        severity=severity,
        load={
            "requests_per_s": 12.4,
            "prompt_tokens_per_s": 45210.0,
            "output_tokens_per_s": 3120.0,
            "demand_vs_usual": 1.1,
        },
        explained_by_load=False,
        hints=[
            Hint(code=CAUSE, message=f"{hint_message} {HOSTILE}" if hostile else hint_message),
            Hint(code="long_prompts", message="prompts are longer than usual in this segment"),
        ],
        evidence=[] if resolved else _evidence(hostile),
        summary=f"{summary} {HOSTILE}" if hostile else summary,
        group=GROUP_KEY,
    )


def sample_notification(
    status: Literal["firing", "resolved"] | Status = "firing",
    sink: str = "s",
    seq: int = 1,
    hostile: bool = False,
    **overrides: Any,
) -> Notification:
    """A notification of the sample group; ``overrides`` replace ``Notification`` fields
    (``triage_url``, ``memo``, ``sent_at``, ``members``, ``group``...)."""
    resolved = Status(status) is Status.RESOLVED
    route = f"chat {HOSTILE}" if hostile else "chat"
    members = (
        _member("fp-ttft", Signal.TTFT, route, 4.21, 0.62, Severity.CRITICAL, resolved, hostile),
        _member("fp-prefill", Signal.PREFILL_TIME, "rag", 3.1, 0.7, Severity.WARNING, resolved, hostile),
        _member("fp-hits", Signal.CACHE_HIT_RATE, route, 0.01, 0.62, Severity.WARNING, resolved, hostile),
    )
    group = IncidentGroup(
        id=f"{GROUP_KEY}-{status}",
        group=GROUP_KEY,
        status=Status(status),
        transition="resolved" if resolved else "firing",
        cause=CAUSE,
        model=MODEL,
        severity=Severity.CRITICAL,
        window_start=START,
        window_end=max(m.window_end for m in members),
        members=[
            GroupMember(
                fingerprint=m.fingerprint, signal=m.signal, segment=m.segment, status=m.status, severity=m.severity
            )
            for m in members
        ],
        signals=[m.signal for m in members],
        segments=2,
        title=f"{CAUSE} on {MODEL}: 2 segments, ttft/prefill_time/cache_hit_rate",
        summary=members[0].summary,
    )
    fields: dict[str, Any] = {
        "sink": sink,
        "group": group,
        "members": members,
        "seq": seq,
        "sent_at": group.window_end + 30.0,
        "triage_url": f"https://servewatch.example.com/groups/{GROUP_KEY}",
        "runbook_url": f"https://wiki.example.com/runbooks/servewatch/{CAUSE}",
    }
    return Notification(**{**fields, **overrides})
