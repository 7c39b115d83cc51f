"""A notify config that is accepted must be able to match: routes name causes that exist,
and take matchers in Alertmanager's own string form."""

from __future__ import annotations

from typing import Any

import pytest

from servewatch.pipeline.cli.common import CommandError
from servewatch.pipeline.cli.notify import load_notify_config
from servewatch.pipeline.notify.config import ConfigError, parse_config
from servewatch.schemas.silence import Matcher

SINK = """
sinks:
  - name: capacity-bot
    type: webhook
    url: https://hooks.example.com/capacity
    route: {{min_severity: info, {route}}}
"""


def test_a_cause_no_group_can_have_is_refused_with_the_nearest_one() -> None:
    with pytest.raises(ConfigError, match=r"unknown cause 'kv_cache_headroom' \(did you mean 'capacity_headroom'\?\)"):
        parse_config(SINK.format(route='causes: ["kv_cache_headroom"]'), ".yaml", environ={})


def test_hint_codes_and_signal_causes_are_accepted() -> None:
    config = parse_config(SINK.format(route='causes: ["capacity_headroom", "signal:ttft"]'), ".yaml", environ={})
    assert config.sinks[0].route.causes == ["capacity_headroom", "signal:ttft"]


def test_matchers_in_alertmanagers_string_form() -> None:
    route = 'matchers: [model=~"llama.*", "severity!=info"]'
    config = parse_config(SINK.format(route=route), ".yaml", environ={})
    assert config.sinks[0].route.matchers == [
        Matcher(name="model", op="=~", value="llama.*"),
        Matcher(name="severity", op="!=", value="info"),
    ]


def test_a_matcher_that_does_not_parse_says_how_to_write_one() -> None:
    with pytest.raises(ConfigError, match="write NAME=VALUE"):
        parse_config(SINK.format(route='matchers: ["model ~ llama"]'), ".yaml", environ={})


def test_check_config_lists_every_problem_on_its_own_line_with_the_line_to_look_at(tmp_path: Any) -> None:
    path = tmp_path / "notify.yaml"
    path.write_text(
        SINK.format(route="min_severity: loud, causes: [kv_cache_headroom]").replace("{min_severity: info, ", "{")
    )
    with pytest.raises(CommandError) as raised:
        load_notify_config(str(path), "check-config")
    head, *problems = raised.value.line().splitlines()
    assert head.endswith("notify.yaml: 2 problems") and len(problems) == 2
    assert all(problem.startswith("  line 6: sinks.0.webhook.route.") for problem in problems), problems
