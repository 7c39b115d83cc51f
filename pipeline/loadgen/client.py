"""One streamed request to an OpenAI-compatible server, measured as a client sees it, and
logged as a ``RequestLog`` so that servewatch can watch a load test like production.

TTFT is the time to the first chunk with text (a role-only first chunk is not a token; a
reasoning model's thinking is, as it is generated like any other); the gaps between later
text chunks are the inter-token latencies (a chunk may carry more than one token on servers
that batch their stream). Output tokens come from the final ``usage`` chunk (asked for with
``stream_options.include_usage``), else are counted as chunks. A refused request (non-2xx),
a broken connection or a malformed stream is logged with ``finish_reason="error"`` and the
status and reason: never raised.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx
import orjson

from servewatch.models.workload.sample import RequestSpec
from servewatch.schemas.request_log import FinishReason, RequestLog

logger = logging.getLogger(__name__)

#: ``tenant`` of every request log loadgen writes, to tell a test's traffic from real traffic.
TENANT = "loadgen"
_ERROR_CHARS = 500


@dataclass(frozen=True)
class Target:
    """Where requests go: the API base (``http://host:8000/v1``) and the model name sent."""

    base_url: str
    model: str
    api: Literal["chat", "completions"] = "chat"
    api_key: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ("/chat/completions" if self.api == "chat" else "/completions")

    @property
    def instance(self) -> str:
        parts = urlsplit(self.base_url)
        return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


@dataclass(frozen=True)
class Outcome:
    """A finished request: its log line and the inter-token gaps the client saw (seconds)."""

    log: RequestLog
    gaps: list[float]


def request_body(target: Target, spec: RequestSpec, prompt: str) -> dict[str, Any]:
    """The streamed request for ``spec``.

    It asks for at least the target length (``min_tokens``, which vLLM and SGLang accept) and
    at most that (``length`` requests) or one token more (``stop`` requests, which may end
    there of their own accord). A real model goes on past ``min_tokens`` and mostly ends at
    the limit, so only the lengths, which are what loads a server, are reproduced there; the
    dev server stops at ``min_tokens`` and reproduces the finish reasons as well.
    """
    limit = spec.output_tokens + (spec.finish == "stop")
    body: dict[str, Any] = {"model": target.model, "stream": True, "stream_options": {"include_usage": True},
                            "max_tokens": limit, "min_tokens": spec.output_tokens}  # fmt: skip
    if target.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


@dataclass
class _Stream:
    """What the stream said so far (``time.perf_counter`` times)."""

    started: float
    first: float | None = None
    last: float | None = None
    events: int = 0
    chunks: int = 0
    gaps: list[float] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None

    def read(self, event: dict[str, Any], chat: bool) -> None:
        self.events += 1
        if isinstance(event.get("error"), dict | str):
            self.error = f"error in stream: {str(event['error'])[:_ERROR_CHARS]}"
            return
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if _text(choice, chat):
                now = time.perf_counter()
                if self.last is not None:
                    self.gaps.append(now - self.last)
                self.first = self.first if self.first is not None else now
                self.last, self.chunks = now, self.chunks + 1
            self.finish = choice.get("finish_reason") or self.finish


def _text(choice: dict[str, Any], chat: bool) -> str | None:
    """A choice's new text; a reasoning model's thinking (``reasoning_content`` in vLLM,
    ``reasoning`` elsewhere) counts, as it is generated like any token."""
    if not chat:
        return choice.get("text")
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")


async def send(
    client: httpx.AsyncClient, target: Target, spec: RequestSpec, prompt: str, request_id: str, prefix_hash: str | None
) -> Outcome:
    """Send one request, stream its answer, and log it (never raises on the server's account)."""
    body = request_body(target, spec, prompt)
    headers = {"X-Request-Id": request_id, "Accept": "text/event-stream"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    wall, status = time.time(), None
    stream = _Stream(started=time.perf_counter())
    try:
        async with client.stream("POST", target.url, json=body, headers=headers) as response:
            status = response.status_code
            if not 200 <= status < 300:
                text = (await response.aread()).decode("utf-8", "replace")
                stream.error = f"HTTP {status}: {text.strip()[:_ERROR_CHARS]}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    stream.read(orjson.loads(data), chat=target.api == "chat")
                    if stream.error:
                        break
                if not stream.events and not stream.error:
                    stream.error = "the answer was not an event stream (no data: lines)"
    except (httpx.HTTPError, OSError, orjson.JSONDecodeError) as exc:
        stream.error = f"{type(exc).__name__}: {str(exc)[:_ERROR_CHARS]}"
    e2e = time.perf_counter() - stream.started
    log = _log(target, spec, stream, status, request_id, prefix_hash, wall + e2e, e2e, body["max_tokens"])
    if stream.error:
        logger.debug("%s failed: %s", request_id, stream.error)
    return Outcome(log, stream.gaps)


def _reason(finish: str | None) -> FinishReason:
    """A stream that ended without a finish reason, or with one of its own, is ``other``."""
    known = FinishReason._value2member_map_.get(str(finish).lower())
    return known if isinstance(known, FinishReason) else FinishReason.OTHER


def _log(
    target: Target,
    spec: RequestSpec,
    stream: _Stream,
    status: int | None,
    request_id: str,
    prefix_hash: str | None,
    finished: float,
    e2e: float,
    max_tokens: int,
) -> RequestLog:
    usage = stream.usage or {}
    prompt_tokens = int(usage.get("prompt_tokens") or spec.prompt_tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return RequestLog(
        request_id=request_id,
        timestamp=finished,
        model=target.model,
        prompt_tokens=prompt_tokens,
        completion_tokens=int(usage.get("completion_tokens") or stream.chunks),
        e2e_s=e2e,
        finish_reason=FinishReason.ERROR if stream.error else _reason(stream.finish),
        ttft_s=None if stream.first is None else min(stream.first - stream.started, e2e),
        decode_s=None if stream.first is None or stream.last is None else stream.last - stream.first,
        cached_tokens=min(int(cached), prompt_tokens) if isinstance(cached, int) else None,
        max_tokens=max_tokens,
        status_code=status if status is not None and 100 <= status <= 599 else None,
        error=stream.error,
        route=spec.route,
        tenant=TENANT,
        instance=target.instance,
        prefix_hash=prefix_hash,
    )
