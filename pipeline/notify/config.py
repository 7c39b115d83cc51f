"""The notifier's configuration: a YAML or TOML file, checked before anything runs.

Shape (YAML)::

    triage_url: "https://servewatch.example.com/groups/{group}"   # optional, linked from messages
    runbook_url: "https://wiki.example.com/runbooks/servewatch/{cause}"
    defaults: {group_wait: 30s, group_interval: 5m, repeat_interval: 4h}
    sinks:
      - name: oncall-slack
        type: slack                 # slack | slack_bot | pagerduty | alertmanager | webhook
        url: https://hooks.slack.com/services/...
        route: {min_severity: info}
      - name: pager
        type: pagerduty
        routing_key: R0UT1NGKEY...
        route: {min_severity: critical, explained_by_load: false}

Secrets (webhook URLs, tokens, routing keys, HMAC secrets) are ``SecretStr``: never logged
or printed. Any field of a sink can come from the environment instead of the file, as
``SERVEWATCH_NOTIFY__<SINK NAME>__<FIELD>`` (name upper-cased, other characters as ``_``),
e.g. ``SERVEWATCH_NOTIFY__PAGER__ROUTING_KEY``; the environment wins. Receivers' URLs, from
either, are checked as the config loads (``check_http_url``).
"""

from __future__ import annotations

import difflib
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from servewatch.models.explain.hints import HINT_CODES
from servewatch.pipeline.config_files import ConfigError, parse_mapping, read_config_text
from servewatch.pipeline.durations import Duration
from servewatch.schemas.anomaly import Severity, Signal
from servewatch.schemas.silence import Matcher

ENV_PREFIX = "SERVEWATCH_NOTIFY__"


