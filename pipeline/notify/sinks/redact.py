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
from urllib.parse import parse_qsl, quote, urlsplit

import httpx

from servewatch.pipeline.notify.sinks.base import NotifyError, RejectedError, RetryableError, post

REDACTED = "[redacted]"
#: Shorter query values are not taken for credentials (tokens are longer than this).
MIN_SECRET_CHARS = 8
#: A path segment this long is taken for a credential even without digits.
MIN_TOKEN_SEGMENT_CHARS = 24


def hide(text: str, secrets: Iterable[str]) -> str:
    # Longest first: a URL that is a secret contains its query string, which is one too.
    for secret in sorted(secrets, key=len, reverse=True):
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


def url_secrets(url: str) -> list[str]:
    """What in a receiver's URL may be a credential: its query string (``?token=...``), each
    query value long enough to be one, its user info's password, each path segment that looks
    like a token (``/services/T0A1/B0C2/x9Y8z7...`` of a Slack webhook, a relay's
    ``/hook/<token>``), and these as a receiver that quotes them back would encode them.

    >>> url_secrets("https://user:pa55w0rd@hooks.example.com/in?token=T0K3N-L0NG&x=1")
    ['token=T0K3N-L0NG&x=1', 'T0K3N-L0NG', 'pa55w0rd', 'token%3DT0K3N-L0NG%26x%3D1']
    >>> url_secrets("https://hooks.example.com/services/T0A1B2C3D/B0C2D3E4F/x9Y8z7W6v5U4t3S2")
    ['T0A1B2C3D', 'B0C2D3E4F', 'x9Y8z7W6v5U4t3S2']
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # malformed (``http://[::1/x``): the request fails to build; hide all of it
        return [url]
    found = [parts.query] if parts.query else []
    # A short value (``x=1``) is no credential, and hiding it would cut every "1" from the text.
    found += [value for _, value in parse_qsl(parts.query) if len(value) >= MIN_SECRET_CHARS]
    found += [segment for segment in parts.path.split("/") if _looks_like_token(segment)]
    if parts.password:
        found.append(parts.password)
    return found + [quote(secret, safe="") for secret in found if quote(secret, safe="") != secret]


def _looks_like_token(segment: str) -> bool:
    """A path segment long enough to be a credential that mixes digits in (``services``,
    ``enqueue`` or ``chat.postMessage`` are words: hiding them would garble every message), or
    longer than the words of any API's path."""
    if len(segment) >= MIN_TOKEN_SEGMENT_CHARS:
        return True
    return len(segment) >= MIN_SECRET_CHARS and any(c.isdigit() for c in segment) and any(c.isalpha() for c in segment)


async def post_hiding(
    client: httpx.AsyncClient,
    url: str,
    *,
    content: bytes,
    headers: dict[str, str],
    timeout: float,
    secrets: Iterable[str],
) -> httpx.Response:
    """``base.post``, its failures redacted of ``secrets`` and of what in ``url`` may be one."""
    secrets = [*secrets, *url_secrets(url)]
    try:
        return await post(client, url, content=content, headers=headers, timeout=timeout)
    except NotifyError as exc:
        # Chained to the transport error (timeouts, refused connections), never to the
        # unredacted NotifyError: a logged traceback would print its message.
        raise redacted(exc, secrets) from exc.__cause__
