"""Slack Block Kit, typed and held to Slack's documented limits, and text made safe for it.

Slack rejects a whole message when one block breaks a limit (``invalid_blocks``), and a
rejected page is a page nobody sees. So the models below raise on any breach, and the
builders (``plain``, ``mrkdwn``, ``message``) cut text to fit, with an ellipsis, so that a
message built through them is always one Slack takes.

Text from requests and events (summaries, hints, labels, excerpts) is untrusted: a prompt
can make a model answer ``<!channel>``. ``escape_mrkdwn`` makes such text show as written
and never act as markup, a link or a mention.

>>> escape_mrkdwn("<!channel> *now* req_42 <https://evil|click>")
'&lt;!channel&gt; ∗now∗ req_42 &lt;https://evil|click&gt;'
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servewatch.pipeline.notify.sinks.content import clip

# Slack's documented limits (api.slack.com/reference/block-kit).
MAX_BLOCKS = 50  # per message
TEXT_CHARS = 3000  # a section's or a context element's text object
FIELD_CHARS = 2000  # each of a section's fields
MAX_FIELDS = 10
HEADER_CHARS = 150  # plain_text only
BUTTON_CHARS = 75
URL_CHARS = 3000
MAX_CONTEXT_ELEMENTS = 10
MAX_BUTTONS = 25
#: The message's fallback ``text`` (notifications, screen readers): Slack advises under 4,000.
FALLBACK_CHARS = 4000

_ENTITIES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;"})
#: Control, zero-width and bidi-override characters: they hide or reorder what a person reads.
_INVISIBLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")
_MENTION = re.compile(r"@(?=(?:channel|here|everyone))", re.IGNORECASE)
_MARKUP = re.compile(r"[*_~`]")
# Look-alikes rather than zero-width spaces: Slack reads a zero-width space as a word break,
# which turns formatting *on* around the character it sits next to.
_LOOKALIKE = {"*": "\u2217", "_": "\u02cd", "~": "\u223c", "`": "\u02cb"}


def _word_char(text: str, at: int) -> bool:
    return 0 <= at < len(text) and text[at].isascii() and text[at].isalnum()


def _defuse(match: re.Match[str]) -> str:
    char, text, at = match.group(), match.string, match.start()
    # Inside a word (req_42, prompt_band) Slack formats nothing: keep what people copy
    # into a log search intact. A backtick can open code anywhere: always replaced.
    if char != "`" and _word_char(text, at - 1) and _word_char(text, at + 1):
        return char
    return _LOOKALIKE[char]


def escape_mrkdwn(text: str) -> str:
    """``text`` shown as written in any Slack text: ``&``, ``<`` and ``>`` as entities (which
    defuses ``<!channel>``, ``<@U123>`` and ``<url|label>``), ``@here``-style mentions
    broken, and formatting characters at word edges replaced by look-alikes."""
    text = _INVISIBLE.sub("", text).translate(_ENTITIES)
    text = _MENTION.sub("@\u200b", text)  # no formatting around an "@": a zero-width space is safe here
    return _MARKUP.sub(_defuse, text)


class _Strict(BaseModel):
    """Slack rejects unknown fields; a built block never changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Text(_Strict):
    type: Literal["plain_text", "mrkdwn"]
    text: str = Field(min_length=1, max_length=TEXT_CHARS)


def _plain_within(text: Text, limit: int, what: str) -> None:
    if text.type != "plain_text" or len(text.text) > limit:
        raise ValueError(f"a {what}'s text is plain_text of at most {limit} characters")


class Header(_Strict):
    type: Literal["header"] = "header"
    text: Text

    @model_validator(mode="after")
    def _limits(self) -> Header:
        _plain_within(self.text, HEADER_CHARS, "header")
        return self


class Section(_Strict):
    type: Literal["section"] = "section"
    text: Text | None = None
    fields: list[Text] | None = Field(default=None, min_length=1, max_length=MAX_FIELDS)

    @model_validator(mode="after")
    def _limits(self) -> Section:
        if self.text is None and not self.fields:
            raise ValueError("a section needs text or fields")
        if any(len(field.text) > FIELD_CHARS for field in self.fields or ()):
            raise ValueError(f"a section's fields hold at most {FIELD_CHARS} characters each")
        return self


class Context(_Strict):
    type: Literal["context"] = "context"
    elements: list[Text] = Field(min_length=1, max_length=MAX_CONTEXT_ELEMENTS)


class Button(_Strict):
    type: Literal["button"] = "button"
    text: Text
    url: str = Field(pattern=r"^https?://", max_length=URL_CHARS)
    action_id: str = Field(min_length=1, max_length=255)

    @model_validator(mode="after")
    def _limits(self) -> Button:
        _plain_within(self.text, BUTTON_CHARS, "button")
        return self


class Actions(_Strict):
    type: Literal["actions"] = "actions"
    elements: list[Button] = Field(min_length=1, max_length=MAX_BUTTONS)


class Divider(_Strict):
    type: Literal["divider"] = "divider"


Block = Annotated[Header | Section | Context | Actions | Divider, Field(discriminator="type")]


class Message(_Strict):
    """What ``chat.postMessage``, ``chat.update`` and incoming webhooks take (less the channel)."""

    text: str = Field(min_length=1, max_length=FALLBACK_CHARS)
    blocks: list[Block] = Field(max_length=MAX_BLOCKS)


def plain(text: str, limit: int = TEXT_CHARS) -> Text:
    """A plain_text object; ``text`` must be escaped already (Slack decodes entities in it too)."""
    return Text(type="plain_text", text=clip(text.strip() or "-", limit))


def mrkdwn(text: str, limit: int = TEXT_CHARS) -> Text:
    """A mrkdwn object; any untrusted part of ``text`` must have gone through ``escape_mrkdwn``."""
    return Text(type="mrkdwn", text=clip(text.strip() or "-", limit))


def message(fallback: str, blocks: list[Block]) -> Message:
    """A message of at most ``MAX_BLOCKS`` blocks: the first ones are kept, the most important."""
    return Message(text=clip(fallback.strip() or "-", FALLBACK_CHARS), blocks=blocks[:MAX_BLOCKS])
