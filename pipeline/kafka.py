"""Small aiokafka helpers for the CLI, the demo and tests: topics, producing, reading, and
the one place where a Kafka client learns how to authenticate (``KafkaAuth``)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaClient, AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import IncompatibleBrokerVersion, KafkaError, KafkaTimeoutError, NoError, for_code
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.transaction import InitProducerIdRequest

from servewatch.pipeline import topics

if TYPE_CHECKING:
    from servewatch.pipeline.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KafkaAuth:
    """How a client connects: ``SERVEWATCH_SECURITY_PROTOCOL`` (PLAINTEXT, SSL, SASL_PLAINTEXT,
    SASL_SSL), SASL PLAIN or SCRAM credentials, and TLS files. Every client servewatch opens
    (Faust's, the shipper's, the scraper's, the evidence reader's, the admin creating
    topics) takes its options from here, so none can be left unauthenticated."""

    protocol: str = "PLAINTEXT"
    mechanism: str = "PLAIN"
    username: str | None = None
    password: str | None = None
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> KafkaAuth:
        kafka = settings.kafka
        password = kafka.sasl_password.get_secret_value() if kafka.sasl_password else None
        return cls(kafka.security_protocol, kafka.sasl_mechanism, kafka.sasl_username, password,
                   kafka.ssl_cafile, kafka.ssl_certfile, kafka.ssl_keyfile)  # fmt: skip

    @property
    def uses_tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.uses_tls:
            return None
        return create_ssl_context(cafile=self.cafile, certfile=self.certfile, keyfile=self.keyfile)

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for any aiokafka client (producer, consumer, admin)."""
        options: dict[str, Any] = {"security_protocol": self.protocol}
        if self.uses_tls:
            options["ssl_context"] = self.ssl_context()
        if self.protocol.startswith("SASL_"):
            options.update(sasl_mechanism=self.mechanism, sasl_plain_username=self.username,
                           sasl_plain_password=self.password)  # fmt: skip
        return options


PLAINTEXT = KafkaAuth()


#: Replicas a topic gets where the settings do not say: what survives one broker's loss while
#: still accepting writes (with ``min.insync.replicas=2``), as Kafka's own internal topics.
DEFAULT_REPLICATION = 3


