"""Evidence by reference: windows keep where their slowest requests are; firing events get the records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from servewatch.models.explain.evidence_sample import EvidenceBudget
from servewatch.pipeline.dev.simulator import Workload, demo_phases
from servewatch.pipeline.messages.decode import decode_message
from servewatch.pipeline.replay.request_logs import JsonlChunks, Replay
from servewatch.pipeline.worker.evidence import fill, wanted
from servewatch.schemas.anomaly import AnomalyEvent, Severity, Signal, Status
from servewatch.schemas.evidence_pointer import FaultScan, KeptRequest, RequestAt, WindowSample

T0 = 1_767_225_600.0


def rec(i: int, **changes: Any) -> dict[str, Any]:
    base = {"request_id": f"r{i}", "timestamp": T0 + i, "model": "m", "prompt_tokens": 100,
            "completion_tokens": 10, "e2e_s": 2.0, "ttft_s": 0.1 * i, "finish_reason": "stop",
            "content": "the answer text never travels as evidence"}  # fmt: skip
    return {**base, **changes}


def pointing_at(*locations: tuple[int, int, int]) -> AnomalyEvent:
    return AnomalyEvent(
        id="e", fingerprint="f", status=Status.FIRING, signal=Signal.TTFT, segment={"model": "m"},
        window_start=T0, window_end=T0 + 10, observed=1.0, expected=0.5, score=5.0, severity=Severity.WARNING,
        load={}, explained_by_load=False, summary="s",
        pointers=tuple(KeptRequest(ttft_s=1.0, location=RequestAt(partition=p, offset=o, index=i))
                       for p, o, i in locations),
    )  # fmt: skip


def test_pointers_are_filled_with_the_records_fields_and_keep_their_location() -> None:
    message = orjson.dumps([rec(0), rec(1), rec(2)])
    event = pointing_at((3, 41, 2), (3, 41, 0))
    assert wanted([event]) == {(3, 41)}
    [event] = fill([event], {(3, 41): message})
    assert [r["request_id"] for r in event.evidence] == ["r2", "r0"]
    assert event.evidence[0]["location"] == {"partition": 3, "offset": 41, "index": 2}
    assert all("content" not in r for r in event.evidence)
    assert wanted([event]) == set()  # filled: nothing more to read


def test_positions_count_rejected_records_too() -> None:
    """A bad record in the middle does not shift where the ones after it are."""
    message = orjson.dumps([rec(0), {**rec(1), "prompt_tokens": -1}, rec(2)])
    batch = decode_message(message).rows()
    assert batch.positions.tolist() == [0, 2]
    event = pointing_at((0, 0, 2))
    [event] = fill([event], {(0, 0): message})
    assert event.evidence[0]["request_id"] == "r2"


def test_a_message_that_cannot_be_read_leaves_a_pointer_marked_unavailable() -> None:
    event = pointing_at((0, 7, 1))
    [event] = fill([event], {})
    assert event.evidence == [
        {"ttft_s": 1.0, "location": {"partition": 0, "offset": 7, "index": 1}, "unavailable": True,
         "sample": "slowest"}
    ]  # fmt: skip


def test_jsonl_chunks_reread_what_they_yielded(tmp_path: Path) -> None:
    path = tmp_path / "logs.jsonl"
    path.write_bytes(b"".join(orjson.dumps(rec(i)) + b"\n" for i in range(25)))
    chunks = JsonlChunks(str(path), lines=10)
    yielded = list(chunks)
    assert len(yielded) == 3
    assert [chunks.reread(n) for n in range(3)] == yielded
    assert chunks.reread(3) is None


def test_replay_from_a_file_and_from_memory_give_the_same_events(tmp_path: Path) -> None:
    workload = Workload(demo_phases())
    lines = [orjson.dumps(r) + b"\n" for r in workload.records()]
    path = tmp_path / "logs.jsonl"
    path.write_bytes(b"".join(lines))
    chunks = JsonlChunks(str(path), lines=1000)
    from_file = [e.model_dump() for e in Replay(reread=chunks.reread).run(chunks)]
    in_memory = Replay()
    messages = [b"".join(lines[i : i + 1000]) for i in range(0, len(lines), 1000)]
    kept_at_most = 0
    events = []
    for offset, raw in enumerate(messages):
        events.extend(in_memory.feed(raw, offset))
        kept_at_most = max(kept_at_most, len(in_memory._kept))
    events.extend(in_memory.finish())
    # Without a file to re-read, only the messages open windows and the last few judged
    # ones may point at are kept: an event whose baseline window is older has no baseline sample.
    assert kept_at_most < len(messages) / 4

    def but_old_baselines(event: dict[str, Any]) -> dict[str, Any]:
        facets = event["facets"] and {**event["facets"], "baseline": None, "changes": []}
        return {**event, "evidence": [r for r in event["evidence"] if r["sample"] != "baseline"], "facets": facets}

    assert [but_old_baselines(e) for e in from_file] == [but_old_baselines(e.model_dump()) for e in events]
    assert from_file[: len(from_file) // 2] != [but_old_baselines(e) for e in from_file[: len(from_file) // 2]]
    firing = [e for e in events if e.status is Status.FIRING]
    assert firing and all(r.get("request_id") and "unavailable" not in r for e in firing for r in e.evidence)
    assert {r["sample"] for e in firing for r in e.evidence} == {"slowest", "uniform", "baseline"}


def test_a_sample_reads_a_bounded_number_of_messages_spread_over_every_source_in_turn() -> None:
    from servewatch.models.explain.evidence_sample import SAMPLE_MESSAGES, spread

    picked = spread([(0, 10, 1000), (3, 7, 8)])
    assert len(picked) == SAMPLE_MESSAGES and picked[:4] == [(0, 10), (3, 7), (0, 86), (3, 8)]
    assert picked[-1] == (0, 1000)  # the window's last message too: its whole span is sampled
    assert spread([(1, 5, 5)]) == [(1, 5)]
    assert spread([(1, 5, 9)], budget=100) == [(1, o) for o in range(5, 10)]


def test_a_scan_keeps_the_segments_faulty_requests_and_is_dropped_without_a_segmenter() -> None:
    from servewatch.pipeline.settings import Settings

    base = {"timestamp": T0 + 1, "model": "m", "route": "chat", "prompt_tokens": 100, "completion_tokens": 10,
            "e2e_s": 1.0}  # fmt: skip
    rows = [
        {**base, "request_id": "ok", "finish_reason": "stop"},
        {**base, "request_id": "cut", "finish_reason": "length"},
        {**base, "request_id": "other", "finish_reason": "length", "route": "rag"},  # another segment
    ]
    segmenter = Settings().segmenter()
    key = segmenter.key_of_row(rows[1])
    sample = WindowSample(sample="anomalous", segment=key, window_start=T0, window_end=T0 + 10, sources=((2, 40, 40),))
    pointer = FaultScan(signal=Signal.LENGTH_TRUNCATION)
    event = pointing_at().model_copy(update={"pointers": (pointer, sample)})
    only_faulty = EvidenceBudget(uniform=0, baseline=0)
    [event] = fill([event], {(2, 40): orjson.dumps(rows)}, only_faulty, segment_of=segmenter.key_of_row)
    assert [(r["request_id"], r["location"], r["sample"]) for r in event.evidence] == [
        ("cut", {"partition": 2, "offset": 40, "index": 1}, "faulty")
    ]
    bare = pointing_at().model_copy(update={"pointers": (pointer, sample)})
    [bare] = fill([bare], {(2, 40): orjson.dumps(rows)}, only_faulty)
    assert bare.evidence == []
