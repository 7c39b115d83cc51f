"""A command line safe beside production (no quiet throwaway brokers, one-line
configuration errors, a broker that stops on SIGTERM)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from servewatch.pipeline.cli.main import main
from servewatch.pipeline.settings import Settings

SERVEWATCH = [sys.executable, "-m", "servewatch"]


@pytest.mark.parametrize("command", [["worker"], ["ship", "--in", "-"], ["scrape", "--target", "http://127.0.0.1:9/m"]])
def test_no_broker_is_refused_not_replaced_by_a_throwaway_one(
    command: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.delenv("SERVEWATCH_BROKER", raising=False)
    state = tmp_path / "state.json"
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert main(command) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Kafka broker" in err[0] and "--broker" in err[0] and "SERVEWATCH_BROKER" in err[0]
    assert not state.exists() and not list(tmp_path.rglob("*.json"))  # no position saved past unsent lines


def test_a_bad_setting_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SERVEWATCH_THRESHOLD", "abc")
    assert main(["schema"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("servewatch: SERVEWATCH_THRESHOLD=abc:")


def test_lists_read_as_json_or_comma_separated_and_a_typo_is_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("SERVEWATCH_PROMPT_BAND_EDGES", "4096, 32768")
    monkeypatch.setenv("SERVEWATCH_OUTPUT_BAND_EDGES", "[2048]")
    monkeypatch.setenv("SERVEWATCH_TRESHOLD", "5")
    from servewatch.pipeline.cli.common import load_settings

    settings = load_settings()
    assert settings.segments.prompt_band_edges == (4096, 32768) and settings.segments.output_band_edges == (2048,)
    assert "SERVEWATCH_TRESHOLD" in caplog.text and "did you mean SERVEWATCH_THRESHOLD" in caplog.text
    assert Settings().detection.threshold == 4.0  # the typo changed nothing


def test_version_schema_list_and_a_refused_demo_speed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and re.match(r"servewatch \S+", capsys.readouterr().out)
    assert main(["schema"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("RequestLog", "AnomalyEvent", "IncidentGroup", "EngineInterval"))
    assert main(["schema", "EngineInterval"]) == 0 and '"instance"' in capsys.readouterr().out
    assert main(["demo", "--speed", "0"]) == 2
    assert "--speed must be above 0" in capsys.readouterr().err


def test_sigterm_stops_the_broker_and_frees_its_port() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("SERVEWATCH_BROKER", None)
    proc = subprocess.Popen([*SERVEWATCH, "broker"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not line.startswith("broker ready"):
            line = proc.stdout.readline()
        match = re.search(r"broker ready: ([\d.]+):(\d+)", line)
        assert match, line
        host, port = match.group(1), int(match.group(2))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (0, 130)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) != 0:
                return  # nothing listens: the Tansu child is gone
        time.sleep(0.2)
    pytest.fail(f"something still listens on {host}:{port} after SIGTERM")


def test_scrape_gives_up_with_exit_1_when_every_target_stays_down(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["scrape", "--target", "http://127.0.0.1:9/metrics", "--out", "-", "--interval", "100ms"]
    assert main([*args, "--give-up-after", "500ms"]) == 1
    err = capsys.readouterr().err
    assert "every target down for" in err and "--give-up-after" in err


def test_progress_lines_only_on_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--out", str(tmp_path / "logs.jsonl"), "--scale", "0.2"]) == 0
    capsys.readouterr()
    assert main(["replay", "--in", str(tmp_path / "logs.jsonl"), "--out", str(tmp_path / "out.jsonl")]) == 0
    err = capsys.readouterr().err  # captured: not a terminal
    assert "\r" not in err and err.startswith("replayed ") and len(err.strip().splitlines()) == 1


def test_replay_prints_the_demos_readable_lines_with_format_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--out", str(tmp_path / "logs.jsonl")]) == 0
    capsys.readouterr()
    assert main(["replay", "--in", str(tmp_path / "logs.jsonl"), "--format", "text"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^\[2026-01-01 \d\d:\d\d:\d\dZ\] FIRING +warning +ttft ", text, re.M)
    assert "  >> group FIRING" in text and "prefix_cache_ineffective on " in text
    assert not text.lstrip().startswith("{")  # not JSON


def test_the_detectors_numbers_live_in_one_place() -> None:
    """The settings' defaults are ``DetectorConfig``'s, not a second copy."""
    from servewatch.models.detect.signal_detector import DetectorConfig

    assert Settings().detector_config() == DetectorConfig()


def test_one_flag_vocabulary_documented_in_one_table() -> None:
    """Every flag of README's "Flags" table is on exactly the commands its row names, and no
    command spells one of those concepts another way (``--file``, ``--output``...)."""
    import argparse

    from servewatch.pipeline.cli.main import build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("| flag | means | commands |")[1].split("\n\n")[0]
    documented = {}
    for row in table.splitlines():
        if not row.startswith("| `--"):
            continue
        flag, _, commands = (cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|")))
        if flag.startswith("`--"):
            documented[flag.strip("`").split()[0]] = set(re.findall(r"`([a-z-]+)", commands))
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    has: dict[str, set[str]] = {flag: set() for flag in documented}
    synonyms = {"--file", "--input", "--output", "--stdin", "--requests", "--output-format", "--kafka", "--bootstrap"}
    for command, parser in subparsers.choices.items():
        # A command with verbs (``silence add|list|expire``) owns its verbs' flags.
        nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        actions = [*parser._actions, *(x for n in nested for verb in n.choices.values() for x in verb._actions)]
        flags = {s for action in actions for s in action.option_strings if s.startswith("--")}
        assert not flags & synonyms, f"{command}: {flags & synonyms} (use the table's flags)"
        for flag in flags & set(documented):
            has[flag].add(command)
    assert has == documented
