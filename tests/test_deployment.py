"""docker-compose.yml stays in step with the code: every topic servewatch uses is created
there with its partitions decided up front, and every ``servewatch`` command it runs parses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from servewatch.pipeline import topics
from servewatch.pipeline.cli.main import build_parser

COMPOSE = (Path(__file__).resolve().parents[1] / "docker-compose.yml").read_text()


def test_compose_creates_every_topic() -> None:
    created = set(re.findall(r"^\s+create (servewatch\.[a-z]+)", COMPOSE, re.M))
    assert created == set(topics.ALL)


def test_compose_commands_parse() -> None:
    commands = re.findall(r'&& servewatch ([a-z-]+.*)"\s*$', COMPOSE, re.M)
    assert {c.split()[0] for c in commands} == {"worker", "scrape", "ship"}
    for command in commands:
        # Compose's $$VAR is the shell's $VAR; any value will do for parsing.
        text = re.sub(r"\$\$\{?[A-Z_]+(:-[^}]*)?\}?", "x", command).replace('\\"', "")
        build_parser().parse_args(shlex.split(text))
