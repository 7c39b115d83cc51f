"""What ``servewatch ship`` makes of one logged request: a ``RequestLog`` row, or a ``Rejection``.

Pure functions, no I/O: the shipper calls an adapter per line (or per posted item), tests
call them with anything hypothesis can build, and none raises on bad input. Every row an
adapter returns has passed ``RequestLog``'s rules, so the worker accepts what the shipper
sends and a bad line is dead-lettered at its source, where its file position is known.

Formats (``adapter_for``):

- ``native``: a ``RequestLog`` JSON object (``servewatch schema RequestLog``); fields it
  does not know are dropped.
- ``openai``: ``{"response": <chat.completion or text_completion object>, "request": {<the
  request body>}, "timing": {...}, <labels>}``, what an OpenAI-compatible gateway logs per
  call. Read: ``usage.prompt_tokens``, ``usage.completion_tokens``,
  ``usage.prompt_tokens_details.cached_tokens``,
  ``usage.completion_tokens_details.reasoning_tokens``; ``choices[0].finish_reason``,
  ``choices[0].message.content`` (``choices[0].text`` on completions) and
  ``message.reasoning_content`` or ``message.reasoning`` (vLLM renamed the first to the
  second; both are read, the first wins); ``response.model`` (the served name; else
  ``request.model``); ``request.max_completion_tokens`` or ``request.max_tokens``;
  ``response.id`` as the request id unless the record has ``request_id``. The labels
  ``route``, ``tenant``, ``instance``, ``engine``, ``engine_version`` and ``status_code``
  are read from the record's top level. See ``TIMING`` for the timing layout; phases it
  lacks come from vLLM's per-request ``response.metrics`` where present. An error
  response (``response.error``, or ``response.object == "error"``) becomes
  ``finish_reason="error"`` (``"other"`` for a 4xx status: the client's fault is not the
  server's error rate) with its message, and 0 tokens where usage is missing.
- ``mapping``: ``FieldMapping``: each ``RequestLog`` field read from a path in any other
  JSON layout (e.g. an Elasticsearch/Kibana export), with unit scales and value maps.

``auto`` (the default) takes ``openai`` for objects with a ``response`` object, else ``native``.

Prompts: a record may carry its prompt (``prompt``, or chat ``messages``; in ``openai`` in
the request). Its leading ``prefix_chars`` characters, as text, become ``prefix_hash``
(sha256 of the model name and that text, 16 hex digits), which is what the worker's
prefix-reuse test needs; the prompt itself is dropped unless ``keep_prompt``
(then ``prompt``/``messages`` travel as logged; the worker ignores them). A record's own
``prefix_hash`` wins. The model is part of the hash because a prefix cache is per model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeGuard, cast

import msgspec
from pydantic import ValidationError

from servewatch.pipeline.messages.dead_letters import summarise_validation_error
from servewatch.pipeline.messages.fast_rows import FastRow
from servewatch.schemas.request_log import Engine, RequestLog

#: Leading characters of the prompt that identify its prefix (0: no hashing).
PREFIX_CHARS: Final = 2000
PREFIX_HASH_HEX: Final = 16
#: Label fields a record may lack and ``AdaptOptions.defaults`` may fill.
LABELS: Final = ("route", "tenant", "instance", "engine", "engine_version")
FIELDS: Final = frozenset(RequestLog.model_fields) - {"schema_version"}
REQUIRED: Final = tuple(name for name, info in RequestLog.model_fields.items() if info.is_required())
PROMPT_FIELDS: Final = ("prompt", "messages")
FORMATS: Final = ("auto", "native", "openai", "mapping")

#: The ``timing`` object of the ``openai`` format. Durations in seconds (``<name>_s``) or
#: milliseconds (``<name>_ms``); instants in unix seconds or ISO-8601 (no zone: UTC).
TIMING: Final = {
    "end": "when the last token was sent (alias finished_at): the record's timestamp",
    "start": "when the request arrived (alias started_at); timestamp = start + e2e when end is missing, "
    "then response.created + e2e",
    "e2e_s": "arrival to last token; else end - start",
    "ttft_s": "arrival to first token",
    "queue_s": "waiting for a slot",
    "prefill_s": "scheduled to first token",
    "decode_s": "first to last token",
}


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a record was not shipped: ``reason`` is a short code, ``error`` says what to fix.

    Reasons: ``not_an_object``, ``layout`` (not the format's shape), ``missing_field``,
    ``validation`` (``RequestLog`` refused the result), ``internal_error`` (a bug here).
    """

    reason: str
    error: str


