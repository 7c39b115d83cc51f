"""Real Apache Kafka for tests and benchmarks, started from jars that Maven fetched once.

servewatch runs on Apache Kafka in production; day to day it is tested on the embedded Tansu
broker (``broker.py``), which has no replication, no ISR, no leader failover and no log to
recover after a crash. This module starts the real broker (KRaft mode: Kafka 4 has no
ZooKeeper) as JVM processes on loopback ports, with the same interface as ``EmbeddedBroker``:

* ``ApacheKafka``: one node, broker and controller in one process;
* ``KafkaCluster``: N such nodes in one static quorum, topics replicated 3 ways, for crash tests
  (``kill()``, ``pause()`` and restart a node, ask who leads a partition).

The jars come from Maven Central through ``kafka/pom.xml``, copied once into a cache folder
(``kafka_jars``). Only tests and benchmarks use this, and they need ``java`` (17+) and ``mvn``;
nothing is downloaded at run time of the product.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import concurrent.futures
import importlib.resources
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, TypeVar

from servewatch.pipeline.dev.broker import BrokerError, LoopbackBroker, free_loopback_ports, probe_kafka
from servewatch.pipeline.dev.kafka_security import KafkaSecurity, server_properties

logger = logging.getLogger(__name__)

KAFKA_VERSION = "4.1.1"
#: Small heap, one GC thread and the quick C1 compiler only: up to 3 brokers share 2 busy cores.
JVM_OPTIONS = ("-Xms256m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
               "-XX:+ExitOnOutOfMemoryError", "-Djava.awt.headless=true")  # fmt: skip
_MARKER = ".complete"  # written last: a folder without it is a half copy
T = TypeVar("T")


def _resource(name: str) -> Path:
    return Path(str(importlib.resources.files("servewatch.pipeline.dev") / "kafka" / name))


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise BrokerError(f"Apache Kafka for tests needs `{name}` on PATH (Java 17+ and Maven)")
    return path


def kafka_jars(version: str = KAFKA_VERSION) -> Path:
    """The folder holding Kafka's broker jars, fetched by Maven the first time.

    ``$SERVEWATCH_KAFKA_JARS`` if set, else ``$XDG_CACHE_HOME/servewatch/kafka-<version>/libs``.
    Maven copies into a sibling folder that is renamed when complete, so a run that was
    interrupted never leaves a half set of jars behind for the next one to use.
    """
    if env := os.environ.get("SERVEWATCH_KAFKA_JARS"):
        target = Path(env)
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        target = cache / "servewatch" / f"kafka-{version}" / "libs"
    if (target / _MARKER).exists():
        return target
    mvn = _tool("mvn")
    _tool("java")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    logger.info("fetching Apache Kafka %s jars with Maven into %s (once; takes a while)", version, target)
    cmd = [mvn, "-B", "-q", "-f", str(_resource("pom.xml")), f"-Dkafka.version={version}",
           "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={partial}"]  # fmt: skip
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not any(partial.glob("kafka_2.13-*.jar")):
        shutil.rmtree(partial, ignore_errors=True)
        # Maven's first [ERROR] lines say what failed; boilerplate follows the first empty one.
        output = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
        start = output.find("[ERROR]")
        what = output[start:].split("\n[ERROR] \n")[0] if start >= 0 else output[-1500:]
        raise BrokerError(f"Maven could not fetch Kafka {version} (exit {done.returncode}): {what[:1500]}")
    (partial / _MARKER).write_text(f"kafka {version}\n")
    if not (target / _MARKER).exists():  # else another process finished first: keep its copy
        shutil.rmtree(target, ignore_errors=True)  # a copy without its marker, if any
        try:
            partial.rename(target)
        except OSError:
            if not (target / _MARKER).exists():
                raise
    shutil.rmtree(partial, ignore_errors=True)
    return target


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, url-safe base64 without padding (what Kafka makes).
    One in 64 starts with ``-``: it is passed as ``--cluster-id=...``, never as an argument of its own."""
    return base64.urlsafe_b64encode(secrets.token_bytes(16)).rstrip(b"=").decode()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from sync code, also when called inside a running loop
    (then on a worker thread; async callers should rather ``await asyncio.to_thread(...)``
    around long calls like ``start()``, which would otherwise block their loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


_LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    """A test run that dies without stopping its brokers must not leave JVMs holding 512 MB each."""
    for proc in list(_LIVE):
        if proc.poll() is None:
            proc.kill()


@dataclass
class ApacheKafka(LoopbackBroker):
    """One Kafka node (broker + controller) on loopback ports; a (sync) context manager like
    ``EmbeddedBroker``: ``with ApacheKafka() as kafka: ...`` then use ``kafka.bootstrap``.

    Its data lives in a temporary folder kept across ``kill()`` and ``start()``, so a node
    restarted after a crash recovers its log; ``stop()`` removes it.
    """

    port: int = 0
    controller_port: int = 0
    node_id: int = 1
    startup_timeout_s: float = 60.0
    cluster_id: str = field(default_factory=new_cluster_id)
    #: ``controller.quorum.voters``; empty: this node alone.
    voters: str = ""
    #: server.properties that replace or add to the defaults (a cluster's replication settings).
    overrides: dict[str, str] = field(default_factory=dict)
    jvm_options: tuple[str, ...] = JVM_OPTIONS
    #: Clients on SASL_SSL (SCRAM over TLS) only, at ``bootstrap``; None: PLAINTEXT.
    security: KafkaSecurity | None = None
    #: With ``security``: the PLAINTEXT listener the broker uses for itself.
    internal_port: int = 0
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _workdir: Path | None = field(default=None, init=False, repr=False)
    # A file, not a pipe: a chatty broker must never block on a full pipe nobody reads.
    _log: IO[bytes] | None = field(default=None, init=False, repr=False)

    def properties(self) -> dict[str, str]:
        """server.properties: one combined node, one replica of everything unless ``overrides``."""
        assert self._workdir is not None
        one = "1"
        return {
            "process.roles": "broker,controller", "node.id": str(self.node_id),
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT", "controller.listener.names": "CONTROLLER",
            "controller.quorum.voters": self.voters or f"{self.node_id}@127.0.0.1:{self.controller_port}",
            # As the compose file: topics are created with their partitions, never by a first
            # request for their metadata (a Faust table's changelog would get 1 partition, and
            # its agents then only one partition of their topic's worth of work).
            "log.dirs": str(self._workdir / "data"), "num.partitions": one, "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": one, "group.initial.rebalance.delay.ms": "0",
            "transaction.state.log.replication.factor": one, "transaction.state.log.min.isr": one,
            "share.coordinator.state.topic.replication.factor": one, "share.coordinator.state.topic.min.isr": one,
            # Fewer threads and buffers than a production broker: this one holds test data.
            "num.network.threads": "2", "num.io.threads": "2", "log.cleaner.dedupe.buffer.size": str(16 << 20),
            **(server_properties(self.security, self.port, self.internal_port, self.controller_port)
               if self.security else {}),
            **self.overrides,
        }  # fmt: skip

    def _java(self, main: str, *args: str) -> list[str]:
        log4j = f"-Dlog4j2.configurationFile={_resource('log4j2.properties')}"
        return [_tool("java"), *self.jvm_options, log4j, "-cp", f"{kafka_jars()}/*", main, *args]

    def launch(self) -> None:
        """Start the JVM without waiting for it to serve (a cluster starts all its nodes before
        it waits: a quorum needs a majority up). The first launch formats the log folder."""
        if self.running:
            return
        self._process = None
        port, controller, internal = free_loopback_ports(3)  # distinct: a node's listeners need their own
        self.port = self.port or port
        self.controller_port = self.controller_port or controller
        if self.security is not None:
            self.internal_port = self.internal_port or internal
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"servewatch-kafka-{self.node_id}-"))
            config = "".join(f"{key}={value}\n" for key, value in self.properties().items())
            (self._workdir / "server.properties").write_text(config)
            cluster = f"--cluster-id={self.cluster_id}"
            cmd = self._java("kafka.tools.StorageTool", "format", cluster, "-c", "server.properties")
            if self.security is not None:  # the SCRAM user exists from the first start
                cmd += ["--add-scram", self.security.scram_argument()]
            done = subprocess.run(cmd, cwd=self._workdir, stdin=subprocess.DEVNULL, capture_output=True, check=False)
            if done.returncode != 0:
                output = (done.stdout + done.stderr).decode(errors="replace")[-2000:]
                self.stop()
                raise BrokerError(f"Kafka's StorageTool could not format node {self.node_id}: {output}")
        if self._log is None:
            self._log = open(self._workdir / "kafka.log", "ab")  # noqa: SIM115 - closed in stop()
        logger.info("starting Apache Kafka node %d on %s", self.node_id, self.bootstrap)
        self._process = subprocess.Popen(
            self._java("kafka.Kafka", "server.properties"),
            cwd=self._workdir, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        _LIVE.add(self._process)

    def wait_ready(self) -> None:
        """Block until the node answers a Kafka request; ``BrokerError`` with its log if not."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if not self.running:
                raise BrokerError(f"Kafka node {self.node_id} exited during startup. {self.log_tail()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerError(f"Kafka node {self.node_id} did not serve on {self.bootstrap} "
                                  f"within {self.startup_timeout_s}s. {self.log_tail()}")  # fmt: skip
            try:  # short probes, so that a JVM that died is noticed early
                _run(self.probe(min(remaining, 5.0)))
                logger.info("Apache Kafka node %d ready at %s", self.node_id, self.bootstrap)
                return
            except BrokerError:
                continue

    async def probe(self, timeout_s: float) -> None:
        """``probe_kafka`` as a client of this node: over SASL_SSL with ``security``."""
        if self.security is None:
            await probe_kafka(self.bootstrap, timeout_s)
        else:
            await self.security.probe(self.bootstrap, timeout_s)

    def start(self) -> ApacheKafka:
        """Start (or restart after ``kill()``, on the same ports and data) and wait until it serves.
        A failed first start cleans up; a failed restart keeps the data until ``stop()``."""
        fresh = self._workdir is None
        self.launch()
        try:
            self.wait_ready()
        except BrokerError:
            self.stop() if fresh else self.kill()
            raise
        return self

    def log_tail(self, chars: int = 3000) -> str:
        path = self._workdir / "kafka.log" if self._workdir else None
        if path is None or not path.exists():
            return ""
        with path.open("rb") as log:
            log.seek(max(0, path.stat().st_size - chars))
            return log.read().decode(errors="replace")

    def _signal(self, sig: signal.Signals) -> None:
        if self.running and self._process is not None:
            self._process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data stays for a restart with ``start()``."""
        self._signal(signal.SIGKILL)
        if self._process is not None:
            self._process.wait(timeout=10)
            _LIVE.discard(self._process)
        logger.info("Apache Kafka node %d killed", self.node_id)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM (a controlled shutdown), SIGKILL after ``grace_s``; then remove the data."""
        proc, self._process = self._process, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a paused JVM acts on SIGTERM only once resumed
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    logger.warning("Kafka node %d ignored SIGTERM for %ss: killing it", self.node_id, grace_s)
                    proc.kill()
                    proc.wait(timeout=10)
            _LIVE.discard(proc)
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
            logger.info("Apache Kafka node %d on %s stopped", self.node_id, self.bootstrap)


@dataclass
class KafkaCluster:
    """N Kafka nodes, each broker and controller, in one static quorum; topics are replicated
    ``min(3, N)`` ways and need a majority of their replicas in sync to take ``acks=all``."""

    size: int = 3
    startup_timeout_s: float = 90.0
    nodes: list[ApacheKafka] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        replicas = min(3, self.size)
        min_isr = str(replicas // 2 + 1)
        overrides = {"default.replication.factor": str(replicas), "min.insync.replicas": min_isr,
                     "offsets.topic.replication.factor": str(replicas),
                     "transaction.state.log.replication.factor": str(replicas),
                     "transaction.state.log.min.isr": min_isr,
                     "share.coordinator.state.topic.replication.factor": str(replicas),
                     "share.coordinator.state.topic.min.isr": min_isr}  # fmt: skip
        chosen = free_loopback_ports(2 * self.size)
        ports = [(chosen[2 * i], chosen[2 * i + 1]) for i in range(self.size)]
        voters = ",".join(f"{i}@127.0.0.1:{controller}" for i, (_, controller) in enumerate(ports, 1))
        cluster_id = new_cluster_id()
        self.nodes = [
            ApacheKafka(port, controller, i, self.startup_timeout_s, cluster_id, voters, overrides)
            for i, (port, controller) in enumerate(ports, 1)
        ]

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def url(self) -> str:
        """All nodes as Faust spells them; Faust also takes ``;``, but a comma keeps
        ``Settings.bootstrap`` (the URL less ``kafka://``) a valid aiokafka bootstrap list."""
        return f"kafka://{self.bootstrap}"

    @property
    def profile(self) -> str:
        return "kafka"

    @property
    def running(self) -> bool:
        """Any node's JVM is alive."""
        return any(node.running for node in self.nodes)

    def node(self, node_id: int) -> ApacheKafka:
        return next(node for node in self.nodes if node.node_id == node_id)

    def start(self) -> KafkaCluster:
        try:
            for node in self.nodes:
                node.launch()
            for node in self.nodes:
                node.wait_ready()
        except BrokerError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # SIGTERM to all first: a node waiting for a quorum that has gone would hang its shutdown.
        for node in self.nodes:
            node._signal(signal.SIGTERM)
            node.resume()
        for node in self.nodes:
            node.stop()

    def partition(self, topic: str, partition: int) -> dict[str, Any]:
        """The partition's metadata from a live node: ``leader``, ``replicas``, ``isr`` (node ids)."""
        from aiokafka.admin import AIOKafkaAdminClient

        async def describe(bootstrap: str) -> list[Any]:
            admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
            try:
                await admin.start()
                return await admin.describe_topics([topic])
            finally:
                await admin.close()

        live = ",".join(node.bootstrap for node in self.nodes if node.running) or self.bootstrap
        for found in _run(describe(live)):
            for part in found["partitions"] if found["topic"] == topic else []:
                if part["partition"] == partition:
                    return dict(part)
        raise BrokerError(f"no partition {topic}[{partition}] in the cluster's metadata")

    def leader_of(self, topic: str, partition: int) -> int:
        """The node id leading ``topic[partition]``, -1 while none does."""
        return int(self.partition(topic, partition)["leader"])

    def __enter__(self) -> KafkaCluster:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
