"""The command line: schema export, generate -> replay round trip, bad lines survive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servewatch.pipeline.cli.main import main
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.incident_group import IncidentGroup, parse_anomaly_record


@pytest.mark.parametrize("name", ["RequestLog", "AnomalyEvent", "DeadLetter"])
def test_schema_export(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema", name]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == name and "properties" in schema


def test_unknown_schema_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["schema", "Nope"])
    assert exit_.value.code == 2 and "RequestLog" in capsys.readouterr().err


def test_the_schema_help_names_every_schema(capsys: pytest.CaptureFixture[str]) -> None:
    from servewatch.schemas import EXPORTED

    with pytest.raises(SystemExit):
        main(["schema", "-h"])
    shown = " ".join(capsys.readouterr().out.split())
    assert all(name in shown for name in EXPORTED)


def test_generate_then_replay_finds_the_incident(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs, out = tmp_path / "requests.jsonl", tmp_path / "anomalies.jsonl"
    assert main(["generate", "--out", str(logs)]) == 0
    with logs.open("ab") as f:  # bad lines in the middle of real logs must cost only themselves
        f.write(b"this is not json\n")
        f.write(b'{"request_id": "x", "timestamp": 1767225600, "model": "m"}\n')
    assert main(["replay", "--in", str(logs), "--out", str(out)]) == 0
    records = [parse_anomaly_record(line) for line in out.read_text().splitlines()]
    events = [r for r in records if isinstance(r, AnomalyEvent)]
    assert any(e.pages and e.signal.value == "ttft" for e in events)
    groups = [r for r in records if isinstance(r, IncidentGroup)]  # the cache-off incidents, grouped
    assert groups and all(e.group for e in events if e.pages)
    err = capsys.readouterr().err
    assert "2 rejected" in err and "invalid_json" in err


def test_process_tuning_pins_the_allocator_and_the_collector() -> None:
    import gc

    from servewatch.pipeline.tuning import tune_malloc, tune_process

    thresholds = gc.get_threshold()
    try:
        tune_process()
        assert gc.get_threshold()[0] == 50_000
        assert tune_malloc() in (True, False)  # True on glibc; never raises elsewhere
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def test_the_allocator_pin_and_heap_trims_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    from servewatch.pipeline.settings import Settings
    from servewatch.pipeline.tuning import HEAP_TRIM_INTERVAL_S, MMAP_THRESHOLD_BYTES, trim_heap, tune_malloc

    assert Settings().process.mmap_threshold_bytes == MMAP_THRESHOLD_BYTES == 0  # glibc's dynamic threshold
    assert tune_malloc(0) is False  # nothing pinned
    monkeypatch.setenv("SERVEWATCH_MMAP_THRESHOLD_BYTES", "131072")
    assert Settings().process.mmap_threshold_bytes == 131072
    assert Settings().process.heap_trim_interval_s == HEAP_TRIM_INTERVAL_S
    monkeypatch.setenv("SERVEWATCH_HEAP_TRIM_INTERVAL_S", "0")
    assert Settings().process.heap_trim_interval_s == 0
    trimmed = trim_heap()  # harmless at any time; False where the C library is not glibc
    assert trimmed is (platform.libc_ver()[0] == "glibc")


def test_the_demo_shows_what_changed_and_a_request_to_look_up() -> None:
    from servewatch.pipeline.dev.demo import format_event
    from servewatch.schemas.anomaly import Signal
    from tests.test_scenarios import result

    r = result("cache_off")
    page = next(e for e in r.pages if e.signal is Signal.TTFT)
    lines = format_event(page, "cache_off").splitlines()
    assert lines[1].strip() == page.summary and lines[2].strip().startswith("hints: prefix_cache_ineffective")
    assert lines[3].strip().startswith("changed: cached share of prompt tokens")
    assert lines[4].strip().startswith("e.g. req-") and "cached_tokens=" in lines[4]
