"""On-call's verdicts: carried on a group's later records; ``expected`` widens the
tolerance of the group's signals in its model. And the chart points the worker publishes."""

from __future__ import annotations

import orjson
import pytest

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.series import SeriesPoint

MODEL = "llama-3.1-70b"


def replay(workload: Workload, feedback: Feedback | None = None) -> tuple[list[AnomalyEvent], list[SeriesPoint]]:
    run = Replay()
    run.stage_two.bank.series = []  # kept as the worker keeps it
    if feedback is not None:
        # Given before the workload's first window (event time 0), and held for its whole length.
        run.stage_two.bank.tolerances.hold_s = 1e12
        run.stage_two.bank.tolerances.apply(feedback, now=0.0)
    events = []
    for offset, (_, batch) in enumerate(workload.seconds()):
        if batch:
            events += run.feed(orjson.dumps(batch), offset)
    return events + run.finish(), run.stage_two.bank.series


def slower_decode() -> Workload:
    return Workload((Phase("normal", 900), Phase("slower", 600, decode_slowdown=1.5)), seed=5)


@pytest.mark.long
def test_expected_widens_the_groups_signals_in_its_model_and_nothing_else() -> None:
    def pages(events: list[AnomalyEvent], model: str) -> list[AnomalyEvent]:
        return [e for e in events if e.pages and e.transition == "firing" and e.segment["model"] == model]

    before, _ = replay(slower_decode())
    paged = pages(before, MODEL)
    assert {e.signal for e in paged} >= {Signal.ITL}, "the slowdown pages without a verdict"
    assert all(e.score < 6.0 for e in paged), "a mild fault: within the widened tolerance"
    verdict = Feedback(group="g", model=MODEL, verdict="expected", signals=["itl", "throughput", "e2e"], by="ann",
                       at=0.0)  # fmt: skip
    after, _ = replay(slower_decode(), verdict)
    assert pages(after, MODEL) == []
    other = sorted((e.signal.value, e.segment["route"]) for e in pages(before, "qwen3-32b"))
    assert sorted((e.signal.value, e.segment["route"]) for e in pages(after, "qwen3-32b")) == other
    for verdict_name in ("not_expected", "acknowledged"):  # for people only: detection unchanged
        same, _ = replay(slower_decode(), verdict.model_copy(update={"verdict": verdict_name}))
        assert len(pages(same, MODEL)) == len(paged)


def test_series_points_carry_the_expected_band_and_normal_windows_fall_inside_it() -> None:
    _, points = replay(Workload((Phase("normal", 900),), seed=6))
    assert points and all(isinstance(p, SeriesPoint) for p in points)
    latency = [s for p in points for name, s in p.signals.items() if name in ("ttft", "itl", "e2e") and s.low]
    assert latency and all(s.low is not None and s.high is not None and s.low < s.expected < s.high for s in latency)
    inside = sum(1 for s in latency if s.low is not None and s.high is not None and s.low <= s.observed <= s.high)
    assert inside / len(latency) > 0.99
    assert {"requests_per_s", "prompt_tokens_per_s", "output_tokens_per_s"} <= set(points[-1].load)
    SeriesPoint.model_validate_json(points[-1].model_dump_json())  # what goes on the topic reads back


def test_a_verdict_is_carried_on_the_groups_later_records() -> None:
    def event(transition: str, end: float) -> AnomalyEvent:
        status = Status.RESOLVED if transition == "resolved" else Status.FIRING
        return AnomalyEvent(
            id=f"a:{transition}:{end}", fingerprint="a", status=status, transition=transition,  # type: ignore[arg-type]
            signal=Signal.TTFT, segment={"model": "m", "route": "chat"}, window_start=end - 10, window_end=end,
            observed=2.0, expected=1.0, score=6.0, severity=Severity.WARNING, load={}, explained_by_load=False,
            hints=[Hint(code="prefix_cache_ineffective", message="")], summary="",
        )  # fmt: skip

    grouper = IncidentGrouper()
    _, told = grouper.add(event("firing", 10.0))
    assert told[0].feedback is None
    grouper.note_feedback(Feedback(group=told[0].group, model="m", verdict="not_expected", by="bo", at=5.0))
    member, told = grouper.add(event("resolved", 60.0))
    assert member.feedback is not None and member.feedback.verdict == "not_expected"
    assert told[0].feedback is not None and told[0].feedback.by == "bo"
