"""The triage page against DNS rebinding: only Host names of this server are answered, and a
CSRF token without a session is bound to its browser's own random client cookie."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from servewatch.pipeline.cli.main import main
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.web.auth import CLIENT_COOKIE, HostCheck, split_host
from servewatch.schemas.feedback import Feedback
from tests.conftest import MakeClient
from tests.test_web import csrf_of, filled

EVIL = "evil.example:8080"
VERDICT = "/api/groups/g-fire/feedback"
Browser = Callable[[], aiohttp.ClientSession]


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Independent HTTP clients, each with its own cookie jar (one per simulated browser)."""
    sessions: list[aiohttp.ClientSession] = []

    def make() -> aiohttp.ClientSession:
        sessions.append(aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)))
        return sessions[-1]

    yield make
    for session in sessions:
        await session.close()


async def page_csrf(session: aiohttp.ClientSession, client: TestClient, path: str = "/") -> str:
    async with session.get(client.make_url(path)) as page:
        match = re.search(r'<meta name="csrf-token" content="([0-9a-f]+)">', await page.text())
    assert match, "the page carries its CSRF token"
    return match.group(1)


def recorder() -> tuple[list[Feedback], Callable[[Feedback], Awaitable[None]]]:
    published: list[Feedback] = []

    async def publish(feedback: Feedback) -> None:
        published.append(feedback)

    return published, publish


# -- the Host check ---------------------------------------------------------------------------------


async def test_a_rebinding_host_is_refused_on_pages_api_stream_and_verdicts(make_client: MakeClient) -> None:
    published, publish = recorder()
    client = await make_client(filled(), publish_feedback=publish)
    for host in (EVIL, f"evil.example:{client.port}", "evil.example", f"localhost:{client.port + 1}", "", "a b"):
        for path in ("/", "/groups/g-fire", "/api/groups", "/api/csrf", "/api/stream", "/static/app.js", "/nope"):
            response = await client.get(path, headers={"Host": host})
            text = await response.text()
            assert response.status == 421, (host, path)
            assert response.content_type == "text/plain" and "\n" not in text.strip() and "Host" in text, text
            assert CLIENT_COOKIE not in response.headers.get("Set-Cookie", "")
    # a valid cookie and token do not help a page that reached the server under another name
    csrf = await csrf_of(client)
    body = {"verdict": "expected", "by": "mallory"}
    refused = await client.post(VERDICT, json=body, headers={"X-CSRF-Token": csrf, "Host": EVIL})
    assert refused.status == 421 and not published
    assert (await client.post(VERDICT, json=body, headers={"X-CSRF-Token": csrf})).status == 201


async def test_the_loopback_names_are_accepted_with_or_without_the_port(make_client: MakeClient) -> None:
    client = await make_client(filled())
    port = client.port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost", "127.0.0.1",
                 f"LocalHost:{port}", f"[0:0::1]:{port}"):  # fmt: skip
        assert (await client.get("/api/groups", headers={"Host": host})).status == 200, host
    stream = await client.get("/api/stream", headers={"Host": f"localhost:{port}"})
    assert stream.status == 200 and (await stream.content.readline()).startswith(b"retry:")
    stream.close()


async def test_a_configured_name_is_accepted_and_star_accepts_any(make_client: MakeClient) -> None:
    client = await make_client(filled(), hosts=HostCheck(["triage.example.com", "other.example:8443"], "127.0.0.1"))
    for host, status in (("triage.example.com", 200), ("Triage.Example.com:443", 200), ("other.example:8443", 200),
                         ("other.example:80", 421), ("other.example", 421), (EVIL, 421),
                         ("triage.example.com.evil.example", 421), (f"localhost:{client.port}", 200)):  # fmt: skip
        assert (await client.get("/", headers={"Host": host})).status == status, host
    anywhere = await make_client(filled(), hosts=HostCheck(["*"], "127.0.0.1"))
    assert (await anywhere.get("/api/groups", headers={"Host": EVIL})).status == 200


