"""The worker's own Prometheus metrics (counted always, served on ``metrics_port``, 9464 by default)."""

from __future__ import annotations

import urllib.request
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from servewatch.models.windows.segment_keys import is_replica_key
from servewatch.models.windows.window import COLUMN_OF

if TYPE_CHECKING:
    from servewatch.pipeline.worker.stage_one import StageOne
    from servewatch.pipeline.worker.stage_two import StageTwo

RECORDS = Counter("servewatch_records", "Request logs accepted.")
MESSAGES = Counter("servewatch_messages", "Kafka messages read from the requests topic.")
DEAD_LETTERS = Counter("servewatch_dead_letters", "Records sent to the dead-letter topic.", ["reason"])
PARTIALS = Counter("servewatch_partials", "Window partials sent from stage 1 to stage 2.")
LATE_PARTIALS = Counter("servewatch_late_partials", "Partials that arrived after their window was judged.")
WINDOWS = Counter("servewatch_windows", "Segment windows judged.")
# The accounting identity (docs/operating.md, "Event time"): once the stream is drained,
# records = judged_records + late_records + duplicate_records; dead letters are apart.
JUDGED_RECORDS = Counter("servewatch_judged_records", "Records in the windows the detectors judged.")
LATE_RECORDS = Counter(
    "servewatch_late_records",
    "Records not judged because they came too late: their window was already judged (window_judged) or "
    "their segment's state is past it (older_than_state: a replay after a crash, or an old backlog), or "
    "they were re-read together with records their window had merged already (partly_merged).",
    ["reason"],
)
ALLOWED_LATENESS = Gauge(
    "servewatch_allowed_lateness_seconds", "How late stage 1 lets records be before closing their window (learned)."
)
JUDGED_UNTIL = Gauge(
    "servewatch_judged_until_seconds",
    "Event time up to which this worker has judged the windows of each partials partition it owns.",
    ["partition"],
)
DUPLICATE_RECORDS = Counter("servewatch_duplicate_records", "Records whose request_id their window already had.")
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


def _total(name: str, **labels: str) -> float:
    return sum(
        sample.value
        for family in REGISTRY.collect()
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


class _Watched:
    """The worker's two stages, once it has them (one worker per process), for
    ``accounting_line`` to count what its open windows hold."""

    stages: tuple[StageOne, StageTwo] | None = None


def watch_open_windows(one: StageOne, two: StageTwo) -> None:
    """Let ``accounting_line`` count the records in these stages' open windows."""
    _Watched.stages = (one, two)


def open_window_records(one: StageOne, two: StageTwo) -> int:
    """Records this worker holds in windows not judged yet: decoded and waiting to be folded,
    in stage 1's open windows, and merged into stage 2's windows waiting for their turn.

    Counted from the windows, not as accepted less judged, late and duplicates: stage 2
    judges partials whoever read their records sent, another worker or this one before a
    restart, so this process's counters of the two stages do not describe the same records
    (that difference went negative after a restart)."""
    requests = COLUMN_OF["requests"]
    held = one.pending_records
    held += sum(int(window.block.sums[: len(window), requests].sum()) for window in one.windower.open.values())
    held += sum(  # replica rows hold their segments' records again
        int(window.requests)
        for pending in two.assembler.pending.values()
        for key, window in pending.by_segment.items()
        if not is_replica_key(key)
    )
    return held


def accounting_line() -> str:
    """This process's record accounting in one line (the worker's progress log and its summary
    on exit): read = accepted + dead-lettered. Stage 2 judges what any worker read (another
    one, or this one before a restart), so judged, late and duplicates need not add up to
    what this process read; "in open windows" is what this worker holds now (see
    ``open_window_records``; none before ``watch_open_windows``)."""
    accepted = _total("servewatch_records_total")
    judged = _total("servewatch_judged_records_total")
    late = _total("servewatch_late_records_total")
    duplicates = _total("servewatch_duplicate_records_total")
    dead = _total("servewatch_dead_letters_total")
    events = _total("servewatch_anomaly_events_total")
    waiting = open_window_records(*_Watched.stages) if _Watched.stages is not None else 0
    return (
        f"{accepted + dead:,.0f} records read: {judged:,.0f} judged, {late:,.0f} late, {duplicates:,.0f} duplicates, "
        f"{waiting:,} in open windows, {dead:,.0f} dead-lettered; {events:,.0f} events"
    )


def served_samples(port: int, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of a metric's samples on a worker's /metrics page on this host (none
    when absent or not up yet): how the benchmarks and integration tests watch a worker."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
            text = response.read().decode()
    except OSError:
        return []
    families = text_string_to_metric_families(text)
    return [(s.labels, s.value) for family in families for s in family.samples if s.name == name]


def served_value(port: int, name: str) -> float:
    """Sum of a metric's samples on a worker's /metrics page (0 when absent or not up yet)."""
    return sum(value for _, value in served_samples(port, name))
