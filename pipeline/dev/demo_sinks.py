"""Where the demo's pages go: a local receiver standing in for Slack, PagerDuty, Alertmanager
and a webhook, in a process of its own, and the notifier config that points at it.

The demo's worker delivers (``SERVEWATCH_NOTIFY_CONFIG``) to the receiver exactly as it
would to the real services; the receiver logs every accepted request as a JSON line, which
the demo counts per sink at the end (and which shows the payloads themselves).
"""

from __future__ import annotations

import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from servewatch.pipeline.dev.children import start_announcing, stop
from servewatch.pipeline.dev.receivers import endpoint_urls, read_log, sample_config_yaml

#: The receiver's kinds as the demo's summary names them.
_KIND_NAMES = {"slack": "Slack webhook", "slack_api": "Slack bot (post + edits)", "pagerduty": "PagerDuty",
               "alertmanager": "Alertmanager", "webhook": "webhook (signed)"}  # fmt: skip


@dataclass
class DemoReceiver:
    process: subprocess.Popen[str]
    url: str
    log: Path
    config: Path

    def stop(self) -> None:
        stop(self.process)

    def summary(self) -> list[str]:
        received = read_log(self.log)
        counts = Counter(line["kind"] for line in received)
        lines = [f"delivered to the local receiver at {self.url} (each request a JSON line of {self.log}):"]
        lines += [f"  {_KIND_NAMES.get(kind, kind)}: {counts.get(kind, 0)}" for kind in _KIND_NAMES]
        return lines


def start_receiver(directory: Path | None = None) -> DemoReceiver:
    """The receiver as a child process, and a notifier config (``notify.yaml``) pointing at it."""
    where = directory or Path(tempfile.mkdtemp(prefix="servewatch-demo-"))
    log = where / "received.jsonl"
    process, url = start_announcing(["servewatch.pipeline.dev.receivers", "--log", str(log)], "receiver ready: ")
    config = where / "notify.yaml"
    config.write_text(sample_config_yaml(endpoint_urls(url)))
    return DemoReceiver(process, url, log, config)