def test_every_interface_without_names_turns_the_check_off_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="servewatch.pipeline.web.auth"):
        open_check = HostCheck([], "0.0.0.0")
    [warning] = caplog.records
    assert warning.levelname == "WARNING" and "Host check is off" in warning.getMessage()
    assert open_check.allows(EVIL, ("10.0.0.5", 8088)) and open_check.allows(None, None)
    caplog.clear()
    named = HostCheck(["triage.example"], "::")
    assert not caplog.records
    assert named.allows("triage.example:8088", ("10.0.0.5", 8088)) and named.allows("10.0.0.5:8088", ("10.0.0.5", 8088))
    assert named.allows("localhost:8088", ("127.0.0.1", 8088)) and named.allows("[::1]:8088", ("::1", 8088))
    assert not named.allows("localhost:8088", ("10.0.0.5", 8088))  # not reached over loopback
    assert not named.allows(EVIL, ("127.0.0.1", 8080)) and not named.allows(None, ("127.0.0.1", 8088))
    by_name = HostCheck([], "triage.lan")
    assert by_name.allows("triage.lan:8088", ("10.0.0.5", 8088)) and not by_name.allows(EVIL, ("10.0.0.5", 8088))
    with pytest.raises(ValueError, match="allowed host"):
        HostCheck(["evil example"])
    assert split_host("[::ffff:127.0.0.1]:80") == ("127.0.0.1", 80) and split_host("x:99999") is None


async def test_refusals_are_logged_once_per_host_at_info(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client(filled())
    with caplog.at_level(logging.DEBUG, logger="servewatch.pipeline.web.auth"):
        for _ in range(3):
            assert (await client.get("/api/groups", headers={"Host": EVIL})).status == 421
    levels = [r.levelname for r in caplog.records if r.name == "servewatch.pipeline.web.auth"]
    assert levels == ["INFO", "DEBUG", "DEBUG"]


def test_allowed_hosts_setting_and_a_bad_one_stops_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SERVEWATCH_WEB_ALLOWED_HOSTS", "triage.example.com, other.example:8443")
    assert Settings().web.allowed_hosts == ("triage.example.com", "other.example:8443")
    monkeypatch.setenv("SERVEWATCH_WEB_ALLOWED_HOSTS", '["*"]')
    assert Settings().web.allowed_hosts == ("*",)
    monkeypatch.delenv("SERVEWATCH_WEB_TOKEN", raising=False)
    monkeypatch.setenv("SERVEWATCH_WEB_ALLOWED_HOSTS", "evil example")
    assert main(["web", "--broker", "127.0.0.1:9"]) == 2  # refused before any broker is asked
    assert "allowed host 'evil example'" in capsys.readouterr().err


# -- per-client CSRF tokens ---------------------------------------------------------------------------


async def test_two_clients_get_different_tokens_and_a_client_cookie(make_client: MakeClient, browser: Browser) -> None:
    client = await make_client(filled())
    first, second = browser(), browser()
    async with first.get(client.make_url("/")) as page:
        cookie = page.headers["Set-Cookie"]
    assert cookie.startswith(f"{CLIENT_COOKIE}=")
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and "path=/" in cookie.lower()
    token_a, token_b = await page_csrf(first, client), await page_csrf(second, client)
    assert token_a != token_b
    async with first.get(client.make_url("/api/csrf")) as answer:
        assert (await answer.json())["csrf"] == token_a  # the same client keeps its token
        assert "Set-Cookie" not in answer.headers  # it had its cookie: none new
    async with browser().get(client.make_url("/api/csrf")) as answer:
        assert CLIENT_COOKIE in answer.headers["Set-Cookie"]  # GET /api/csrf sets it too


async def test_a_token_is_good_only_with_its_own_clients_cookie(make_client: MakeClient, browser: Browser) -> None:
    published, publish = recorder()
    client = await make_client(filled(), publish_feedback=publish)
    alice, bob = browser(), browser()
    token_a = await page_csrf(alice, client)
    await page_csrf(bob, client)
    body = {"verdict": "expected", "by": "mallory"}
    async with bob.post(client.make_url(VERDICT), json=body, headers={"X-CSRF-Token": token_a}) as stolen:
        assert stolen.status == 403  # A's token with B's cookie
    # a token read without the cookie (a script ignoring it, or another site's page) is worth nothing
    cookieless = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
    try:
        async with cookieless.get(client.make_url("/api/csrf")) as answer:
            loose = (await answer.json())["csrf"]
        async with cookieless.post(client.make_url(VERDICT), json=body, headers={"X-CSRF-Token": loose}) as posted:
            assert posted.status == 403
    finally:
        await cookieless.close()
    assert not published
    own = {"verdict": "not_expected", "by": "alice"}
    async with alice.post(client.make_url(VERDICT), json=own, headers={"X-CSRF-Token": token_a}) as answer:
        assert answer.status == 201, await answer.text()
    assert [(f.verdict, f.by) for f in published] == [("not_expected", "alice")]
