"""A sink's configuration to the sink that delivers for it.

The one place that knows every sink type, so that adding one means a config class, a
module and a line here; the delivery loop only ever sees the ``Sink`` protocol.
"""

from __future__ import annotations

from typing import assert_never

import httpx

from servewatch.pipeline.notify.config import (
    Alertmanager,
    NotifyConfig,
    PagerDuty,
    SinkConfig,
    SlackBot,
    SlackWebhook,
    Webhook,
)
from servewatch.pipeline.notify.sinks.alertmanager import AlertmanagerSink
from servewatch.pipeline.notify.sinks.base import Sink
from servewatch.pipeline.notify.sinks.pagerduty import PagerDutySink
from servewatch.pipeline.notify.sinks.slack import SlackBotSink, SlackWebhookSink
from servewatch.pipeline.notify.sinks.webhook import WebhookSink


def build_sink(config: SinkConfig, notify: NotifyConfig, client: httpx.AsyncClient) -> Sink:
    """The sink for ``config``, with the request timeout of its retry policy (its own or the
    file's) and, for Alertmanager, its timing (how long an alert lives between re-sends)."""
    timeout = notify.retry_of(config).timeout
    if isinstance(config, SlackWebhook):
        return SlackWebhookSink(config, client, timeout)
    if isinstance(config, SlackBot):
        return SlackBotSink(config, client, timeout)
    if isinstance(config, PagerDuty):
        return PagerDutySink(config, client, timeout)
    if isinstance(config, Alertmanager):
        return AlertmanagerSink(config, notify.timing_of(config), client, timeout)
    if isinstance(config, Webhook):
        return WebhookSink(config, client, timeout)
    assert_never(config)
