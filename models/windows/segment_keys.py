"""Segment keys: the labels that name a workload segment, as one string.

A key (``model=llama|route=chat|prompt_band=1k-8k``) names a segment in partials, state
and events; ``join_key`` writes one and ``parse_key`` reads it back, escaping ``|`` in a
label's value. Also the length bands' labels, and the keys of replica rows.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping, Sequence

DIMENSIONS = ("model", "route", "tenant", "instance", "engine", "prompt_band", "output_band")
#: The dimensions a request log names as fields (the bands come from its token counts).
LABEL_DIMENSIONS = DIMENSIONS[:5]
DEFAULT_DIMENSIONS = ("model", "route", "prompt_band", "output_band")
OVERFLOW_KEY = "model=other|segment=overflow"
UNSET = "-"
#: Keys of *replica rows*: a segment's requests of one serving instance, folded beside the
#: segment's own row so that stage 2 can compare an instance with its peers
#: (``models.detect.replicas``). ``parse_key`` reads their labels like a segment's.
REPLICA_PREFIX = "~replica|"


def is_replica_key(key: str) -> bool:
    return key.startswith(REPLICA_PREFIX)


def routing_key(key: str) -> str:
    """The key a partial travels under to stage 2 (its partials partition): its own for a
    segment; its model's for a replica row, so that one worker sees every replica of a model."""
    if key.startswith(REPLICA_PREFIX):
        return "~replicas|" + model_of(key)
    return key


def _short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def band_labels(edges: Sequence[int]) -> list[str]:
    """Human labels of the bands cut by ``edges``: ``<1k``, ``1k-8k``, ``>=8k``."""
    if not edges:
        return ["all"]
    labels = [f"<{_short(edges[0])}"]
    labels += [f"{_short(lo)}-{_short(hi)}" for lo, hi in itertools.pairwise(edges)]
    labels.append(f">={_short(edges[-1])}")
    return labels


def band_of(tokens: int, edges: Sequence[int], labels: Sequence[str]) -> str:
    for edge, label in zip(edges, labels, strict=False):
        if tokens < edge:
            return label
    return labels[-1]


def clean_label(label: str | None) -> str | None:
    """Labels compare without surrounding blanks (``" chat"`` is ``chat``)."""
    return label.strip() or None if label is not None else None


#: In a key's label value: ``|`` (it ends a label) as ``%7C``, and ``%`` as ``%25`` where it
#: would otherwise read as one of these two escapes. ``=`` needs none: a label's name never
#: holds one, so a label is split at its first. A value with neither ``|`` nor such a ``%``
#: is its own escape: those keys (and the detector states stored under them) never change.
_ESCAPED = re.compile(r"\||%(?=7C|25)")
_ESCAPES = re.compile(r"%(7C|25)")


def escape_label(value: str) -> str:
    """A label value as a segment key holds it (``unescape_label`` gives it back).

    >>> escape_label("org/llama=v2"), escape_label("a|b"), escape_label("100%"), escape_label("%7C")
    ('org/llama=v2', 'a%7Cb', '100%', '%257C')
    """
    if "|" not in value and "%" not in value:
        return value
    return _ESCAPED.sub(lambda m: "%7C" if m[0] == "|" else "%25", value)


def unescape_label(value: str) -> str:
    """A label value as it was before ``escape_label``.

    >>> [unescape_label(escape_label(v)) for v in ("a|b", "%7C", "%%257C|", "50%")]
    ['a|b', '%7C', '%%257C|', '50%']
    """
    if "%" not in value:
        return value
    return _ESCAPES.sub(lambda m: "|" if m[1] == "7C" else "%", value)


def join_key(labels: Mapping[str, str]) -> str:
    """The segment key of ``labels``, in their order (``parse_key`` reads it back).

    >>> join_key({"model": "org/llama=v2", "route": "a|b"})
    'model=org/llama=v2|route=a%7Cb'
    """
    return "|".join(f"{name}={escape_label(value)}" for name, value in labels.items())


@functools.lru_cache(maxsize=1 << 16)
def model_of(key: str) -> str:
    """The model label of a segment (or replica row) key: asked per row of every window
    closed, of the same few thousand keys."""
    return parse_key(key)["model"]


def parse_key(key: str) -> dict[str, str]:
    """Labels of a segment key (``model=a|route=b`` -> ``{"model": "a", "route": "b"}``), their
    values as the requests had them (what events and pages show).

    >>> parse_key("model=org/llama=v2|route=a%7Cb")
    {'model': 'org/llama=v2', 'route': 'a|b'}
    """
    labels = dict(part.split("=", 1) for part in key.split("|") if "=" in part)
    if "%" in key:  # only then can a value hold an escape: the common key costs no more
        labels = {name: unescape_label(value) for name, value in labels.items()}
    labels.setdefault("model", "other")
    return labels