@dataclass(frozen=True)
class AdaptOptions:
    """What every adapter does beyond its format: prompt handling and label defaults."""

    keep_prompt: bool = False
    prefix_chars: int = PREFIX_CHARS
    defaults: Mapping[str, str] = field(default_factory=dict)
    # A dotted path in each record whose value names the replica (``pod``,
    # ``kubernetes.node_name``): shipped as ``instance``, which the worker compares replicas
    # by. Where a record has nothing there, its own ``instance`` (or the default) stays.
    instance_from: str = ""

    def __post_init__(self) -> None:
        if self.prefix_chars < 0:
            raise ValueError("prefix_chars must be >= 0")
        if self.instance_from and not all(self.instance_from.split(".")):
            raise ValueError(f"instance_from {self.instance_from!r}: a dotted path such as pod or kubernetes.pod_name")
        for name, value in self.defaults.items():
            if name not in LABELS:
                raise ValueError(f"default {name!r} is not a label; choose from {', '.join(LABELS)}")
            if not isinstance(value, str) or not 1 <= len(value) <= 256:
                raise ValueError(f"default {name}: 1 to 256 characters")
            if name == "engine" and value not in Engine._value2member_map_:
                raise ValueError(f"default engine must be one of {', '.join(e.value for e in Engine)}")


Row = dict[str, Any]
Adapted = Row | Rejection
Adapter = Callable[[Any], Adapted]
DEFAULT_OPTIONS: Final = AdaptOptions()


# -- prompts --------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts (others as ``[type]``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        pieces = []
        for part in content:
            if isinstance(part, str):
                pieces.append(part)
            elif isinstance(part, dict):
                text = part.get("text")
                pieces.append(text if isinstance(text, str) else f"[{part.get('type')}]")
        return "".join(pieces)
    return ""


