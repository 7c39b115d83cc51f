"""Who may read the triage page and give verdicts, and proof that a verdict was meant.

The page shows request excerpts and takes verdicts that change what pages, so it is served
on the loopback interface unless a token is set; with one, every page and API call needs it:
``Authorization: Bearer <token>``, Basic auth with the token as password (the user name
then signs verdicts), or a session cookie from posting the token to ``/login``
(HttpOnly, SameSite=Strict, signed with a per-process secret, 12 h). Tokens are compared
in constant time. A verdict (any POST) also needs a CSRF token, always, even on loopback
(another site's page could otherwise post from the on-call's browser): an HMAC under the
same secret of the session id or, without a session, of a random per-client id the first page
or ``GET /api/csrf`` gives in an HttpOnly, SameSite=Strict cookie (so no two browsers share a
token, and a token read without that cookie is worth nothing), read from the page's
``<meta name="csrf-token">`` and sent back in ``X-CSRF-Token``; a foreign ``Origin`` is
refused too.

Every request must also name this server in its ``Host`` header (``HostCheck``): a page on
another site whose DNS name is re-pointed at 127.0.0.1 (DNS rebinding) is same-origin with
itself, not with us, so only its Host header gives it away; it gets 421.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from urllib.parse import urlencode

from aiohttp import hdrs, web

logger = logging.getLogger(__name__)

SESSION_COOKIE = "servewatch_session"
#: Without a session, the random id a browser's CSRF token is signed over.
CLIENT_COOKIE = "servewatch_client"
_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{16,64}")
#: Where a request keeps the client id minted for it, until ``client_cookie`` sends it.
_NEW_CLIENT = web.RequestKey("servewatch.new_client", str)
CSRF_HEADER = "X-CSRF-Token"
SESSION_S = 12 * 3600
#: Reachable without credentials: nothing here shows data.
PUBLIC = ("/healthz", "/login", "/static/", "/favicon.ico")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()


class Guard:
    """Authentication and CSRF checks of one web app (``token`` None: no authentication)."""

    def __init__(self, token: str | None, secret: bytes | None = None, now: Callable[[], float] = time.time) -> None:
        if token is not None and not token.strip():
            raise ValueError("an empty token would let anyone in")
        self.token = token
        self._secret = secret or secrets.token_bytes(32)
        self._now = now

    def _sign(self, purpose: str, text: str) -> str:
        return hmac.new(self._secret, f"{purpose}|{text}".encode(), hashlib.sha256).hexdigest()

    def token_matches(self, given: str) -> bool:
        return self.token is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def new_session(self, name: str) -> str:
        payload = f"{secrets.token_urlsafe(16)}.{_b64(name)}.{int(self._now())}"
        return f"{payload}.{self._sign('session', payload)}"

    def session(self, request: web.Request) -> tuple[str, str] | None:
        """(session id, name) of a valid, unexpired session cookie."""
        value = request.cookies.get(SESSION_COOKIE, "")
        payload, _, signature = value.rpartition(".")
        if not payload or not hmac.compare_digest(signature.encode(), self._sign("session", payload).encode()):
            return None
        sid, name, issued = payload.split(".")
        if not issued.isdigit() or self._now() - int(issued) > SESSION_S:
            return None
        return sid, _unb64(name)

    def authenticate(self, request: web.Request) -> tuple[bool, str | None]:
        """(allowed, the user's name if known)."""
        session = self.session(request)
        user = session[1] if session else None
        if self.token is None:
            return True, user
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.token_matches(credentials.strip()):
            return True, user
        if scheme.lower() == "basic":
            try:
                name, _, password = base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return False, None
            if self.token_matches(password):
                return True, name or user
            return False, None
        return session is not None, user

    def _csrf_subject(self, request: web.Request) -> str | None:
        """What the request's CSRF token is signed over: its session id, else its client id (None: neither)."""
        session = self.session(request)
        if session is not None:
            return session[0]
        client = client_id(request)
        return None if client is None else f"client:{client}"

    def csrf_token(self, request: web.Request) -> str:
        """The token a page or ``/api/csrf`` hands out."""
        subject = self._csrf_subject(request)
        if subject is None:  # a new client: its id goes out in a cookie with this answer (``client_cookie``)
            client = request[_NEW_CLIENT] = secrets.token_urlsafe(24)
            subject = f"client:{client}"
        return self._sign("csrf", subject)

    def csrf_ok(self, request: web.Request, given: str | None) -> bool:
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            return False
        subject = self._csrf_subject(request)  # no cookie: no token can be right
        if subject is None or given is None:
            return False
        return hmac.compare_digest(given.encode(), self._sign("csrf", subject).encode())

    def set_session(self, response: web.Response, request: web.Request, name: str) -> None:
        """Give the browser a session (after ``/login`` checked the token)."""
        response.set_cookie(SESSION_COOKIE, self.new_session(name), httponly=True, samesite="Strict", path="/",
                            max_age=SESSION_S, secure=request.secure)  # fmt: skip

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(PUBLIC):
            return await handler(request)
        allowed, _ = self.authenticate(request)
        if not allowed:
            if request.path.startswith("/api/") or request.path == "/openapi.json":
                raise web.HTTPUnauthorized(
                    text='{"error": "authentication required"}',
                    content_type="application/json",
                    headers={"WWW-Authenticate": 'Bearer realm="servewatch"'},
                )
            raise web.HTTPSeeOther("/login?" + urlencode({"next": request.path_qs}))
        return await handler(request)

    def user(self, request: web.Request) -> str | None:
        """Who the credentials say is asking (Basic auth's user, or the session's name), if anyone."""
        return self.authenticate(request)[1]


def client_id(request: web.Request) -> str | None:
    """The request's anonymous client id: the one minted for its answer, else its cookie's."""
    minted = request.get(_NEW_CLIENT)
    if minted is not None:
        return minted
    value = request.cookies.get(CLIENT_COOKIE, "")
    return value if _CLIENT_ID.fullmatch(value) else None


@web.middleware
async def client_cookie(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Send the client id a CSRF token in this answer was signed over. A middleware, not an
    ``on_response_prepare`` hook: aiohttp renders cookies into the headers before those run."""
    response = await handler(request)
    minted = request.get(_NEW_CLIENT)
    if minted is not None:
        # No max_age: it lasts as long as the browser's session, like the page holding the token.
        response.set_cookie(CLIENT_COOKIE, minted, httponly=True, samesite="Strict", path="/", secure=request.secure)
    return response


#: The Content-Security-Policy of every response: nothing but this origin, no inline script
#: or style, no framing; charts are inline SVG markup, which needs no exception.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")  # fmt: skip


async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the headers every answer carries, errors and static files too."""
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    if not request.path.startswith("/static/"):
        response.headers.setdefault("Cache-Control", "no-store")


def safe_next(path: str | None) -> str:
    """Where ``/login`` sends back to: a path of this site only (no ``//host`` or scheme).

    >>> safe_next("/groups/g1?x=1"), safe_next("//evil.example"), safe_next("https://evil.example")
    ('/groups/g1?x=1', '/', '/')
    """
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


# -- the Host check (DNS rebinding) ------------------------------------------------------------------

#: Names of the loopback interface a browser on this host may use.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
#: Refused Host values logged at info, each once; past this many, only at debug (no flood).
_LOGGED_REFUSALS = 100
HOST_REFUSED = "this server does not answer to that Host name (add it to SERVEWATCH_WEB_ALLOWED_HOSTS if it is yours)"


def _address_name(address: str) -> str:
    """An IP address as a Host header names it: IPv6 in brackets, IPv4-mapped IPv6 as IPv4."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address.lower()
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"[{ip.compressed}]" if ip.version == 6 else str(ip)


def _is_loopback(name: str) -> bool:
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None] | None:
    """A Host header (or an allowed-hosts entry) as (lower-case name, port or None); None if malformed.
    IP addresses come out in one spelling, so ``[0::1]`` is ``[::1]``.

    >>> split_host("LocalHost:8088"), split_host("[0::1]"), split_host("::1"), split_host("evil.example:x")
    (('localhost', 8088), ('[::1]', None), ('[::1]', None), None)
    """
    text = value.strip().lower()
    if text.count(":") > 1 and not text.startswith("["):
        text = f"[{text}]"  # a bare IPv6 address (only a configured entry would be written so)
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")) or not _is_ipv6(inside):
            return None
        name, port_text = _address_name(inside), (rest[1:] if rest else None)
    else:
        host, colon, port = text.partition(":")
        name, port_text = _address_name(host.rstrip(".")), (port if colon else None)
    if not _NAME.fullmatch(name) or not _port_ok(port_text):
        return None
    return name, None if port_text is None else int(port_text)


_NAME = re.compile(r"[a-z0-9_-][a-z0-9._-]*|\[[0-9a-f:.]+\]")


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _port_ok(text: str | None) -> bool:
    return text is None or (text.isascii() and text.isdigit() and 0 < int(text) < 65536)


def _is_wildcard(host: str) -> bool:
    try:
        return not host or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def local_address(request: web.Request) -> tuple[str, int] | None:
    """The address and port the request's connection came in on (None: not TCP, or gone)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if isinstance(sockname, tuple) and len(sockname) >= 2:
        return str(sockname[0]), int(sockname[1])
    return None


class HostCheck:
    """Which ``Host`` headers name this server, the defence against DNS rebinding.

    A page of evil.example whose DNS name is re-pointed at 127.0.0.1 can fetch our pages as its
    own origin, but its requests still say ``Host: evil.example``. Accepted: the address the
    connection came in on with the port it listens on (so ``bind_host`` need not be known), on
    loopback also ``localhost``, ``127.0.0.1`` and ``[::1]``, and ``bind_host`` itself when it
    is a name; each with or without the port. ``allowed`` adds names: ``name`` (any port),
    ``name:port``, or ``*`` (any Host: behind a proxy that checks it). Bound to every interface
    (0.0.0.0, ::) with nothing allowed, the server cannot know its names: any Host is taken,
    and a warning says so once.
    """

    def __init__(self, allowed: Iterable[str] = (), bind_host: str | None = None) -> None:
        entries = [entry.strip() for entry in allowed if entry.strip()]
        self._names: set[str] = set()
        self._pairs: set[tuple[str, int]] = set()
        for entry in entries:
            if entry == "*":
                continue
            parsed = split_host(entry)
            if parsed is None:
                raise ValueError(f"allowed host {entry!r} is not a host name or address, with or without :port")
            name, port = parsed
            if port is None:
                self._names.add(name)
            else:
                self._pairs.add((name, port))
        wildcard = bind_host is not None and _is_wildcard(bind_host)
        bound = split_host(bind_host) if bind_host and not wildcard else None
        self._bind_name = bound[0] if bound else None
        self.off = "*" in entries or (wildcard and not entries)
        self._refused: set[str] = set()
        if wildcard and not entries:
            logger.warning("listening on every interface (%s) with no SERVEWATCH_WEB_ALLOWED_HOSTS: the Host check "
                           "is off, so DNS-rebinding pages are not refused; set it to the names you reach the page "
                           "by", bind_host)  # fmt: skip

    def allows(self, host: str | None, local: tuple[str, int] | None) -> bool:
        """Whether ``host`` (the header; None: none sent) names this server, reached at ``local``."""
        if self.off:
            return True
        parsed = split_host(host) if host is not None else None
        if parsed is None:
            return False
        name, port = parsed
        if name in self._names or (port is not None and (name, port) in self._pairs):
            return True
        if local is None:
            return False
        address, local_port = local
        if port is not None and port != local_port:
            return False
        return name in self._local_names(address)

    def _local_names(self, address: str) -> set[str]:
        names = {_address_name(address)}
        if self._bind_name is not None:
            names.add(self._bind_name)
        if _is_loopback(_address_name(address)):
            names |= LOOPBACK_NAMES
        return names

    def _note_refusal(self, request: web.Request) -> None:
        host = request.headers.get(hdrs.HOST, "")[:100]
        first = host not in self._refused and len(self._refused) < _LOGGED_REFUSALS
        if first:
            self._refused.add(host)
        level = logging.INFO if first else logging.DEBUG  # each Host once at info: a rebinding page retries a lot
        logger.log(level, "refused %s %s for Host %r from %s: not a name of this server", request.method,
                   request.path[:200], host, request.remote)  # fmt: skip

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not self.allows(request.headers.get(hdrs.HOST), local_address(request)):
            self._note_refusal(request)
            raise web.HTTPMisdirectedRequest(text=HOST_REFUSED)
        return await handler(request)
