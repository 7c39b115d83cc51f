"""Keep a sink's secrets out of what its failures say.

A failed delivery's message is logged and written to the deliveries topic (``Delivery.detail``).
Some receivers quote the request back when they refuse it (a PagerDuty routing key in the
body, a webhook URL in a proxy's error page), so a sink's secrets are cut from every
message and answer before the error leaves the sink.

>>> hide("invalid routing_key R0UT1NG", ["R0UT1NG", ""])
'invalid routing_key [redacted]'
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx

from servewatch.pipeline.notify.sinks.base import NotifyError, RejectedError, RetryableError, post

REDACTED = "[redacted]"


def hide(text: str, secrets: Iterable[str]) -> str:
    for secret in secrets:
        if secret:  # an empty secret would "match" between every two characters
            text = text.replace(secret, REDACTED)
    return text


def redacted(exc: NotifyError, secrets: Iterable[str]) -> NotifyError:
    """The same failure (type, status, Retry-After), with ``secrets`` cut from what it says."""
    secrets = list(secrets)
    message = hide(str(exc), secrets)
    if isinstance(exc, RejectedError):
        return RejectedError(message, exc.status_code, hide(exc.answer, secrets))
    if isinstance(exc, RetryableError):
        return RetryableError(message, exc.retry_after)
    return NotifyError(message)


async def post_hiding(
    client: httpx.AsyncClient,
    url: str,
    *,
    content: bytes,
    headers: dict[str, str],
    timeout: float,
    secrets: Iterable[str],
) -> httpx.Response:
    """``base.post``, its failures redacted."""
    try:
        return await post(client, url, content=content, headers=headers, timeout=timeout)
    except NotifyError as exc:
        # Chained to the transport error (timeouts, refused connections), never to the
        # unredacted NotifyError: a logged traceback would print its message.
        raise redacted(exc, secrets) from exc.__cause__
