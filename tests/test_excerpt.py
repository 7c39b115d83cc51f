"""Answer excerpts leave the worker bounded and scrubbed (privacy by default)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servewatch.models.windows.batch import evidence_from_row
from servewatch.models.windows.excerpt import excerpt, scrub

SECRETS = [
    "sk-proj-Zx8fK2mQ9vT4wR7yL1nB6cD3",
    "AKIAIOSFODNN7EXAMPLE",
    "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
    "xoxb-123456789012-abcdefABCDEF",
    "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "dGhpcyBpcyBhIHNlY3JldCBrZXkgMTIzNDU2Nzg5MA==",
]
PERSONAL = ["jane.doe+llm@example.co.uk", "+44 20 7946 0958", "(415) 555-0134", "4111-1111-1111-1111",
            "5500 0000 0000 0004", "078-05-1120", "123456789012"]  # fmt: skip


@pytest.mark.parametrize("secret", SECRETS)
def test_secrets_are_replaced_whole(secret: str) -> None:
    out = scrub(f"here it is: {secret} (do not share)")
    assert secret not in out and "[secret]" in out and out.endswith("(do not share)")


@pytest.mark.parametrize("value", PERSONAL)
def test_personal_data_is_replaced(value: str) -> None:
    out = scrub(f"contact {value} today")
    assert value not in out and re.search(r"\[(email|phone|card|id)\]", out), out


@pytest.mark.parametrize(
    ("text", "gone"),
    [
        ("password = 'hunter2!' ok", "hunter2"),
        ('api_key: "abc123def"', "abc123def"),
        ("Authorization: Bearer abc.def-ghi_jkl", "abc.def-ghi_jkl"),
        ("-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----", "MIIEow"),
    ],
)
def test_credentials_in_context_are_replaced(text: str, gone: str) -> None:
    assert gone not in scrub(text)


def test_markup_and_control_characters_are_defused() -> None:
    out = scrub("<!channel> <@U024BE7LH> <https://evil.example|click> <script>alert(1)</script> @here \x07\u202e")
    assert not set(out) & set("<>&\x07\u202e")
    assert "@here" not in out and "‹!channel›" in out
    assert scrub("a\u200bb\x00c\td\ne") == "abc d e"


def test_ordinary_text_and_numbers_survive() -> None:
    text = "The answer is 42; TTFT was 0.8 s over 1,200 tokens in 2026."
    assert scrub(text) == text
    assert scrub("x" * 60) == "x" * 60 and scrub("internationalization" * 3) == "internationalization" * 3


def test_an_excerpt_is_centred_on_the_leaked_marker_and_bounded() -> None:
    text = "a" * 1000 + " the plan is done </think> Final answer: 12 apples " + "b" * 1000
    out = excerpt(text, "</think>", 80)
    assert out is not None and len(out) <= 80 and out.startswith("…") and out.endswith("…")
    assert "‹/think› Final answer" in out
    assert excerpt("short answer", None, 200) == "short answer"
    assert excerpt("anything", None, 0) is None and excerpt(None, None, 200) is None and excerpt("  ", None, 9) is None


def test_a_secret_straddling_the_cut_is_not_half_quoted() -> None:
    secret = SECRETS[0]
    for shift in range(0, 40, 3):  # the cut falls inside the key at some shift
        out = excerpt("w" * (60 - shift) + " " + secret + " tail", None, 64)
        assert out is not None and not any(secret[i : i + 8] in out for i in range(len(secret) - 8))


def test_evidence_carries_an_excerpt_only_when_asked() -> None:
    row = {"request_id": "r1", "timestamp": 1.0, "model": "m", "prompt_tokens": 10, "completion_tokens": 5,
           "e2e_s": 1.0, "finish_reason": "stop", "content": "</think>Paris. Mail bob@example.com"}  # fmt: skip
    assert "content_excerpt" not in evidence_from_row(row)
    record = evidence_from_row(row, 200, ("</think>",))
    assert record["content_excerpt"] == "‹/think›Paris. Mail [email]"
    empty = evidence_from_row({**row, "content": "", "reasoning_content": "thinking about 4111 1111 1111 1111"}, 200)
    assert empty["reasoning_excerpt"] == "thinking about [card]" and "content_excerpt" not in empty
    assert not {"prompt", "messages"} & set(record)


#: Pieces that break naive quoting: markup, mentions, escapes, bidi overrides, markers.
NASTY = ["<", ">", "&", "@here", "<!channel>", "\x1b[31m", "\u202e", "\n", " ", "x" * 50, "</think>",
         "1234 5678 9012 3456", "<script>", "`", "*", "_"]  # fmt: skip
hostile = st.text(st.characters(codec="utf-8"), max_size=3000) | st.lists(st.sampled_from(NASTY), max_size=200).map(
    "".join
)


@settings(max_examples=300, deadline=None)
@given(prefix=hostile, secret=st.sampled_from(SECRETS + PERSONAL), suffix=hostile, limit=st.integers(1, 400))
def test_every_excerpt_is_bounded_scrubbed_and_defused(prefix: str, secret: str, suffix: str, limit: int) -> None:
    text = f"{prefix} {secret} {suffix}"
    for marker in (None, "</think>"):
        out = excerpt(text, marker, limit)
        if out is None:  # nothing left that fits (a limit of a character or two)
            assert limit < 8
            continue
        assert len(out) <= limit
        assert not set(out) & set("<>&")
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]", out)
        assert "@here" not in out.lower() and "@channel" not in out.lower()
        assert secret not in out