def prompt_text(prompt: Any, messages: Any, limit: int | None = PREFIX_CHARS) -> str | None:
    """The leading ``limit`` characters of a prompt as text; None without a text prompt.

    Chat messages read as ``"<role>: <content>\\n"`` each, so equal conversations give
    equal text; a completions prompt is its string (a list of strings, joined by newlines).
    Only as much as ``limit`` needs is built: prompts can be megabytes.
    """
    pieces: list[str] = []
    size = 0
    if isinstance(messages, list) and messages:
        for message in messages:
            if not isinstance(message, dict):
                continue
            piece = f"{message.get('role')}: {_content_text(message.get('content'))}\n"
            pieces.append(piece)
            size += len(piece)
            if limit is not None and size >= limit:
                break
    elif isinstance(prompt, str):
        pieces.append(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        pieces.append("\n".join(prompt))
    text = "".join(pieces)
    if not text:
        return None
    return text if limit is None else text[:limit]


def prefix_hash(model: str, text: str) -> str:
    """``PREFIX_HASH_HEX`` hex digits of sha256(model, text): equal for equal leading text on a model.

    >>> prefix_hash("m", "You are helpful.") == prefix_hash("m", "You are helpful.")
    True
    >>> prefix_hash("m", "You are helpful.") == prefix_hash("other", "You are helpful.")
    False
    """
    digest = hashlib.sha256(model.encode("utf-8", "surrogatepass") + b"\0" + text.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()[:PREFIX_HASH_HEX]


# -- validation -----------------------------------------------------------------------------


def unix_seconds(value: Any) -> float | None:
    """Unix seconds from a number or a numeric/ISO-8601 string (no zone: UTC), as ``RequestLog``
    reads them; None when it is neither (bounds are ``RequestLog``'s to judge)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond any float
            return None
        return seconds if math.isfinite(seconds) else None
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
            seconds = (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()
        except (ValueError, OverflowError, OSError):
            return None
    return seconds if math.isfinite(seconds) else None


def validated(candidate: dict[str, Any]) -> Adapted:
    """``candidate`` as a ``RequestLog`` row (only its fields, unset ones left out), or why not.

    The msgspec twin of the worker's hot path checks first (a few µs); what it refuses is
    judged by ``RequestLog``, whose message becomes the rejection's.
    """
    stamp = candidate.get("timestamp")
    if isinstance(stamp, str) and (seconds := unix_seconds(stamp)) is not None:
        candidate = {**candidate, "timestamp": seconds}
    try:
        row = msgspec.convert(candidate, FastRow)
    except msgspec.ValidationError:
        pass
    else:
        cached, ttft = row.cached_tokens, row.ttft_s
        if not ((cached is not None and cached > row.prompt_tokens) or (ttft is not None and ttft > row.e2e_s + 1e-3)):
            # Valid as it is: the candidate itself (a fresh dict) without what RequestLog does not know.
            if FIELDS.issuperset(candidate) and None not in candidate.values():
                return candidate
            return {k: v for k, v in candidate.items() if v is not None and k in FIELDS}
    try:
        return cast(Row, RequestLog.model_validate(candidate).to_row())
    except ValidationError as exc:
        return Rejection("validation", summarise_validation_error(exc))


def _finish(candidate: dict[str, Any], prompt: Any, messages: Any, options: AdaptOptions) -> Adapted:
    """Defaults, validation, the prefix hash and the prompt kept or dropped: the end of every adapter."""
    for name, value in options.defaults.items():
        if candidate.get(name) is None:
            candidate[name] = value
    result = validated(candidate)
    if isinstance(result, Rejection):
        return result
    if options.prefix_chars and "prefix_hash" not in result:
        text = prompt_text(prompt, messages, options.prefix_chars)
        if text is not None:
            result["prefix_hash"] = prefix_hash(result["model"], text)
    if options.keep_prompt:
        for name, value in (("prompt", prompt), ("messages", messages)):
            if value is not None:
                result[name] = value
    return result


def _not_an_object(value: Any) -> Rejection:
    return Rejection("not_an_object", f"expected a JSON object, got {type(value).__name__}")


# -- native ---------------------------------------------------------------------------------


def adapt_native(value: Any, options: AdaptOptions = DEFAULT_OPTIONS) -> Adapted:
    """A ``RequestLog`` JSON object, optionally with its ``prompt`` or ``messages``."""
    if not isinstance(value, dict):
        return _not_an_object(value)
    return _finish(dict(value), value.get("prompt"), value.get("messages"), options)


# -- openai ---------------------------------------------------------------------------------


def _first(*values: Any) -> Any:
    for value in values:
        if value is not None:
            return value
    return None


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _dict(value: Any) -> dict[str, Any]:
    """``value`` if it is an object, else an empty one: optional parts of a layout read alike."""
    return value if isinstance(value, dict) else {}


def _duration(timing: dict[str, Any], name: str) -> Any:
    """``timing["<name>_s"]``, else ``timing["<name>_ms"]`` in seconds; None when neither is there.
    A value of the wrong type is passed on as it is, for validation to name."""
    seconds = timing.get(f"{name}_s")
    if seconds is not None:
        return seconds
    millis = timing.get(f"{name}_ms")
    return millis / 1000.0 if _number(millis) else millis


def _status(record: dict[str, Any], error: dict[str, Any] | None) -> Any:
    status = record.get("status_code")
    if status is None and error is not None:
        code = error.get("code")
        status = code if _number(code) and 100 <= code <= 599 else None
    return status


def _timing(timing: dict[str, Any], response: dict[str, Any]) -> tuple[Any, Any] | Rejection:
    """(timestamp, e2e_s) under the ``TIMING`` layout, or what is missing."""
    end = _first(timing.get("end"), timing.get("finished_at"))
    start = _first(timing.get("start"), timing.get("started_at"))
    e2e = _duration(timing, "e2e")
    if e2e is None and start is not None and end is not None:
        began, ended = unix_seconds(start), unix_seconds(end)
        if began is not None and ended is not None:
            e2e = round(ended - began, 6)
    if e2e is None:
        return Rejection("missing_field", "no end-to-end time: timing.e2e_s (or e2e_ms), or timing.start and .end")
    if end is None:
        began = unix_seconds(_first(start, response.get("created")))
        if began is None or not _number(e2e):
            return Rejection("missing_field", "no finish time: timing.end, or timing.start (or response.created) "
                             "with timing.e2e_s")  # fmt: skip
        end = round(began + e2e, 6)
    return end, e2e


def _vllm_metrics(response: dict[str, Any]) -> dict[str, Any]:
    """Phase times from vLLM's per-request ``metrics`` (``--enable-per-request-metrics``).

    vLLM measures that TTFT from scheduling; adding the queue time makes it from arrival,
    as ``ttft_s`` is everywhere else, so TTFT is taken only when both are there.
    """
    metrics = response.get("metrics")
    if not isinstance(metrics, dict):
        return {}
    out: dict[str, Any] = {}
    queue, first = metrics.get("queue_time_ms"), metrics.get("time_to_first_token_ms")
    if _number(queue):
        out["queue_s"] = queue / 1000.0
        if _number(first):
            out["ttft_s"] = (queue + first) / 1000.0
    return out


def adapt_openai(value: Any, options: AdaptOptions = DEFAULT_OPTIONS) -> Adapted:
    """``{"response": ..., "request": ..., "timing": ...}`` as the module docstring describes."""
    if not isinstance(value, dict):
        return _not_an_object(value)
    parts: dict[str, dict[str, Any]] = {}
    for name in ("response", "request", "timing"):
        part = value.get(name)
        if part is not None and not isinstance(part, dict):
            return Rejection("layout", f"{name} must be an object, got {type(part).__name__}")
        parts[name] = part or {}
    response, request, timing = parts["response"], parts["request"], parts["timing"]
    if not response:
        return Rejection("layout", "no response object (the chat.completion the server returned)")
    error: dict[str, Any] | None = _dict(response.get("error")) or None
    if error is None and response.get("object") == "error":
        error = response
    when = _timing(timing, response)
    if isinstance(when, Rejection):
        return when
    usage = _dict(response.get("usage"))
    choices = response.get("choices")
    choice = _dict(choices[0]) if isinstance(choices, list) and choices else {}
    message = _dict(choice.get("message"))
    candidate: dict[str, Any] = {
        "request_id": _first(value.get("request_id"), response.get("id")),
        "timestamp": when[0],
        "e2e_s": when[1],
        "model": _first(response.get("model"), request.get("model")),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": _dict(usage.get("prompt_tokens_details")).get("cached_tokens"),
        "reasoning_tokens": _dict(usage.get("completion_tokens_details")).get("reasoning_tokens"),
        "max_tokens": _first(request.get("max_completion_tokens"), request.get("max_tokens")),
        "finish_reason": choice.get("finish_reason"),
        "status_code": _status(value, error),
        **_vllm_metrics(response),
    }
    for name in ("ttft", "queue", "prefill", "decode"):
        seconds = _duration(timing, name)
        if seconds is not None:
            candidate[f"{name}_s"] = seconds
    for name in LABELS:
        candidate[name] = value.get(name)
    content = message.get("content") if message else choice.get("text")
    if isinstance(content, str | list):
        candidate["content"] = _content_text(content)
    reasoning = _first(message.get("reasoning_content"), message.get("reasoning"))
    if isinstance(reasoning, str):
        candidate["reasoning_content"] = reasoning
    if error is not None:
        status = candidate["status_code"]
        client_fault = _number(status) and 400 <= status < 500
        candidate["finish_reason"] = "other" if client_fault else "error"
        text = error.get("message")
        candidate["error"] = text[:4096] if isinstance(text, str) else str(error.get("type") or "error")[:4096]
        for name in ("prompt_tokens", "completion_tokens"):
            if candidate[name] is None:
                candidate[name] = 0
    missing = [name for name in ("request_id", "model", "prompt_tokens", "completion_tokens", "finish_reason")
               if candidate[name] is None]  # fmt: skip
    if missing:
        where = {"request_id": "response.id", "model": "response.model or request.model",
                 "prompt_tokens": "response.usage.prompt_tokens", "finish_reason": "response.choices[0].finish_reason",
                 "completion_tokens": "response.usage.completion_tokens"}  # fmt: skip
        return Rejection("missing_field", "no " + ", ".join(where[name] for name in missing))
    return _finish(candidate, request.get("prompt"), request.get("messages"), options)


# -- field mapping --------------------------------------------------------------------------

_MISSING: Final = object()


def lookup(value: Any, path: tuple[str, ...]) -> Any:
    """The value at a dotted path; list items by index (``choices.0.text``). A key that itself
    holds dots (``"llm.model"``, as Elasticsearch exports flatten fields) matches too, the
    longest first. ``_MISSING`` when nothing is there."""
    if not path:
        return value
    if isinstance(value, dict):
        for cut in range(len(path), 0, -1):
            key = ".".join(path[:cut])
            if key in value:
                found = lookup(value[key], path[cut:])
                if found is not _MISSING:
                    return found
        return _MISSING
    if isinstance(value, list) and path[0].isdecimal() and int(path[0]) < len(value):
        return lookup(value[int(path[0])], path[1:])
    return _MISSING


@dataclass(frozen=True)
class FieldRule:
    """Where one field comes from: a path (or a constant), then a value map, a scale, a default."""

    path: tuple[str, ...] = ()
    constant: Any = _MISSING
    scale: float | None = None
    values: Mapping[str, Any] | None = None
    default: Any = _MISSING

    def extract(self, record: dict[str, Any]) -> Any:
        value = self.constant if self.constant is not _MISSING else lookup(record, self.path)
        if value is _MISSING or value is None:
            return self.default
        if self.values is not None and isinstance(value, str):
            value = self.values.get(value, value)
        if self.scale is not None and _number(value):
            # 350 * 0.001 is 0.35000000000000003, 350 / 1000 is 0.35: divide by whole divisors.
            divisor = 1.0 / self.scale
            value = value / round(divisor) if abs(divisor - round(divisor)) < 1e-9 * divisor else value * self.scale
        return value

    @classmethod
    def parse(cls, name: str, spec: Any) -> FieldRule:
        if isinstance(spec, str):
            spec = {"path": spec}
        if not isinstance(spec, dict):
            raise ValueError(f"{name}: a path string or an object with path/value, scale, map, default")
        unknown = set(spec) - {"path", "value", "scale", "map", "default"}
        if unknown:
            raise ValueError(f"{name}: unknown keys {sorted(unknown)} (path, value, scale, map, default)")
        if ("path" in spec) == ("value" in spec):
            raise ValueError(f"{name}: give exactly one of path or value")
        path = spec.get("path", "")
        if "path" in spec and (not isinstance(path, str) or not path):
            raise ValueError(f"{name}: path must be a non-empty string such as '_source.llm.model'")
        scale = spec.get("scale")
        if scale is not None and not (_number(scale) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name}: scale must be a positive number (e.g. 0.001 for milliseconds)")
        values = spec.get("map")
        if values is not None and not isinstance(values, dict):
            raise ValueError(f"{name}: map must be an object of logged value -> RequestLog value")
        return cls(
            path=tuple(path.split(".")) if path else (),
            constant=spec.get("value", _MISSING),
            scale=float(scale) if scale is not None else None,
            values=values,
            default=spec.get("default", _MISSING),
        )


@dataclass(frozen=True)
class FieldMapping:
    """Each ``RequestLog`` field (and ``prompt``/``messages``) read from a path of another layout.

    A mapping is a JSON object of field -> path, or field -> ``{"path": ..., "scale": ...,
    "map": {...}, "default": ...}`` or ``{"value": <constant>}``. E.g. for a Kibana export::

        {"request_id": "_id", "timestamp": "_source.@timestamp", "model": "_source.llm.model",
         "prompt_tokens": "_source.llm.usage.input_tokens",
         "completion_tokens": "_source.llm.usage.output_tokens",
         "e2e_s": {"path": "_source.event.duration", "scale": 1e-9},
         "finish_reason": {"path": "_source.llm.stop_reason", "map": {"end_turn": "stop", "max_tokens": "length"}},
         "route": {"value": "chat"}}

    Every required ``RequestLog`` field must be mapped: a mapping that can never yield a
    record is refused when it is loaded, not once per line.
    """

    rules: Mapping[str, FieldRule]

    @classmethod
    def parse(cls, spec: Any) -> FieldMapping:
        if not isinstance(spec, dict) or not spec:
            raise ValueError("a mapping is a JSON object of RequestLog field -> path")
        unknown = sorted(set(spec) - FIELDS - set(PROMPT_FIELDS))
        if unknown:
            known = ", ".join(sorted(FIELDS))
            raise ValueError(f"unknown fields {unknown}; RequestLog has {known} (and prompt, messages)")
        missing = [name for name in REQUIRED if name not in spec]
        if missing:
            raise ValueError(f"the mapping lacks required fields {missing}")
        return cls({name: FieldRule.parse(name, rule) for name, rule in spec.items()})

    def adapt(self, value: Any, options: AdaptOptions = DEFAULT_OPTIONS) -> Adapted:
        if not isinstance(value, dict):
            return _not_an_object(value)
        candidate: dict[str, Any] = {}
        for name, rule in self.rules.items():
            found = rule.extract(value)
            if found is not _MISSING:
                candidate[name] = found
        missing = [name for name in REQUIRED if candidate.get(name) is None]
        if missing:
            paths = ", ".join(f"{name} ({'.'.join(self.rules[name].path)})" for name in missing)
            return Rejection("missing_field", f"nothing at the mapped path of {paths}")
        prompt, messages = candidate.pop("prompt", None), candidate.pop("messages", None)
        return _finish(candidate, prompt, messages, options)


# -- choosing -------------------------------------------------------------------------------


def is_openai(value: Any) -> bool:
    """The ``auto`` format's test: an object with a ``response`` object is an OpenAI-style record."""
    return isinstance(value, dict) and isinstance(value.get("response"), dict)


def adapter_for(fmt: str, options: AdaptOptions = DEFAULT_OPTIONS, mapping: FieldMapping | None = None) -> Adapter:
    """The adapter of a format name (``FORMATS``); ``mapping`` needs a ``FieldMapping``. With
    ``options.instance_from``, each record's replica is read from that path first."""
    adapter = _adapter_for(fmt, options, mapping)
    if not options.instance_from:
        return adapter
    path = tuple(options.instance_from.split("."))
    return lambda value: adapter(_with_instance(value, path))


def _with_instance(value: Any, path: tuple[str, ...]) -> Any:
    """``value`` with ``instance`` set from ``path``, where a label is there (else as it was)."""
    found: Any = value
    for step in path:
        if not isinstance(found, dict):
            return value
        found = found.get(step)
    if isinstance(found, int | float) and not isinstance(found, bool):
        found = str(found)
    if not isinstance(found, str) or not 1 <= len(found) <= 256:
        return value
    return {**value, "instance": found}


def _adapter_for(fmt: str, options: AdaptOptions, mapping: FieldMapping | None) -> Adapter:
    if fmt == "native":
        return lambda value: adapt_native(value, options)
    if fmt == "openai":
        return lambda value: adapt_openai(value, options)
    if fmt == "mapping":
        if mapping is None:
            raise ValueError("the mapping format needs a field mapping (--mapping FILE)")
        rules = mapping
        return lambda value: rules.adapt(value, options)
    if fmt == "auto":
        return lambda value: adapt_openai(value, options) if is_openai(value) else adapt_native(value, options)
    raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")


def parse_defaults(pairs: Iterable[str]) -> dict[str, str]:
    """``["route=chat", "instance=gpu-1:8000"]`` -> a dict (checked by ``AdaptOptions``)."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"default {pair!r}: expected LABEL=VALUE, e.g. route=chat")
        out[name.strip()] = value
    return out
