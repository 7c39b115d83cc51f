"""servewatch's settings, one group per concern, each read from ``SERVEWATCH_*`` variables.

``pipeline.settings.Settings`` holds one of each; a command reads the groups it needs. A
group's variables are its fields' names, upper-cased, after ``SERVEWATCH_`` (and the group's
own prefix for the shipper, the triage page, Grafana and the load generator:
``SERVEWATCH_SHIP_BATCH_RECORDS``). Lists are given as JSON or comma-separated, e.g.
``SERVEWATCH_SEGMENT_DIMENSIONS='["model","route"]'``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.windows.segment_keys import DEFAULT_DIMENSIONS
from servewatch.models.windows.signal_columns import DEFAULT_REASONING_MARKERS
from servewatch.pipeline.tuning import HEAP_TRIM_INTERVAL_S, MMAP_THRESHOLD_BYTES

_DETECTOR = DetectorConfig()  # the detectors' defaults, read once


def _list(value: Any) -> Any:
    """A list setting from the environment: JSON (``[4096,32768]``) or comma-separated (``4096,32768``)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.startswith("["):
        return json.loads(text)
    return [part.strip() for part in text.split(",") if part.strip()]


class _Group(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SERVEWATCH_", extra="forbid")


class KafkaSettings(_Group):
    """Where the broker is and how every Kafka client connects (every command)."""

    broker: str | None = Field(
        default=None, description="Kafka bootstrap 'host:port' (or kafka://...). Unset: start the embedded broker."
    )
    broker_profile: Literal["kafka", "tansu"] = Field(
        default="kafka", description="'tansu' applies the timeouts the embedded broker needs (set automatically)."
    )
    broker_wait_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a long-running command (worker, notify, web, scrape) waits at start for a broker it "
        "cannot reach (one started after it), trying again after 1 s, doubling up to 15 s, before it gives up "
        "(exit 2). A broker that answers and refuses (credentials, TLS) is not waited for. 0: no wait.",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="How every Kafka client connects (worker, shipper, scraper, evidence reads)."
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        default="PLAIN", description="SASL mechanism, with security_protocol SASL_PLAINTEXT or SASL_SSL."
    )
    sasl_username: str | None = Field(default=None, description="SASL user.")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password (never logged or printed).")
    ssl_cafile: str | None = Field(default=None, description="CA bundle for SSL/SASL_SSL (default: the system's).")
    ssl_certfile: str | None = Field(default=None, description="Client certificate (mutual TLS).")
    ssl_keyfile: str | None = Field(default=None, description="Client certificate's private key (mutual TLS).")
    app_id: str = Field(
        default="servewatch", description="Workers of one app id split the topics' partitions (Faust's app id)."
    )
    topic_partitions: int = Field(default=4, ge=1, description="Partitions of each topic servewatch creates.")
    batch_reader: bool = Field(
        default=True,
        description="Read the requests topic in getmany batches, in a consumer group of its own (<app id>-requests): "
        "one-record messages at about the pace of batches. false: a Faust agent in the <app id> group reads it, "
        "paying Faust's cost per message.",
    )
    topic_replication: int | None = Field(
        default=None, ge=1,
        description="Replicas of each topic servewatch creates, its tables' changelogs included (default: "
                    "3, or every broker of a smaller cluster; a replica per broker survives a broker's loss "
                    "with min.insync.replicas=2 and producers that wait for all in-sync replicas).",
    )  # fmt: skip
    max_message_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024,
        description="Largest message or record line read (larger: dead-lettered as too_large); the worker's "
                    "producer and fetches allow that much.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _check_security(self) -> KafkaSettings:
        sasl = self.security_protocol.startswith("SASL_")
        if sasl and not (self.sasl_username and self.sasl_password):
            raise ValueError(f"security_protocol {self.security_protocol} needs sasl_username and sasl_password")
        if not sasl and (self.sasl_username or self.sasl_password):
            raise ValueError("sasl_username/sasl_password are set but security_protocol is not SASL_SSL or "
                             f"SASL_PLAINTEXT ({self.security_protocol})")  # fmt: skip
        return self

    @property
    def bootstrap(self) -> str | None:
        """The broker's address as clients take it (``broker`` without ``kafka://``)."""
        if self.broker is None:
            return None
        return self.broker.removeprefix("kafka://")


