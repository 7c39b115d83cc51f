"""A small OpenAI-compatible streaming server on loopback, to test ``servewatch loadgen``
without a GPU: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

It behaves like an inference engine where a load test can tell: a token is a
whitespace-separated word; prefill takes time per *uncached* prompt token, with an LRU
prefix cache of 16-token blocks keyed, like vLLM's, by a hash of the block and everything
before it (so only a repeated *leading* text hits); decoding takes ``itl_s`` per token, a
little longer for each other running stream; and only ``slots`` requests run at once, the
rest wait, so a concurrency ramp finds a knee at ``slots``. Answers stop at ``min_tokens``
(the vLLM/SGLang extension) with ``stop`` when that is below ``max_tokens``, else at
``max_tokens`` with ``length``. Streams carry a role chunk first, one token per chunk, then
a usage chunk when asked (``stream_options.include_usage``) with ``cached_tokens``.

It keeps its own account of each request (``served``: queue time, server-side TTFT from
arrival to the first token written) so a test can hold loadgen's client-side figures against
it; ``X-Request-Id`` names a request. ``error_rate`` answers that share of requests with 500,
and with ``api_key`` set a request without that bearer token gets 401.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from servewatch.pipeline.dev.loopback import LoopbackServer, serve_until_signalled

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    model: str = "servewatch-dev"
    slots: int = 4  # requests served at once; the others queue
    prefill_base_s: float = 0.002
    prefill_s_per_token: float = 1e-4  # per uncached prompt token
    itl_s: float = 0.002
    itl_growth: float = 0.05  # each other running stream makes a token this much slower
    block_tokens: int = 16
    cache_blocks: int = 8192
    natural_tokens: int = 16  # where an answer stops of its own accord without min_tokens
    error_rate: float = 0.0
    seed: int = 0
    api_key: str | None = None  # required as ``Authorization: Bearer`` when set (401 otherwise)


@dataclass(frozen=True)
class Served:
    """The server's account of one request (seconds from its arrival at the handler)."""

    request_id: str
    arrival: float  # unix seconds
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    queue_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


class PrefixCache:
    """An LRU of prompt blocks; a block's key covers every token before it, so a block hits
    only when the whole prompt up to its end was seen before.

    >>> cache = PrefixCache(block_tokens=2, capacity=100)
    >>> hit, keys = cache.match("a b c d e".split()); cache.insert(keys); hit
    0
    >>> cache.match("a b c d x y".split())[0], cache.match("z b c d".split())[0]
    (4, 0)
    """

    def __init__(self, block_tokens: int, capacity: int) -> None:
        self.block_tokens = block_tokens
        self.capacity = capacity
        self._blocks: OrderedDict[Hashable, None] = OrderedDict()

    def match(self, tokens: list[str]) -> tuple[int, list[Hashable]]:
        """Leading tokens already cached (at least one token is always computed), and the keys
        of every full block, to ``insert`` once the prompt is computed."""
        keys: list[Hashable] = []
        key: Hashable = None
        size = self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            key = hash((key, tuple(tokens[start : start + size])))
            keys.append(key)
        hits = 0
        for key in keys:
            if key not in self._blocks:
                break
            self._blocks.move_to_end(key)
            hits += 1
        return min(hits * size, max(len(tokens) - 1, 0)), keys

    def insert(self, keys: list[Hashable]) -> None:
        for key in keys:
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


def _prompt_words(body: dict[str, Any], chat: bool) -> list[str] | None:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # content parts: the text ones count
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(str(content or ""))
        return " ".join(parts).split()
    prompt = body.get("prompt")
    return prompt.split() if isinstance(prompt, str) else None


def _sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


