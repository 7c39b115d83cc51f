"""What every ``servewatch`` command shares: settings from its arguments, a broker to talk to."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from pipeline.broker import EmbeddedBroker
from pipeline.settings import Settings


def settings_from(args: argparse.Namespace, **overrides: object) -> Settings:
    """Settings from the environment (read once), with the command's --broker and ``overrides`` on top."""
    values = {k: v for k, v in overrides.items() if v is not None}
    if getattr(args, "broker", None):
        values["broker"] = args.broker
    return Settings(**values)  # type: ignore[arg-type]


@contextlib.contextmanager
def with_broker(settings: Settings) -> Iterator[Settings]:
    """``settings`` with a broker: the configured one, or an embedded one for the duration."""
    if settings.bootstrap is not None:
        yield settings
        return
    with EmbeddedBroker() as broker:
        print(f"embedded Kafka-compatible broker (Tansu) at {broker.bootstrap}", file=sys.stderr)
        yield settings.model_copy(update={"broker": broker.bootstrap, "broker_profile": "tansu"})
