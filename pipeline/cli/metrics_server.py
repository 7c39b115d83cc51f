"""Each long-running command serves its own Prometheus series, and only those.

Every metric is created once, at import, in ``prometheus_client``'s default registry; a
command imports other commands' modules too (the notifier reads the worker's decoding), so
serving that registry would export their series at zero: a notifier whose "last message"
gauge reads 1970 sets off a staleness alert. A command serves a registry of its own modules'
metrics instead, beside the process's own (CPU, memory, open files, GC).

Ports differ per command (``DEFAULT_PORTS``), so a worker and a notifier on one host both
serve; metrics listen on the loopback unless ``SERVEWATCH_METRICS_HOST`` says otherwise
(a container publishing its port sets ``0.0.0.0``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from types import ModuleType
from typing import Literal

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry
from prometheus_client import start_http_server as _start_http_server
from prometheus_client.metrics import MetricWrapperBase

logger = logging.getLogger(__name__)

Command = Literal["worker", "notifier"]

#: Each command's port when ``SERVEWATCH_METRICS_PORT`` is not set (9464 is OpenTelemetry's
#: Prometheus exporter port; the notifier takes the next).
DEFAULT_PORTS: dict[Command, int] = {"worker": 9464, "notifier": 9465}


def metrics_of(modules: Iterable[ModuleType]) -> list[MetricWrapperBase]:
    """The metrics a module defines at its top level (its ``Counter``s, ``Gauge``s...)."""
    return [value for module in modules for value in vars(module).values() if isinstance(value, MetricWrapperBase)]


def command_modules(command: Command, delivers: bool = False) -> list[ModuleType]:
    """The modules whose metrics ``command`` serves; ``delivers``: a worker that notifies too."""
    from servewatch.pipeline.notify import delivery
    from servewatch.pipeline.streams import partition_watchdog

    if command == "notifier":
        return [delivery, partition_watchdog]
    from servewatch.pipeline.worker import metrics, segment_metrics

    return [metrics, segment_metrics, partition_watchdog, *([delivery] if delivers else [])]


def registry_for(modules: Iterable[ModuleType]) -> CollectorRegistry:
    """A registry of these modules' metrics and the process's own."""
    registry = CollectorRegistry(auto_describe=True)
    for collector in [*metrics_of(modules), PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR]:
        registry.register(collector)
    return registry


def serve(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve ``registry`` on ``host:port`` (0: a free port) in a thread; returns the port.
    ``OSError`` when the port is taken."""
    server, _ = _start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
