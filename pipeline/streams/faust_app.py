"""The Faust app every Kafka-reading command runs on: the configured broker, its transport
and consumer-group timing per broker kind, credentials, and servewatch's Faust settings."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from typing import Any, cast

import faust

from servewatch.pipeline.kafka import KafkaAuth
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.streams import kafka_transport, tansu_transport
from servewatch.pipeline.streams.seek_guard import hold_flow_while_seeking

# Consumer-group timing per broker kind. The session timeout bounds how long a crashed
# worker's partitions stay unread: Faust's default of 60 s meant a minute and a half
# blind after a kill -9. Kafka clients used 10 s for years (45 s since 3.0, for flaky
# networks); servewatch's steps never block the event loop, which sends the heartbeats,
# for more than milliseconds, so 10 s with a heartbeat every 2 s is safe on Kafka. Tansu
# also holds a JoinGroup for half the session timeout, so it gets 6 s.
GROUP_TIMING: dict[str, dict[str, Any]] = {
    "kafka": {"broker_session_timeout": 10.0, "broker_heartbeat_interval": 2.0, "broker_rebalance_timeout": 20.0},
    "tansu": {"broker_session_timeout": 6.0, "broker_heartbeat_interval": 1.0, "broker_rebalance_timeout": 6.0},
}


def _scheme(profile: str) -> str:
    """Faust transport per broker kind: Tansu needs shorter fetch long-polls (``tansu_transport``),
    Kafka gets an idempotent producer (``kafka_transport``)."""
    return tansu_transport.register() if profile == "tansu" else kafka_transport.register()


def _faust_credentials(auth: KafkaAuth) -> faust.SASLCredentials | faust.SSLCredentials | None:
    """The same connection settings as every other client (``KafkaAuth``), as Faust takes them."""
    if auth.protocol.startswith("SASL_"):
        return faust.SASLCredentials(username=auth.username, password=auth.password, mechanism=auth.mechanism,
                                     ssl_context=auth.ssl_context())  # fmt: skip
    if auth.protocol == "SSL":
        return faust.SSLCredentials(auth.ssl_context())
    return None


def faust_app(settings: Settings, app_id: str | None = None) -> faust.App:
    """A Faust app on the configured broker with servewatch's settings and no agents yet.

    ``app_id`` names its consumer group and its tables' changelogs (default: the worker's).
    """
    if settings.kafka.bootstrap is None:
        raise ValueError("a Faust app needs a broker address; the CLI starts the embedded one when none is set")
    auth = KafkaAuth.from_settings(settings)
    made_here = not settings.process.data_dir  # unset, or set empty
    datadir = tempfile.mkdtemp(prefix="servewatch-faust-") if made_here else str(settings.process.data_dir)
    app = faust.App(
        app_id or settings.kafka.app_id,
        broker=f"{_scheme(settings.kafka.broker_profile)}://{settings.kafka.bootstrap}",
        broker_credentials=_faust_credentials(auth),
        store=settings.process.store,
        # Tansu under-reports a changelog's end offset, which Faust's consistency check after
        # recovering a RocksDB table trusts; memory tables are rebuilt in full either way.
        recovery_consistency_check=not (
            settings.process.store.startswith("rocksdb") and settings.kafka.broker_profile == "tansu"
        ),
        datadir=datadir,
        topic_partitions=settings.kafka.topic_partitions,
        # The tables' changelogs as the topics (``ensure_topics_of`` sets it from the cluster).
        topic_replication_factor=settings.kafka.topic_replication or 1,
        web_enabled=False,
        producer_linger=0.0,  # Tansu under-reports end offsets of multi-record batches
        # Messages still feeding open windows are unacknowledged by design; on shutdown they
        # are left for the next worker to replay rather than waited for.
        stream_wait_empty=False,
        producer_max_request_size=max(settings.kafka.max_message_bytes, 1_048_576) + 65_536,
        consumer_max_fetch_size=max(settings.kafka.max_message_bytes, 1_048_576) + 65_536,
        **GROUP_TIMING[settings.kafka.broker_profile],
    )
    # Without it, records fetched while Faust resumes after a rebalance are skipped for good.
    hold_flow_while_seeking(cast(Any, app.consumer))
    if made_here:
        # A dir of its own goes with the app (or at exit): every run made one, and /tmp kept them all.
        weakref.finalize(app, shutil.rmtree, datadir, ignore_errors=True)
    return app