async def ensure_topics(
    bootstrap: str,
    partitions: int,
    names: tuple[str, ...] = topics.ALL,
    auth: KafkaAuth = PLAINTEXT,
    replication: int | None = None,
) -> int:
    """Create servewatch's topics with ``partitions`` partitions where they do not exist yet;
    the replication they are (or would be) created with.

    Done before anything produces, so that a broker's auto-creation (often 1 partition, 1
    replica) never decides the layout. ``replication`` None: ``DEFAULT_REPLICATION``, or every
    broker of a smaller cluster (a single broker, the embedded one, gets 1).
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **auth.client_options())
    await admin.start()
    try:
        if replication is None:
            brokers = len((await admin.describe_cluster())["brokers"])
            replication = max(1, min(DEFAULT_REPLICATION, brokers))
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(name, num_partitions=partitions, replication_factor=replication,
                     topic_configs=topics.TOPIC_CONFIGS.get(name))
            for name in names if name not in existing
        ]  # fmt: skip
        if missing:
            await admin.create_topics(missing)
            logger.info("created topics %s (%d replicas)", [t.name for t in missing], replication)
        return replication
    finally:
        await admin.close()


class Producer(AIOKafkaProducer):
    """An aiokafka producer that is idempotent where the broker grants producer ids.

    Idempotence: the broker writes a batch the producer retries (its answer was lost, a
    leader moved) once and in order, where a plain producer may duplicate or reorder it.
    ``idempotence`` None (auto) asks one broker for a producer id in ``start()``, before the
    producer sends anything: Apache Kafka grants one, and that answer is the id the producer
    then uses (no extra round trip); a broker that refuses gets a plain producer, as before.
    The embedded Tansu refuses (UNKNOWN_SERVER_ERROR) although its ApiVersions lists
    InitProducerId, so asking is the only test. Nothing is checked per send. True: idempotent,
    or ``start()`` fails; False: never. Auto needs acks=all, as idempotence does.

    aiokafka retries an idempotent producer's batches until they are delivered (a plain
    producer's fail after ``request_timeout_ms``), so a send waits while the broker is
    unreachable; ``stop()`` keeps the plain bound, so that a stopping process never waits
    for a broker that is gone. Unlike Kafka's Java client it does not start a new sequence
    after the broker lost records it had acknowledged (OutOfOrderSequenceNumber): sends to
    that partition then fail until the producer is restarted.
    """

    _txn_manager: Any  # aiokafka's TransactionManager; None: not idempotent

    def __init__(self, *, idempotence: bool | None = None, **options: Any) -> None:
        self._ask_broker = (
            idempotence is None and options.get("acks") in ("all", -1) and options.get("transactional_id") is None
        )
        super().__init__(enable_idempotence=bool(idempotence) or self._ask_broker, **options)

    @property
    def idempotent(self) -> bool:
        return self._txn_manager is not None

    @property
    def request_timeout_s(self) -> float:
        return float(self._request_timeout_ms) / 1000

    @property
    def producer_id(self) -> int | None:
        """The id the broker granted (None: not idempotent, or not started yet)."""
        if self._txn_manager is None or not self._txn_manager.has_pid():
            return None
        return int(self._txn_manager.producer_id)

    async def start(self) -> None:
        if not self._ask_broker:
            await super().start()
            return
        # ``AIOKafkaProducer.start`` (aiokafka 0.14) is these two steps; asking in between
        # keeps its sender from asking itself, which fails the start on a refusal.
        await self.client.bootstrap()
        if not await self._granted_producer_id():
            # What ``enable_idempotence=False`` would have built: no transaction manager.
            self._txn_manager = self._message_accumulator._txn_manager = self._sender._txn_manager = None
        await self._sender.start()

    async def _granted_producer_id(self) -> bool:
        """Ask one broker for a producer id; False if it refuses one (then none is used)."""
        manager = self._txn_manager
        request = InitProducerIdRequest(transactional_id=None, transaction_timeout_ms=manager.transaction_timeout_ms)
        try:
            response = await self.client.send(self.client.get_random_node(), request)
        except IncompatibleBrokerVersion:  # InitProducerId is not among the broker's ApiVersions
            refusal = "no InitProducerId"
        except KafkaError:
            return True  # not asked (a connection lost meanwhile): the sender asks, and retries, as aiokafka does
        else:
            error = for_code(response.error_code)
            if error is NoError:
                manager.set_pid_and_epoch(response.producer_id, response.producer_epoch)
                return True
            if error.retriable:  # Apache Kafka allocating its first ids after a start: the sender asks again
                return True
            refusal = error.__name__
        logger.info("the broker grants no producer id (%s): producing without idempotence", refusal)
        return False

    async def stop(self) -> None:
        if self._txn_manager is not None and self._txn_manager.transactional_id is None:
            # aiokafka (0.14, ``SendProduceReqHandler._can_retry``) lets a batch expire after
            # request_timeout_ms only when its sender has no transaction manager. At stop, ordering
            # no longer matters: the plain bound, not a wait for a broker that may never return.
            self._sender._txn_manager = None
        await super().stop()


def producer(
    bootstrap: str,
    max_request_size: int = 16 * 1024 * 1024,
    auth: KafkaAuth = PLAINTEXT,
    idempotence: bool | None = None,
) -> Producer:
    """servewatch's producer (not started): acks=all, no linger, idempotent where the broker
    grants producer ids (``idempotence`` None: asked once at start; see ``Producer``)."""
    # linger 0: Tansu under-reports end offsets of multi-record batches (the shared notes on Kafka and Faust).
    # acks all: a record is sent once every in-sync replica has it, so a leader that dies
    # right after answering loses nothing (the default, the leader alone, would).
    return Producer(
        bootstrap_servers=bootstrap, linger_ms=0, acks="all", max_request_size=max_request_size,
        idempotence=idempotence, **auth.client_options(),
    )  # fmt: skip


async def send_one(bootstrap: str, topic: str, key: bytes, value: bytes, auth: KafkaAuth = PLAINTEXT) -> None:
    """Publish one record and return once the broker has it (a CLI's marker, silence...).

    Raises ``KafkaTimeoutError`` when the broker has not taken it within the producer's
    request timeout, as a plain producer would: an idempotent one would wait for ever."""
    client = producer(bootstrap, auth=auth)
    await client.start()
    try:
        try:
            await asyncio.wait_for(client.send_and_wait(topic, key=key, value=value), client.request_timeout_s)
        except TimeoutError:
            raise KafkaTimeoutError(f"the broker did not take a record for {topic} in time") from None
    finally:
        await client.stop()


async def read_topic(
    bootstrap: str, topic: str, *, from_beginning: bool = True, poll_ms: int = 200, auth: KafkaAuth = PLAINTEXT
) -> AsyncIterator[bytes]:
    """Every message value of ``topic`` (no consumer group), as it arrives. Runs until cancelled."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest" if from_beginning else "latest",
        enable_auto_commit=False,
        fetch_max_bytes=64 * 1024 * 1024,
        max_partition_fetch_bytes=16 * 1024 * 1024,
        **auth.client_options(),
    )
    await consumer.start()
    try:
        while True:
            batches = await consumer.getmany(timeout_ms=poll_ms)
            for messages in batches.values():
                for message in messages:
                    if message.value is not None:
                        yield message.value
    finally:
        await consumer.stop()


