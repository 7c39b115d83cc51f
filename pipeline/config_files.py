"""Reading a configuration file's text (YAML or TOML) into a mapping, with one-line errors.

The notifier's and the change watcher's files are read the same way, and a syntax error must
read as one problem on one line with its position, as every other problem of a file does
(``check-config`` lists them one per line), not as the parser's multi-line report.

>>> try:
...     parse_mapping("sinks: [\\n  - {name: x\\n", ".yaml")
... except ConfigError as exc:
...     print(exc)
not valid YAML at line 2, column 3: expected the node content, but found '-'
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration file is unreadable or invalid; the message says where and why."""


CONFIG_SUFFIXES = (".yaml", ".yml", ".toml")


def read_config_text(path: str | Path) -> tuple[str, str]:
    """The file's text and the suffix ``parse_mapping`` takes (``.yml`` reads as ``.yaml``)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in CONFIG_SUFFIXES:
        raise ConfigError(f"{path}: use a .yaml, .yml or .toml file")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    return text, ".yaml" if suffix == ".yml" else suffix


def parse_mapping(text: str, suffix: str) -> Any:
    """The file's value (``suffix``: ``.toml``, else YAML); ``None`` for an empty YAML file."""
    try:
        return tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}") from exc  # tomllib says "(at line L, column C)"
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_problem(exc)) from exc


def _yaml_problem(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"not valid YAML{where}: {problem}"
