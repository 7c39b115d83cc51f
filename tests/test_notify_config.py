"""The notifier's config file: validation with clear errors, env overrides, secrets kept secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from servewatch.pipeline.cli.main import main
from servewatch.pipeline.notify.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_shipped_example_is_valid_and_check_config_summarises_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(ROOT / "deploy/notify.example.yaml")]) == 0
    out = capsys.readouterr().out
    assert "4 sink(s), 3 enabled" in out and "pager (pagerduty): critical and up; explained_by_load=false" in out
    assert "hooks.slack.com" not in out and "change-me" not in out  # secrets never printed


def test_errors_name_the_field_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: {group_wait: soon}\nsinks:\n  - {name: p, type: pagerduty}\n  - {name: p, type: smoke}\n")
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "defaults.group_wait" in err and "sinks.0.pagerduty.routing_key" in err and "sinks.1" in err


def test_environment_overrides_a_sinks_field_and_secrets_stay_masked() -> None:
    text = "sinks:\n  - {name: on-call.slack, type: slack, url: 'http://file', route: {min_severity: info}}\n"
    config = parse_config(text, ".yaml", environ={"SERVEWATCH_NOTIFY__ON_CALL_SLACK__URL": "https://hooks/secret"})
    sink = config.sinks[0]
    assert sink.url.get_secret_value() == "https://hooks/secret"  # type: ignore[union-attr]
    assert "secret" not in repr(config) and "secret" not in str(config.model_dump())
    with pytest.raises(ConfigError, match="no sink named like 'PAGER'"):
        parse_config(text, ".yaml", environ={"SERVEWATCH_NOTIFY__PAGER__ROUTING_KEY": "x"})


def test_toml_durations_and_matchers(tmp_path: Path) -> None:
    path = tmp_path / "notify.toml"
    path.write_text(
        '[defaults]\ngroup_wait = "1m30s"\n\n[[sinks]]\nname = "hook"\ntype = "webhook"\nurl = "http://x"\n'
        '[sinks.route]\nmatchers = [{name = "route", op = "=~", value = "chat|rag"}]\n'
    )
    config = load_config(path, environ={})
    assert config.defaults.group_wait == 90.0
    assert str(config.sinks[0].route.matchers[0]) == 'route=~"chat|rag"'
    path.write_text('[[sinks]]\nname = "hook"\ntype = "webhook"\nurl = "http://x"\n'
                    '[sinks.route]\nmatchers = [{name = "route", op = "=~", value = "("}]\n')  # fmt: skip
    with pytest.raises(ConfigError, match="not a regular expression"):
        load_config(path, environ={})
