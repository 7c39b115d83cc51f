"""``servewatch replay --scrapes``: a recorded day of /metrics through the engine detectors."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from servewatch.pipeline.replay.scrapes import ScrapeReplay
from servewatch.schemas.anomaly import AnomalyEvent, Signal
from servewatch.schemas.incident_group import parse_anomaly_record
from tests.engine_sim import SimulatedVllm

T0 = 1_767_225_600.0


def record(path: Path, normal: int = 60, off: int = 12, instance: str = "10.0.0.7:8000") -> Path:
    """What ``servewatch scrape --record`` writes: a scrape every 10 s; prefix caching
    switched off after ``normal`` of them, at the same traffic."""
    engine = SimulatedVllm()
    with path.open("wb") as out:
        for i in range(normal + off):
            engine.caching = i < normal
            engine.step()
            out.write(orjson.dumps({"timestamp": T0 + 10 * i, "instance": instance, "body": engine.text()}) + b"\n")
    return path


def test_a_recorded_cache_off_incident_replays_into_its_pages(tmp_path: Path) -> None:
    replay = ScrapeReplay()
    lines = record(tmp_path / "scrapes.jsonl").read_bytes().splitlines()
    events = list(replay.run(lines))
    pages = [e for e in events if e.pages]
    assert {e.signal for e in pages} >= {Signal.CACHE_HIT_RATE, Signal.TTFT, Signal.PREFILL_TIME}
    assert all(e.window_start >= T0 + 590 for e in pages), "quiet while caching was on"
    hit = next(e for e in pages if e.signal is Signal.CACHE_HIT_RATE)
    assert hit.segment["instance"] == "10.0.0.7:8000" and hit.hints[0].code == "prefix_cache_disabled"
    assert replay.stats.scrapes == 72 and replay.stats.intervals == 71 and replay.stats.rejected == 0
    # Deterministic: the same record gives the same events.
    assert [e.model_dump() for e in ScrapeReplay().run(lines)] == [e.model_dump() for e in events]


def test_bad_lines_are_rejected_with_their_line_and_reason_and_the_replay_goes_on(tmp_path: Path) -> None:
    good = record(tmp_path / "scrapes.jsonl", normal=3, off=0).read_bytes().splitlines()
    not_metrics = orjson.dumps({"timestamp": T0 + 25, "instance": "10.0.0.7:8000", "body": "<html>oops</html>"})
    lines = [good[0], b"{not json", b'{"timestamp": 1, "instance": "x"}', b"", good[1], not_metrics, good[2]]
    replay = ScrapeReplay()
    list(replay.run(lines))
    assert replay.stats.scrapes == 3 and replay.stats.intervals == 2
    assert [(d.reason, d.source_offset) for d in replay.stats.rejected_samples] == [
        ("invalid_record", 2), ("invalid_record", 3), ("invalid_exposition", 6)
    ]  # fmt: skip


def incidents_in(path: Path) -> list[AnomalyEvent]:
    """The incidents' events of a replay's output (its groups' records left out)."""
    records = [parse_anomaly_record(line) for line in path.read_bytes().splitlines()]
    return [r for r in records if isinstance(r, AnomalyEvent)]


def test_replay_command_takes_scrapes_and_request_logs_and_names_the_engine_with_caching_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from servewatch.pipeline.cli.main import main
    from servewatch.pipeline.dev.simulator import Phase, Workload

    scrapes = record(tmp_path / "scrapes.jsonl")
    out = tmp_path / "events.jsonl"
    assert main(["replay", "--scrapes", str(scrapes), "--out", str(out)]) == 0
    engine_events = incidents_in(out)
    assert any(e.signal is Signal.CACHE_HIT_RATE and e.pages for e in engine_events)
    assert "replayed 72 scrapes into 71 engine intervals" in capsys.readouterr().err

    workload = Workload((Phase("normal", 600), Phase("cache_off", 120, prefix_caching=False)), seed=3,
                        models=("llama-3.1-70b",))  # fmt: skip
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in workload.records()))
    assert main(["replay", "--scrapes", str(scrapes), "--in", str(requests), "--out", str(out)]) == 0
    events = incidents_in(out)
    ttft = next(e for e in events if e.signal is Signal.TTFT and e.pages and "instance" not in e.segment)
    assert "enable_prefix_caching=False on 10.0.0.7:8000" in ttft.hints[0].message
    assert main(["replay"]) == 2  # nothing to replay: a clear error
