"""Who may read the triage page and give verdicts, and proof that a verdict was meant.

The page shows request excerpts and takes verdicts that change what pages, so it is served
on the loopback interface unless a token is set; with one, every page and API call needs it:
``Authorization: Bearer <token>``, Basic auth with the token as password (the user name
then signs verdicts), or a session cookie from posting the token to ``/login``
(HttpOnly, SameSite=Strict, signed with a per-process secret, 12 h). Tokens are compared
in constant time. A verdict (any POST) also needs a CSRF token, always, even on loopback
(another site's page could otherwise post from the on-call's browser): an HMAC of the
session id under the same secret, read from the page's ``<meta name="csrf-token">`` and sent
back in ``X-CSRF-Token``; a foreign ``Origin`` is refused too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlencode

from aiohttp import web

SESSION_COOKIE = "servewatch_session"
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

    def csrf_token(self, request: web.Request) -> str:
        session = self.session(request)
        return self._sign("csrf", session[0] if session else "anonymous")

    def csrf_ok(self, request: web.Request, given: str | None) -> bool:
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            return False
        return given is not None and hmac.compare_digest(given.encode(), self.csrf_token(request).encode())

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
