"""The worker's own Prometheus metrics (counted always, served when ``metrics_port`` is set)."""

from __future__ import annotations

import urllib.request

from prometheus_client import Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

RECORDS = Counter("servewatch_records", "Request logs accepted.")
MESSAGES = Counter("servewatch_messages", "Kafka messages read from the requests topic.")
DEAD_LETTERS = Counter("servewatch_dead_letters", "Records sent to the dead-letter topic.", ["reason"])
PARTIALS = Counter("servewatch_partials", "Window partials sent from stage 1 to stage 2.")
LATE_PARTIALS = Counter("servewatch_late_partials", "Partials that arrived after their window was judged.")
WINDOWS = Counter("servewatch_windows", "Segment windows judged.")
ANOMALY_EVENTS = Counter("servewatch_anomaly_events", "Anomaly events emitted.", ["signal", "status", "severity"])
LIVE_SEGMENTS = Gauge("servewatch_live_segments", "Segments with a detector on this worker.")
LAST_MESSAGE = Gauge(
    "servewatch_last_message_timestamp_seconds", "Unix time the worker last processed a requests message."
)
RESTORED_SEGMENTS = Gauge(
    "servewatch_restored_segments", "Segments whose detector state this worker restored from the state table."
)
DISCARDED_STATES = Gauge(
    "servewatch_discarded_states", "Stored detector states not loaded (other version or corrupt): started fresh."
)
STATE_WRITE_FAILURES = Counter(
    "servewatch_state_write_failures", "Times storing detector state in the state table failed (events still sent)."
)


def served_value(port: int, name: str) -> float:
    """Sum of a metric's samples on a worker's /metrics page on this host (0 when absent or
    not up yet): how the benchmarks and integration tests watch a worker from outside."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)