class ProcessSettings(_Group):
    """The process of every long-running command: storage, memory, metrics, logging."""

    data_dir: str | None = Field(
        default=None, description="Faust's data dir; a fresh temp dir when unset, removed when the process exits."
    )
    store: Literal["memory://", "rocksdb://"] = Field(
        default="memory://",
        description="Where the worker keeps its detector-state table: in memory (default), or in RocksDB on "
        "disk under data_dir for large state (pip install 'servewatch[rocksdb]'). Either way the table is "
        "backed by its changelog topic and restored from it on takeover.",
    )
    mmap_threshold_bytes: int = Field(
        default=MMAP_THRESHOLD_BYTES,
        ge=0,
        description="glibc mmap threshold pinned by the worker and replay; 0 (default) keeps glibc's dynamic "
        "one. A low pin (e.g. 131072) maps every large message buffer: ~10 % less throughput.",
    )
    heap_trim_interval_s: float = Field(
        default=HEAP_TRIM_INTERVAL_S,
        ge=0,
        description="Seconds between the worker's heap trims (glibc malloc_trim), which hand the free space "
        "left by each window's buffers back to the OS and keep RSS at the live data. 0: never.",
    )
    progress: Literal["auto", "always", "never"] = Field(
        default="auto", description="Commands' running progress line: on a terminal only (auto), always, never."
    )
    metrics_port: int | None = Field(
        default=None,
        ge=0,
        description="Serve Prometheus /metrics on this port (default: the command's own, the worker 9464 and "
        "the notifier 9465; 0: off). Each command serves only its own series. A port already taken stops "
        "the command with one line, exit 2.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        description="Interface /metrics listens on: the loopback unless set (0.0.0.0 in a container whose "
        "port is published).",
    )
    log_level: str = Field(default="INFO", description="Python logging level of every command (or -v).")


class WindowSettings(_Group):
    """Event time (the worker): windows, lateness, waiting for partitions, state cadence."""

    window_s: float = Field(default=10.0, gt=0, description="Seconds of event time per judged window.")
    allowed_lateness_s: float = Field(
        default=1.0,
        ge=0,
        description="The least lateness (event time) a record may arrive with and still count in its window; "
        "the worker learns more from how far behind records arrive, up to max_lateness_s.",
    )
    max_lateness_s: float = Field(
        default=120.0,
        ge=0,
        description="The most lateness the worker learns (a host further behind is counted late, per record, "
        "not waited for). At or below allowed_lateness_s: a fixed lateness, nothing learned.",
    )
    lateness_prior_s: float = Field(
        default=10.0,
        ge=0,
        description="The lateness a fresh worker starts from before it has learned (Filebeat's 10 s flush, the "
        "slowest common shipper default).",
    )
    max_future_s: float = Field(
        default=300.0,
        gt=0,
        description="A record more than this past both the wall clock and its partition's newest event time is "
        "dead-lettered as future_timestamp instead of holding its window (and its partition's offsets) open.",
    )
    dedup_request_ids: bool = Field(
        default=True,
        description="Count a request_id seen before in its window once (a re-sent batch); turn off if your "
        "request ids are not unique.",
    )
    assembler_grace_s: float = Field(
        default=0.0, ge=0, description="Extra wall seconds stage 2 waits once all watermarks passed a window."
    )
    assembler_max_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="Wall seconds after which stage 2 judges a window whatever is missing (a source gone quiet). "
        "Longer than a rebalance (session timeout + a few seconds), so that the records of the window that was "
        "open during one are merged, not counted late.",
    )
    idle_flush_s: float = Field(
        default=2.0,
        gt=0,
        description="Wall seconds of silence after which a partition's event time follows the clock (with nothing "
        "left to read there; a partition with unread records is waited for up to assembler_max_wait_s).",
    )
    fold_records: int = Field(
        default=4000,
        ge=1,
        description="Records decoded before stage 1 folds them into its windows in one pass (sooner when a "
        "message moves a watermark into the next window, or after half a second). 1: fold every message.",
    )
    state_every_windows: int = Field(
        default=6,
        ge=1,
        description="Store a segment's detector state (changelog table) every N windows it is judged, and at once "
        "when an incident moves; each store is a changelog message (~0.3 ms of a worker's time in Faust).",
    )


