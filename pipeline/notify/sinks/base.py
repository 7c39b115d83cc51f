"""What every sink is, the exceptions they raise, and the one HTTP call they share.

A sink's ``send`` either returns (the receiver accepted; the returned memo is kept for the
group's next notification) or raises:

- ``RetryableError``: try again later (429, 5xx, timeouts, refused connections), honouring
  ``retry_after`` when the receiver gave one;
- ``RejectedError``: the receiver refused this payload for good (4xx other than 429), or
  no request can be built to it (a URL that does not parse); retrying cannot help, so it
  is dead-lettered with the receiver's answer or the reason.
"""

from __future__ import annotations

import email.utils
import time
from typing import Protocol

import httpx

from servewatch.pipeline.notify.notification import Notification

_ANSWER_CHARS = 500  # enough of a receiver's error body to say why, never a whole page


class NotifyError(Exception):
    """A notification could not be delivered."""


class RetryableError(NotifyError):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RejectedError(NotifyError):
    def __init__(self, message: str, status_code: int | None = None, answer: str = "") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.answer = answer


class Sink(Protocol):
    name: str
    type: str

    async def send(self, note: Notification) -> dict[str, str]:
        """Deliver ``note``; return what to remember for this group's next notification."""
        ...


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` as seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3).

    >>> retry_after_s("7"), retry_after_s(None), retry_after_s("soon")
    (7.0, None, None)
    >>> retry_after_s("Thu, 01 Jan 1970 00:01:00 GMT", now=30.0)
    30.0
    """
    if value is None:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def build_post(
    client: httpx.AsyncClient, url: str, *, content: bytes, headers: dict[str, str], timeout: float
) -> httpx.Request:
    """The POST request, or ``RejectedError``: a URL or a header value it cannot be built from
    (a malformed host, a character a header cannot carry) fails alike on every attempt."""
    try:
        return client.build_request("POST", url, content=content, headers=headers, timeout=timeout)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:  # UnicodeEncodeError is a ValueError
        raise RejectedError(f"cannot build the request ({type(exc).__name__}: {exc})") from exc


async def post(
    client: httpx.AsyncClient, url: str, *, content: bytes, headers: dict[str, str], timeout: float
) -> httpx.Response:
    """POST and sort the outcome into accepted (returned), retryable or rejected (raised)."""
    request = build_post(client, url, content=content, headers=headers, timeout=timeout)
    try:
        response = await client.send(request)
    except httpx.TimeoutException as exc:
        raise RetryableError(f"timed out after {timeout:g} s ({type(exc).__name__})") from exc
    except (httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:  # our request, not the network
        raise RejectedError(f"cannot send the request ({type(exc).__name__}: {exc})") from exc
    except httpx.TransportError as exc:
        raise RetryableError(f"could not reach the receiver ({type(exc).__name__}: {exc})") from exc
    if response.is_success:
        return response
    answer = response.text[:_ANSWER_CHARS]
    if response.status_code == 429 or response.status_code >= 500:
        raise RetryableError(
            f"HTTP {response.status_code}: {answer}", retry_after_s(response.headers.get("retry-after"))
        )
    raise RejectedError(f"HTTP {response.status_code}: {answer}", response.status_code, answer)