async def assign_all(consumer: AIOKafkaConsumer, topic: str) -> list[TopicPartition]:
    """Assign every partition of ``topic`` to a group-less ``consumer`` (metadata fetched once
    more if the topic is not known yet); returns them in order."""
    numbers = consumer.partitions_for_topic(topic)
    if not numbers:
        # A group-less consumer's first metadata need not name the topic (Apache Kafka's does
        # not; the embedded broker's does). The consumer has no public refresh: its client does.
        cluster = await consumer._client.fetch_all_metadata()
        numbers = cluster.partitions_for_topic(topic) or set()
    partitions = [TopicPartition(topic, p) for p in sorted(numbers)]
    consumer.assign(partitions)
    return partitions


@dataclass(frozen=True)
class TopicRecord:
    """A message of ``follow_topic``; ``value`` None and ``caught_up`` True is the one record
    that says the end the topic had at start was reached."""

    value: bytes | None
    timestamp_s: float = 0.0
    caught_up: bool = False


async def follow_topic(
    bootstrap: str, topic: str, *, follow: bool = True, poll_ms: int = 200, auth: KafkaAuth = PLAINTEXT
) -> AsyncIterator[TopicRecord]:
    """Every message of ``topic`` from its beginning (no consumer group), with its timestamp;
    once the end it had at start is reached, one ``TopicRecord(None, caught_up=True)``, and
    with ``follow`` the messages that come after (each ``caught_up``). A small table-like
    topic (markers, silences) is read whole this way before its reader acts on it."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                **auth.client_options())  # fmt: skip
    await consumer.start()
    try:
        partitions = await assign_all(consumer, topic)
        while follow and not partitions:  # not created yet: a follower waits for it
            await asyncio.sleep(1.0)
            partitions = await assign_all(consumer, topic)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        caught_up = False
        while True:
            for messages in (await consumer.getmany(timeout_ms=poll_ms)).values():
                for message in messages:
                    yield TopicRecord(message.value, message.timestamp / 1000.0, caught_up)
            if not caught_up:
                positions = [await consumer.position(tp) for tp in partitions]
                if all(position >= ends[tp] for position, tp in zip(positions, partitions, strict=True)):
                    caught_up = True
                    yield TopicRecord(None, caught_up=True)
                    if not follow:
                        return
    finally:
        await consumer.stop()


class BrokerProbe:
    """Whether the broker answers a metadata request within ``timeout_s``.

    The worker takes a silent partition for an idle one (its event time then follows the
    wall clock, so that its last windows close): only while the broker answers. A frozen or
    unreachable broker also silences every partition, and the records it holds back are not
    late when it comes back.
    """

    def __init__(self, bootstrap: str, auth: KafkaAuth = PLAINTEXT, timeout_s: float = 1.0) -> None:
        self.bootstrap, self.auth, self.timeout_s = bootstrap, auth, timeout_s
        self._client: AIOKafkaClient | None = None

    async def answers(self) -> bool:
        try:
            if self._client is None:
                client = AIOKafkaClient(bootstrap_servers=self.bootstrap, **self.auth.client_options())
                self._client = client
                await asyncio.wait_for(client.bootstrap(), self.timeout_s)
            await asyncio.wait_for(self._client.fetch_all_metadata(), self.timeout_s)
            return True
        except (TimeoutError, KafkaError, OSError):
            await self.close()
            return False

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.timeout_s)
            except (TimeoutError, KafkaError, OSError):
                logger.debug("broker probe closed uncleanly")