class Route(BaseModel):
    """Which groups a sink is told about: every condition must hold (empty lists match anything)."""

    model_config = ConfigDict(extra="forbid")

    min_severity: Severity = Field(default=Severity.WARNING, description="info < warning < critical.")
    models: list[str] = Field(default_factory=list)
    signals: list[Signal] = Field(default_factory=list, description="Matches if any member has one of them.")
    causes: list[str] = Field(default_factory=list, description="Hint codes, e.g. prefix_cache_ineffective.")
    labels: dict[str, str] = Field(default_factory=dict, description="Segment labels some member must carry.")
    explained_by_load: bool | None = Field(
        default=None, description="true: only groups whose open members are all explained by load; false: none of them."
    )
    matchers: list[Matcher] = Field(
        default_factory=list,
        description='Alertmanager-style matchers on the labels: {name, op, value} or the string form model=~"llama.*".',
    )

    @field_validator("causes")
    @classmethod
    def _known_causes(cls, causes: list[str]) -> list[str]:
        """A cause no group can have would route nothing, silently: hint codes (docs/detection.md,
        "Hints") or ``signal:NAME`` (a group whose incidents carry no hint)."""
        known = set(HINT_CODES) | {f"signal:{signal.value}" for signal in Signal}
        for cause in causes:
            if cause not in known:
                near = difflib.get_close_matches(cause, sorted(known), n=1)
                raise ValueError(f"unknown cause {cause!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + "; causes are hint codes or signal:NAME")  # fmt: skip
        return causes


class Timing(BaseModel):
    """Alertmanager's three intervals (see ``plan``)."""

    model_config = ConfigDict(extra="forbid")

    group_wait: Duration = 30.0
    group_interval: Duration = 300.0
    repeat_interval: Duration = 4 * 3600.0


class Retry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    initial: Duration = Field(default=1.0, description="First wait after a failure; doubles, with jitter.")
    max_wait: Duration = Field(default=60.0, description="Longest wait between attempts (Retry-After may ask more).")
    timeout: Duration = Field(default=10.0, description="Per HTTP request.")
    give_up_after: Duration = Field(default=24 * 3600.0, description="Then the notification is dead-lettered.")


def check_http_url(url: str) -> str:
    """``url`` if a request can be built to it: http or https, a host that parses, a port in
    range. Checked when the config loads, so that ``check-config`` reports a bad URL and the
    notifier never starts with a sink that can only fail. Reasons quote at most the host or
    port, never the path (a Slack webhook's path is its secret) nor a user:password@."""
    if (reason := _unsplittable(url)) is not None:
        raise ValueError(f"not a valid URL: {reason}")
    try:  # what the sinks' requests are built with
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:  # not a ValueError: said as one, for pydantic
        raise ValueError(f"not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https"):
        raise ValueError("the URL must start with http:// or https://")
    if not parsed.host:
        raise ValueError("the URL has no host")
    if "%" in parsed.raw_host.decode("ascii", "replace") and ":" not in parsed.host:  # httpx escapes a space
        raise ValueError(f"the URL's host {parsed.host!r} holds characters no host name can")
    return url


def _unsplittable(url: str) -> str | None:
    """Why urllib cannot read ``url`` (an unclosed ``[`` of an IPv6 address, a port out of
    range), with any user:password@ it quotes cut out; None when it can."""
    try:
        urllib.parse.urlsplit(url).port  # noqa: B018 (reading the port checks it)
    except ValueError as exc:
        userinfo = url.partition("//")[2].partition("/")[0].rpartition("@")[0]
        return str(exc).replace(userinfo, "[redacted]") if userinfo else str(exc)
    return None


def _check_secret_url(url: SecretStr) -> SecretStr:
    check_http_url(url.get_secret_value())
    return url


#: A receiver's URL, checked as the config loads (``check_http_url``); a secret, as it may
#: carry a token (``?token=``, a path segment, user:password@).
SecretReceiverUrl = Annotated[SecretStr, AfterValidator(_check_secret_url)]


class _Sink(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    enabled: bool = True
    route: Route = Field(default_factory=Route)
    timing: Timing | None = Field(default=None, description="Overrides the file's defaults for this sink.")
    retry: Retry | None = None
    min_interval: Duration = Field(default=0.0, description="At least this long between two requests to the receiver.")


class SlackWebhook(_Sink):
    """Slack incoming webhook: one new message per notification (a webhook cannot edit)."""

    type: Literal["slack"]
    url: SecretReceiverUrl
    min_interval: Duration = 1.0  # Slack allows about one message a second per webhook


class SlackBot(_Sink):
    """Slack bot token: one message per group, edited on update and resolve."""

    type: Literal["slack_bot"]
    token: SecretStr
    channel: str
    api_url: SecretReceiverUrl = SecretStr("https://slack.com/api")  # a proxy's may carry a token
    min_interval: Duration = 1.0


class PagerDuty(_Sink):
    """PagerDuty Events API v2: trigger and resolve with the group's dedup key."""

    type: Literal["pagerduty"]
    routing_key: SecretStr
    url: SecretReceiverUrl = SecretStr("https://events.pagerduty.com/v2/enqueue")  # a relay's may carry a token


class Alertmanager(_Sink):
    """Alertmanager ``/api/v2/alerts``: one alert per member incident, re-sent while firing."""

    type: Literal["alertmanager"]
    url: SecretReceiverUrl = Field(description="Base URL, e.g. http://alertmanager:9093 (user:password@ allowed).")
    bearer_token: SecretStr | None = None
    # Alertmanager expires an alert not re-sent before its endsAt; Prometheus re-sends every
    # minute. A group that did not change is re-sent at repeat_interval, so 1 m by default here.
    timing: Timing | None = Field(default_factory=lambda: Timing(group_wait=0, group_interval=60, repeat_interval=60))


class Webhook(_Sink):
    """Any HTTP endpoint: the group and its members as JSON, optionally HMAC-SHA256 signed."""

    type: Literal["webhook"]
    url: SecretReceiverUrl  # a receiver's URL often carries its token (``?token=``, a path segment)
    secret: SecretStr | None = Field(default=None, description="Signs each request (X-Servewatch-Signature).")
    headers: dict[str, str] = Field(default_factory=dict)


SinkConfig = Annotated[SlackWebhook | SlackBot | PagerDuty | Alertmanager | Webhook, Field(discriminator="type")]


class NotifyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    triage_url: str | None = Field(default=None, description="Template with {group} and {model}: the triage page.")
    runbook_url: str | None = Field(default=None, description="Template with {cause} and {model}.")
    defaults: Timing = Field(default_factory=Timing)
    retry: Retry = Field(default_factory=Retry)
    sinks: list[SinkConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _names_unique(self) -> NotifyConfig:
        names = [sink.name for sink in self.sinks]
        if doubled := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"sink names must be unique: {', '.join(doubled)}")
        return self

    def timing_of(self, sink: _Sink) -> Timing:
        return sink.timing or self.defaults

    def retry_of(self, sink: _Sink) -> Retry:
        return sink.retry or self.retry

    @property
    def enabled_sinks(self) -> list[SinkConfig]:
        return [sink for sink in self.sinks if sink.enabled]


def _env_key(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", name.upper())


def _apply_env(raw: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    sinks = raw.get("sinks") or []
    by_key = {_env_key(str(s.get("name", ""))): s for s in sinks if isinstance(s, dict)}
    for var, value in environ.items():
        if not var.startswith(ENV_PREFIX):
            continue
        sink_key, _, field = var[len(ENV_PREFIX) :].partition("__")
        if sink_key not in by_key or not field:
            raise ConfigError(f"{var}: no sink named like {sink_key!r} in the file (or no __FIELD after it)")
        by_key[sink_key][field.lower()] = value
    return raw


def parse_config(text: str, suffix: str, environ: Mapping[str, str] | None = None) -> NotifyConfig:
    """Parse and validate a config's text (``suffix``: ``.yaml``/``.yml`` or ``.toml``)."""
    raw = parse_mapping(text, suffix)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("the file must hold a mapping (triage_url, defaults, retry, sinks)")
    raw = _apply_env(raw, os.environ if environ is None else environ)
    try:
        return NotifyConfig.model_validate(raw)
    except ValidationError as exc:
        lines = _yaml_lines(text) if suffix != ".toml" else None
        problems = []
        for error in exc.errors(include_url=False):
            where = ".".join(str(p) for p in error["loc"]) or "(top)"
            line = lines(error["loc"]) if lines is not None else None
            message = error["msg"].removeprefix("Value error, ")
            problems.append(f"{f'line {line}: ' if line else ''}{where}: {message}")
        raise ConfigError("\n".join(problems)) from None


def _yaml_lines(text: str) -> Callable[[tuple[int | str, ...]], int | None] | None:
    """The line of the YAML node at a validation error's location (the deepest that exists:
    a missing field points at its mapping), for check-config to say where to look."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return None

    def line_of(loc: tuple[int | str, ...]) -> int | None:
        node = root
        if node is None:
            return None
        for part in loc:
            if isinstance(node, yaml.MappingNode):
                found = [value for key, value in node.value if getattr(key, "value", None) == part]
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                found = [node.value[part]]
            else:
                found = []  # a union's tag (pydantic names the sink type it tried): stay
            if found:
                node = found[0]
        return int(node.start_mark.line) + 1

    return line_of


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> NotifyConfig:
    text, suffix = read_config_text(path)
    return parse_config(text, suffix, environ)
