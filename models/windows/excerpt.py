"""Answer excerpts that may leave the worker: short, around what matters, and scrubbed.

An event's evidence may quote the answer a request got (e.g. the text around a leaked
``</think>``), never its prompt. Before a quote leaves the worker it is cut to a bounded
length and scrubbed: e-mail addresses, phone numbers, card-like and ID-like numbers, and
secrets (API keys, tokens, passwords in ``key=value`` form, long hex or base64 runs) are
replaced by a tag; control characters are dropped and markup that a chat sink would act on
(``<!channel>``, ``<@U123>``, ``@here``, HTML tags) is defused. Scrubbing runs on a margin
around the cut as well, so a secret straddling the cut is still caught whole.

>>> excerpt("ok </think> mail me at jane.doe@example.com, key sk-live-4f9a8b7c6d5e4f3a2b1c", "</think>", 60)
'ok ‹/think› mail me at [email], key [secret]'
>>> excerpt("x" * 500, None, 20)
'xxxxxxxxxxxxxxxxxxx…'
>>> scrub("call +1 (415) 555-0134 or card 4111 1111 1111 1111 <!channel>")
'call [phone] or card [card] ‹!channel›'
"""

from __future__ import annotations

import re
from collections.abc import Callable

#: Characters of raw text scrubbed on each side of the cut: longer than any secret it
#: recognises, so one that straddles the cut is replaced, not half-quoted.
_MARGIN = 256


def _keylike(match: re.Match[str]) -> str:
    """A long run is a key when it mixes digits and letters (a word, or "xxxx...", is not)."""
    run = match.group(0)
    digits = any(c.isdigit() for c in run)
    return "[secret]" if digits and any(c.isalpha() for c in run) else run


_RULES: tuple[tuple[re.Pattern[str], str | Callable[[re.Match[str]], str]], ...] = (
    # Secrets first: they may contain digits and "@" that later rules would split.
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)", re.S), "[secret]"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"), r"\1 [secret]"),
    (
        re.compile(r"(?i)\b(api[_-]?key|secret|token|passw(?:or)?d|pwd|auth)(\s*[:=]\s*)(\"[^\"]*\"|'[^']*'|\S+)"),
        r"\1\2[secret]",
    ),
    (re.compile(r"\b(?:sk|pk|rk)-[A-Za-z0-9_-]{16,}"), "[secret]"),  # OpenAI/Stripe-style keys
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), "[secret]"),  # AWS access key ids
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr|github_pat)_[A-Za-z0-9_]{20,}"), "[secret]"),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), "[secret]"),  # Slack tokens
    (re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"), "[secret]"),  # JWTs
    (re.compile(r"\b[A-Fa-f0-9]{32,}\b"), _keylike),  # hex keys and hashes
    (re.compile(r"\b[A-Za-z0-9+/_-]{32,}={0,2}"), _keylike),  # long base64 runs
    (re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"), "[email]"),
    (re.compile(r"\b(?:\d[ -]?){12,18}\d\b"), "[card]"),  # 13-19 digits, spaced or dashed
    (re.compile(r"\b\d{3}-\d{2}-\d{4}\b"), "[id]"),  # US SSN shape
    (re.compile(r"(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?)?\d{2,4}[ .-]\d{3,4}(?:[ .-]?\d{1,4})?\b"), "[phone]"),
    (re.compile(r"\b\d{9,}\b"), "[id]"),  # long digit runs: account, passport, national ids
)
#: Control characters (C0 and C1, DEL, bidi overrides, zero-width) except tab and newline.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
#: Mentions a chat sink would turn into a page of its own.
_MENTIONS = re.compile(r"@(?=(?:here|channel|everyone))", re.I)


def scrub(text: str) -> str:
    """``text`` with personal data and secrets replaced by tags, and defused for sinks."""
    text = _CONTROL.sub("", text)
    for pattern, replacement in _RULES:
        text = pattern.sub(replacement, text)
    # Angle brackets carry HTML and Slack's <!channel>/<@user>/<url|label>: show, never act.
    text = text.replace("<", "‹").replace(">", "›").replace("&", "＆")
    text = _MENTIONS.sub("@\u2024", text)  # "@․here": readable, not a mention
    return re.sub(r"[ \t\r\n]+", " ", text).strip()


def excerpt(text: str | None, marker: str | None = None, limit: int = 200) -> str | None:
    """At most ``limit`` characters of ``text``, scrubbed: around the first ``marker`` when it
    is there, else from the start; "…" marks a cut. None for no text (or only blanks and
    control characters) or ``limit`` 0.
    """
    if not text or limit <= 0:
        return None
    at = text.find(marker) if marker else -1
    # Centre the raw window on the marker (a third before it: what led up to it matters
    # less than what followed), with a scrubbing margin on both sides.
    lead = limit // 3 if at >= 0 else 0
    start = max((at if at >= 0 else 0) - lead, 0)
    raw = text[max(start - _MARGIN, 0) : start + limit + _MARGIN]
    clean = scrub(raw)
    if at >= 0 and marker is not None:
        pivot = clean.find(scrub(marker))
        begin = max(pivot - lead, 0) if pivot >= 0 else 0
    else:
        begin = 0 if start == 0 else min(_MARGIN, len(clean))
    cut_before, body = begin > 0 or start > _MARGIN, clean[begin:]
    room = limit - (1 if cut_before else 0)
    cut_after = len(body) > room or start + limit + _MARGIN < len(text)
    if cut_after:
        body = body[: max(room - 1, 0)].rstrip()
    out = ("…" if cut_before else "") + body + ("…" if cut_after else "")
    return out[:limit] if body else None