class SegmentSettings(_Group):
    """Workload segments (the worker): their dimensions, bands, number and lifetime."""

    segment_dimensions: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_list)] = Field(
        default=DEFAULT_DIMENSIONS, description="Labels a segment is keyed by (a JSON list or comma-separated)."
    )
    prompt_band_edges: Annotated[tuple[int, ...], NoDecode, BeforeValidator(_list)] = Field(
        default=(4096, 32768), description="Prompt tokens at which one prompt band ends and the next begins."
    )
    output_band_edges: Annotated[tuple[int, ...], NoDecode, BeforeValidator(_list)] = Field(
        default=(1024,), description="Output tokens at which one output band ends and the next begins."
    )
    max_segments: int = Field(
        default=1000, ge=1, description="Live segments at most; new label combinations beyond share 'overflow'."
    )
    no_data_after_s: float = Field(
        default=_DETECTOR.no_data_after_s,
        gt=0,
        description="Event seconds a segment may send nothing before its open incidents resolve as no_data.",
    )
    segment_idle_s: float = Field(
        default=_DETECTOR.segment_idle_s,
        gt=0,
        description="Event seconds a segment may send nothing before it is forgotten: its detectors' state and, "
        "once max_segments is reached, its id, which a new label combination then takes instead of the "
        "shared overflow segment.",
    )
    prefix_memory: int = Field(
        default=100_000, ge=2, description="Prompt-prefix hashes a worker remembers, to count shared prefixes."
    )


class ReplicaSettings(_Group):
    """Each serving instance against its peers (the worker)."""

    compare_replicas: bool = Field(
        default=True,
        description="Compare each serving instance (the request logs' instance field) with the other instances "
        "of its model on the same request mix, and page naming one that is slower or fails more (hint "
        "replica_outlier). Folds every record a second time, by segment and instance.",
    )
    max_replica_rows: int = Field(
        default=20_000,
        ge=1,
        description="(segment, instance) combinations compared at most; beyond, new ones are not compared.",
    )
    replica_min_ratio: float = Field(
        default=1.3,
        gt=1.0,
        description="The smallest difference from its peers (a ratio) an instance is paged for; smaller ones "
        "never accumulate evidence, however much traffic there is.",
    )
    replica_warmup_requests: int = Field(
        default=100,
        ge=0,
        description="Requests an instance serves before it is compared with its peers (a new replica warms up).",
    )


class DetectionSettings(_Group):
    """When a window is anomalous and an incident fires, resolves and pages (the worker)."""

    threshold: float = Field(
        default=_DETECTOR.threshold, gt=0, description="Surprise (-log10 p) that makes a window anomalous."
    )
    critical: float = Field(
        default=_DETECTOR.critical, gt=0,
        description="Surprise at which an anomalous window is critical, and a latency window fires its incident alone.",
    )  # fmt: skip
    min_requests: int = Field(
        default=_DETECTOR.min_requests, ge=1,
        description="Fewer requests behind a latency or a share in a window: no verdict, nothing learned.",
    )  # fmt: skip
    fire_after: int = Field(
        default=_DETECTOR.fire_after, ge=1, description="Anomalous windows (of fire_within) that fire an incident."
    )
    fire_within: int = Field(default=_DETECTOR.fire_within, ge=1, description="The run fire_after is counted in.")
    resolve_after: int = Field(
        default=_DETECTOR.resolve_after, ge=1, description="Normal windows in a row that resolve an incident."
    )
    update_every: int = Field(
        default=_DETECTOR.update_every, ge=1, description="A firing incident's update event every N windows."
    )
    grace_windows: int = Field(
        default=_DETECTOR.grace_windows, ge=1, description="Windows a new segment learns before it may page."
    )
    reasoning_markers: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_list)] = Field(
        default=DEFAULT_REASONING_MARKERS,
        description="Reasoning end markers; an answer containing one counts as a reasoning leak.",
    )


class EvidenceSettings(_Group):
    """The request logs an event carries as evidence (the worker, replay)."""

    evidence_per_window: int = Field(
        default=5,
        ge=0,
        description="Request logs of the anomalous window in a firing event: the worst by its signal (slowest, "
        "or showing its fault), then evidence_uniform of them picked at random.",
    )
    evidence_uniform: int = Field(
        default=2, ge=0, description="Of evidence_per_window, how many are a uniform random pick of the window."
    )
    evidence_baseline: int = Field(
        default=3, ge=0, description="Request logs of the segment's latest normal window, picked at random."
    )
    excerpt_chars: int = Field(
        default=200,
        ge=0,
        description="Length of the scrubbed answer excerpt in each evidence record (around a leaked reasoning "
        "marker, else the answer's start); 0: no answer text leaves the worker. Prompts never do.",
    )


