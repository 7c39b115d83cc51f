"""A throwaway TLS and SASL/SCRAM setup for an Apache Kafka node in tests (``ApacheKafka(security=...)``).

``generate_security(folder)`` writes a CA and a server certificate for 127.0.0.1 and localhost
as PEM files (with the ``openssl`` command line tool), and picks a SCRAM user and password;
``server_properties`` is what a node needs to serve clients on ``SASL_SSL`` only (its brokers
and controller talk PLAINTEXT on loopback ports of their own). Clients connect with the
documented settings, ``KafkaSecurity.env`` (``SERVEWATCH_SECURITY_PROTOCOL`` and the rest).
"""

from __future__ import annotations

import logging
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servewatch.pipeline.kafka import KafkaAuth

logger = logging.getLogger(__name__)

MECHANISM = "SCRAM-SHA-512"
#: The client listener's name (and protocol): its properties are ``listener.name.sasl_ssl.*``.
LISTENER = "SASL_SSL"
DAYS = "2"  # a test's certificates need not outlive it


@dataclass(frozen=True)
class KafkaSecurity:
    """PEM files of a throwaway CA and server certificate, and the SCRAM user a node creates."""

    cafile: Path
    certfile: Path
    keyfile: Path
    username: str
    password: str
    mechanism: str = MECHANISM

    def scram_argument(self) -> str:
        """``StorageTool format --add-scram``'s value: the user exists from the node's first start."""
        return f"{self.mechanism}=[name={self.username},password={self.password}]"

    def auth(self, password: str | None = None) -> KafkaAuth:
        """How a client connects (``password``: another one, to be refused)."""
        from servewatch.pipeline.kafka import KafkaAuth

        return KafkaAuth(LISTENER, self.mechanism, self.username, password or self.password, str(self.cafile))

    async def probe(self, bootstrap: str, timeout_s: float) -> None:
        """Wait until ``bootstrap`` answers a metadata request of this user over SASL_SSL, or
        raise ``BrokerError`` (``probe_kafka``, authenticated)."""
        from servewatch.pipeline.dev.broker import probe_kafka

        await probe_kafka(bootstrap, timeout_s, self.auth().client_options())

    def env(self, bootstrap: str, password: str | None = None) -> dict[str, str]:
        """The documented ``SERVEWATCH_*`` settings of a command connecting to ``bootstrap``."""
        return {
            "SERVEWATCH_BROKER": bootstrap,
            "SERVEWATCH_SECURITY_PROTOCOL": LISTENER,
            "SERVEWATCH_SASL_MECHANISM": self.mechanism,
            "SERVEWATCH_SASL_USERNAME": self.username,
            "SERVEWATCH_SASL_PASSWORD": password or self.password,
            "SERVEWATCH_SSL_CAFILE": str(self.cafile),
        }


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("a secured Kafka for tests needs `openssl` on PATH")
    done = subprocess.run([openssl, *args], cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()[-1000:]}")


def generate_security(folder: Path, username: str = "servewatch") -> KafkaSecurity:
    """A CA, a server certificate for 127.0.0.1/localhost signed by it, and a random password."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", DAYS,
             "-subj", "/CN=servewatch test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=localhost", cwd=folder)  # fmt: skip
    (folder / "server.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-out", "server.pem",
             "-days", DAYS, "-set_serial", f"0x{secrets.token_hex(8)}", "-extfile", "server.ext",
             cwd=folder)  # fmt: skip
    logger.info("throwaway CA and server certificate for 127.0.0.1 written to %s", folder)
    return KafkaSecurity(cafile=folder / "ca.pem", certfile=folder / "server.pem", keyfile=folder / "server.key",
                         username=username, password=secrets.token_hex(12))  # fmt: skip


def _one_line(*files: Path) -> str:
    """PEM files as one server.properties line, their line breaks as ``\\n`` escapes (Kafka's
    PEM parser needs them between certificates of a chain)."""
    return "\\n".join(line for path in files for line in path.read_text().splitlines() if line.strip())


def server_properties(security: KafkaSecurity, port: int, internal_port: int, controller_port: int) -> dict[str, str]:
    """A node's listeners: clients on ``SASL_SSL://127.0.0.1:port`` (SCRAM over TLS, nothing
    else), the broker itself on a PLAINTEXT ``INTERNAL`` one and its controller on another."""
    prefix = f"listener.name.{LISTENER.lower()}"
    return {
        "listeners": f"{LISTENER}://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port},"
                     f"CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"{LISTENER}://127.0.0.1:{port},INTERNAL://127.0.0.1:{internal_port}",
        "listener.security.protocol.map": f"{LISTENER}:{LISTENER},INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "INTERNAL",
        "sasl.enabled.mechanisms": security.mechanism,
        f"{prefix}.sasl.enabled.mechanisms": security.mechanism,
        f"{prefix}.{security.mechanism.lower()}.sasl.jaas.config":
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        f"{prefix}.ssl.keystore.type": "PEM",
        # In line, not ``ssl.keystore.location``: a PEM file keystore needs an encrypted key.
        f"{prefix}.ssl.keystore.key": _one_line(security.keyfile),
        f"{prefix}.ssl.keystore.certificate.chain": _one_line(security.certfile, security.cafile),
        f"{prefix}.ssl.client.auth": "none",
    }  # fmt: skip