@dataclass
class OpenAIServer(LoopbackServer):
    """The server on ``127.0.0.1:port`` (0: a free one); ``async with`` starts and stops it."""

    config: ServerConfig = field(default_factory=ServerConfig)
    port: int = 0
    log_path: Path | None = None
    served: list[Served] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cache = PrefixCache(self.config.block_tokens, self.config.cache_blocks)
        self._slots = asyncio.Semaphore(self.config.slots)
        self._random = random.Random(self.config.seed)
        self._active = 0
        self.listen_port = self.port

    @property
    def url(self) -> str:
        """The API base (``.../v1``), as a client's ``base_url`` takes it."""
        return f"{self.address}/v1"

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._text)
        app.router.add_get("/v1/models", self._models)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.config.model, "object": "model",
                                                               "owned_by": "servewatch"}]})  # fmt: skip

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _text(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    def _record(self, served: Served) -> None:
        self.served.append(served)
        if self.log_path is not None:
            with self.log_path.open("a", encoding="utf-8") as log:
                log.write(json.dumps(asdict(served)) + "\n")

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival, started = time.time(), time.perf_counter()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        if self.config.api_key and request.headers.get("Authorization") != f"Bearer {self.config.api_key}":
            self._record(Served(request_id, arrival, 401))
            return web.json_response({"error": {"message": "invalid API key", "type": "invalid_request_error"}},
                                     status=401)  # fmt: skip
        try:
            body = await request.json()
        except ValueError:
            body = None
        words = _prompt_words(body, chat) if isinstance(body, dict) else None
        if words is None or not isinstance(body, dict):
            self._record(Served(request_id, arrival, 400))
            return web.json_response({"error": {"message": "messages or prompt missing", "type": "invalid_request"}},
                                     status=400)  # fmt: skip
        if self._random.random() < self.config.error_rate:
            self._record(Served(request_id, arrival, 500, prompt_tokens=len(words)))
            return web.json_response({"error": {"message": "injected failure", "type": "server_error"}}, status=500)
        limit = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
        wanted = limit if body.get("ignore_eos") else int(body.get("min_tokens") or self.config.natural_tokens)
        count, finish = (wanted, "stop") if wanted < limit else (limit, "length")
        account = _Account(request_id, arrival, started, len(words), finish)
        if not body.get("stream"):
            parts = []
            async with contextlib.aclosing(self._tokens(words, count, account)) as tokens:
                async for token in tokens:
                    account.token()
                    parts.append(token)
            text = "".join(parts)
            self._record(account.served(200))
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            kind = "chat.completion" if chat else "text_completion"
            return web.json_response({"id": f"cmpl-{request_id}", "object": kind, "model": self.config.model,
                                      "choices": [choice], "usage": account.usage()})  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": f"cmpl-{request_id}", "object": kind, "created": int(arrival), "model": self.config.model}

        def chunk(text: str | None, reason: str | None = None) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
                return _sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]})
            return _sse({**head, "choices": [{"index": 0, "text": text or "", "finish_reason": reason}]})

        served = False
        try:
            if chat:
                await response.write(chunk(None))  # the role first, as engines do: not a token
            async with contextlib.aclosing(self._tokens(words, count, account)) as tokens:
                async for token in tokens:
                    account.stamp()  # before the write, which may wait on a slow reader
                    await response.write(chunk(token))
                    account.token()
            await response.write(chunk("", finish))
            if (body.get("stream_options") or {}).get("include_usage"):
                await response.write(_sse({**head, "choices": [], "usage": account.usage()}))
            # Logged before the stream ends: a client that has read "[DONE]" finds its request
            # in the log, however long this process then waits for the CPU.
            self._record(account.served(200))
            served = True
            await response.write(_sse("[DONE]"))
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError) as exc:  # the client left
            if not served:
                self._record(account.served(499, "abort"))
            if isinstance(exc, asyncio.CancelledError):
                raise
        return response

    async def _tokens(self, words: list[str], count: int, account: _Account) -> AsyncGenerator[str, None]:
        """Wait for a slot, prefill the uncached part of the prompt, then give ``count`` tokens
        at the decode pace (slower the more streams run)."""
        async with self._slots:
            account.queue_s = time.perf_counter() - account.started
            self._active += 1
            try:
                account.cached_tokens, keys = self.cache.match(words)
                uncached = len(words) - account.cached_tokens
                await asyncio.sleep(self.config.prefill_base_s + uncached * self.config.prefill_s_per_token)
                self.cache.insert(keys)
                for i in range(count):
                    if i:
                        await asyncio.sleep(self.config.itl_s * (1.0 + self.config.itl_growth * (self._active - 1)))
                    yield " tok"
            finally:
                self._active -= 1


@dataclass
class _Account:
    """What happened to one request so far (``started``: its ``time.perf_counter()`` on arrival)."""

    request_id: str
    arrival: float
    started: float
    prompt_tokens: int
    finish: str
    cached_tokens: int = 0
    sent: int = 0
    queue_s: float | None = None
    ttft_s: float | None = None

    def stamp(self) -> None:
        """A token is handed to the client's stream: the first one sets TTFT, on the server's
        clock as an engine's is (time spent in the write itself is the client's to see)."""
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started

    def token(self) -> None:
        """A token went out to the client."""
        self.stamp()
        self.sent += 1

    def usage(self) -> dict[str, Any]:
        total = self.prompt_tokens + self.sent
        details = {"cached_tokens": self.cached_tokens}
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.sent, "total_tokens": total,
                "prompt_tokens_details": details}  # fmt: skip

    def served(self, status: int, finish: str | None = None) -> Served:
        e2e = time.perf_counter() - self.started if status == 200 else None
        return Served(self.request_id, self.arrival, status, self.prompt_tokens, self.cached_tokens, self.sent,
                      finish or self.finish, self.queue_s, self.ttft_s, e2e)  # fmt: skip


def read_served(path: Path) -> list[Served]:
    """The requests a server (maybe in another process) logged to ``path``."""
    if not path.exists():
        return []
    return [Served(**json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    defaults = ServerConfig()
    parser = argparse.ArgumentParser(description="A small OpenAI-compatible streaming server (loopback).")
    parser.add_argument("--port", type=int, default=0, help="default: a free port")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--slots", type=int, default=defaults.slots, help="requests served at once")
    parser.add_argument("--prefill-s-per-token", type=float, default=defaults.prefill_s_per_token)
    parser.add_argument("--itl-s", type=float, default=defaults.itl_s, help="seconds per output token")
    parser.add_argument("--itl-growth", type=float, default=defaults.itl_growth)
    parser.add_argument("--error-rate", type=float, default=0.0, help="share of requests answered with 500")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None, help="require this bearer token")
    parser.add_argument("--log", type=Path, default=None, help="append each request's account here (JSON lines)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    config = ServerConfig(model=args.model, slots=args.slots, prefill_s_per_token=args.prefill_s_per_token,
                          itl_s=args.itl_s, itl_growth=args.itl_growth, error_rate=args.error_rate,
                          seed=args.seed, api_key=args.api_key)  # fmt: skip
    asyncio.run(serve_until_signalled(OpenAIServer(config, port=args.port, log_path=args.log), "openai server ready: "))
    return 0


if __name__ == "__main__":
    sys.exit(main())
