"""Any HTTP endpoint: the group and its members as JSON, signed when a secret is set.

The signature follows Stripe's and Slack's scheme: HMAC-SHA256 over ``"{timestamp}."`` and
the exact body, sent as ``X-Servewatch-Signature: v1=<hex>`` with the timestamp in
``X-Servewatch-Timestamp``. Signing the timestamp with the body lets a receiver refuse a
replayed request (``verify``'s ``tolerance_s``); ``v1=`` leaves room for another scheme
later, and a receiver rotating secrets may be sent several signatures, comma-separated.

>>> signature = sign(b"s3cret", 1767225600, b'{"seq":1}')
>>> verify(b"s3cret", 1767225600, b'{"seq":1}', signature, now=1767225660.0)
True
>>> verify(b"s3cret", 1767225600, b'{"seq":2}', signature, now=1767225660.0)
False
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import time
from collections.abc import Callable

import httpx
import orjson

from servewatch.pipeline.notify.config import Webhook
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.sinks.redact import post_hiding

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Servewatch-Signature"
TIMESTAMP_HEADER = "X-Servewatch-Timestamp"
SCHEME = "v1"
#: Headers servewatch sets itself: a configured header of the same name is dropped.
OWN_HEADERS = frozenset({"content-type", "idempotency-key", SIGNATURE_HEADER.lower(), TIMESTAMP_HEADER.lower()})
#: Configured headers whose values are credentials, kept out of error messages.
_CREDENTIAL = re.compile(r"auth|token|key|secret|cookie|password", re.IGNORECASE)


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """``v1=`` and the hex HMAC-SHA256 of ``"{timestamp}."`` followed by ``body``."""
    digest = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"{SCHEME}={digest}"


def verify(secret: bytes, timestamp: int, body: bytes, signature: str, now: float, tolerance_s: float = 300) -> bool:
    """For receivers: whether ``signature`` (the header's value) signs ``body`` at
    ``timestamp`` with ``secret``, and ``timestamp`` is within ``tolerance_s`` of ``now``."""
    if abs(now - timestamp) > tolerance_s:
        return False
    expected = sign(secret, timestamp, body)
    # compare_digest on every candidate: how long it takes says nothing about the secret.
    return any([hmac.compare_digest(expected, candidate.strip()) for candidate in signature.split(",")])


def body_of(note: Notification) -> bytes:
    """The request's body: the group and its members as they are on the anomaly topic."""
    return orjson.dumps(
        {
            "group": note.group.model_dump(mode="json"),
            "members": [member.model_dump(mode="json") for member in note.members],
            "status": note.status.value,
            # What this message is to the receiver (``firing`` the first time it hears of the
            # group): the group record's own transition may already be an update by then.
            "transition": note.step,
            "seq": note.seq,
            "idempotency_key": note.idempotency_key,
            "sent_at": note.sent_at,
        }
    )


class WebhookSink:
    type = "webhook"

    def __init__(
        self,
        config: Webhook,
        client: httpx.AsyncClient,
        timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = config.name
        self._config, self._client, self._timeout, self._clock = config, client, timeout, clock

    def __repr__(self) -> str:
        return f"WebhookSink(name={self.name!r}, url={self._config.url!r})"

    async def send(self, note: Notification) -> dict[str, str]:
        body = body_of(note)
        extra = {name: value for name, value in self._config.headers.items() if name.lower() not in OWN_HEADERS}
        headers = {**extra, "Content-Type": "application/json", "Idempotency-Key": note.idempotency_key}
        secrets = [value for name, value in extra.items() if _CREDENTIAL.search(name)]
        if self._config.secret is not None:
            # Signed at sending, not at planning: a retry hours later is still fresh to verify.
            timestamp = int(self._clock())
            headers[TIMESTAMP_HEADER] = str(timestamp)
            headers[SIGNATURE_HEADER] = sign(self._config.secret.get_secret_value().encode(), timestamp, body)
        url = self._config.url.get_secret_value()
        secrets.append(url)  # a receiver's URL may carry its credential anywhere, in its path too
        await post_hiding(self._client, url, content=body, headers=headers, timeout=self._timeout, secrets=secrets)
        return {}