class ChangeSettings(_Group):
    """Change markers and their verification (the worker, `servewatch changes`)."""

    watch_changes: bool = Field(
        default=True,
        description="Verify each change marker (servewatch.changes) live: the requests after it against those "
        "before, published as ChangeReports, with the rollback conditions. One worker of a fleet should.",
    )
    changes_config: str | None = Field(
        default=None,
        description="Change verification's config file (YAML or TOML: periods and rollback conditions, see "
        "pipeline/changes/config.py); unset: the defaults, no rollback conditions.",
    )
    change_horizon_windows: int = Field(
        default=30,
        ge=0,
        description="An incident starting at most this many windows after a change marker of its model names it "
        "(and its first hint is the change).",
    )


class DeliverySettings(_Group):
    """Notifications (the worker when it delivers, `servewatch notify`)."""

    notify_config: str | None = Field(
        default=None,
        description="The notifier's config file (YAML or TOML, see pipeline/notify/config.py); when set, "
        "`servewatch worker` delivers to its sinks too, as `servewatch notify` does on its own.",
    )


class ShipSettings(_Group):
    """The shipper (`servewatch ship`; pipeline/ingest/ship/shipper.py)."""

    model_config = SettingsConfigDict(env_prefix="SERVEWATCH_SHIP_", extra="forbid")

    batch_records: int = Field(default=500, ge=1, description="Records per message the shipper sends.")
    batch_bytes: int = Field(
        default=1_000_000,
        ge=1024,
        description="Bytes per message at most (also capped by max_message_bytes); under Apache Kafka's "
        "default message.max.bytes. A record larger than this is dead-lettered as too_large.",
    )
    linger_s: float = Field(default=0.2, ge=0, description="Seconds a partly filled batch waits for more.")
    prefix_chars: int = Field(
        default=2000, ge=0, description="Leading prompt characters hashed into prefix_hash (0: no hashing)."
    )
    keep_prompt: bool = Field(default=False, description="Ship prompts as logged instead of dropping them.")
    instance_from: str = Field(
        default="",
        description="A dotted path in each logged record whose value names its replica (pod, "
        "kubernetes.node_name), shipped as instance: what replicas are compared by. Empty: the "
        "record's own instance field.",
    )
    state_dir: str | None = Field(
        default=None, description="Where followed files' positions are kept; default $XDG_STATE_HOME/servewatch."
    )
    poll_s: float = Field(default=0.25, gt=0, description="Seconds between looks at a followed file at its end.")
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="After SIGTERM: how long to keep trying to deliver what was read."
    )


class WebSettings(_Group):
    """The triage page (`servewatch web`; pipeline/web/)."""

    model_config = SettingsConfigDict(env_prefix="SERVEWATCH_WEB_", extra="forbid")

    token: SecretStr | None = Field(
        default=None,
        description="Token the triage page requires (Bearer, Basic password or /login); needed to serve it "
        "on anything but loopback.",
    )
    allowed_hosts: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_list)] = Field(
        default=(),
        description="Host names the triage page answers to besides the address it listens on (on loopback also "
        "localhost, 127.0.0.1, [::1]): 'name' (any port) or 'name:port'; '*': any, behind a proxy that checks "
        "Host itself. Other Host headers get 421, which keeps DNS-rebinding pages out. Listening on 0.0.0.0 "
        "or :: with none set, any Host is taken (with a warning).",
    )
    evidence_url: str | None = Field(
        default=None,
        description="URL template linking each evidence request to your log search: {request_id}, {model}, "
        "{instance}, {route}, {start}/{end} (ISO) or {start_ms}/{end_ms} (see pipeline/web/links.py).",
    )
    segment_url: str | None = Field(
        default=None,
        description="URL template linking each segment to its dashboard: {segment} (the key), its labels "
        "({model}, {route}, ...), {start}/{end} or {start_ms}/{end_ms}.",
    )


class GrafanaSettings(_Group):
    """Grafana, where the triage page links and annotates."""

    model_config = SettingsConfigDict(env_prefix="SERVEWATCH_GRAFANA_", extra="forbid")

    url: str | None = Field(
        default=None, description="Grafana base URL: the triage page annotates firing and resolved groups there."
    )
    token: SecretStr | None = Field(
        default=None, description="Grafana service-account token for POST /api/annotations."
    )


class LoadgenSettings(_Group):
    """The load generator (`servewatch loadgen`; pipeline/loadgen/)."""

    model_config = SettingsConfigDict(env_prefix="SERVEWATCH_LOADGEN_", extra="forbid")

    api_key: SecretStr | None = Field(
        default=None, description="API key servewatch loadgen sends to its target (Authorization: Bearer)."
    )
