"""Which requests show the fault a rate signal counts: the evidence of a rate event.

A latency event's evidence is its window's slowest requests, kept by location as they are
folded. A rate event's is the requests it counted as bad (cut by the length limit, a
reasoning marker in the answer, an empty answer, a failure). Those are rare, so they are
not kept per segment; when such an event fires, the window's own messages (its
``sources``, offset ranges per partition) are read back and scanned for them
(``pipeline.worker.evidence``). This module says, for one request log, whether it shows the fault.

>>> row = {"finish_reason": "LENGTH", "content": "a </think> b", "status_code": 200}
>>> [s.value for s in FAULT_SIGNALS if shows_fault(s, row, ("</think>",))]
['length_truncation', 'reasoning_leak']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from servewatch.models.windows.batch import normalise_reason
from servewatch.models.windows.rows import field_getter
from servewatch.models.windows.signal_columns import MIN_PREFILL_TOKENS, leaked
from servewatch.schemas.anomaly import Signal


#: The latency signals whose worst requests are found when their event fires, among the
#: window's requests read back (TTFT's slowest are kept as the window is folded), by how
#: slow each request was in the signal's own terms: seconds of the phase, or per output token.
def _per_output_token(get: Any) -> float | None:
    decode, tokens = get("decode_s"), get("completion_tokens")
    return decode / max(tokens - 1, 1) if decode is not None and tokens else None


def _prefill_per_1k(get: Any) -> float | None:
    prompt, cached = get("prompt_tokens"), get("cached_tokens") or 0
    seconds = get("prefill_s")
    if seconds is None and get("ttft_s") is not None:
        seconds = get("ttft_s") - (get("queue_s") or 0.0)
    if seconds is None or prompt is None:
        return None
    return seconds / (max(prompt - cached, MIN_PREFILL_TOKENS) / 1000.0)


SLOWNESS: dict[Signal, Any] = {
    Signal.QUEUE_TIME: lambda get: get("queue_s"),
    Signal.PREFILL_TIME: lambda get: get("prefill_s"),
    Signal.PREFILL_PER_TOKEN: _prefill_per_1k,
    Signal.E2E: lambda get: get("e2e_s"),
    Signal.ITL: _per_output_token,
    Signal.THROUGHPUT: _per_output_token,  # tokens/s per request falls as this rises
}


def slowness(signal: Signal, row: Any) -> float | None:
    """How slow ``row`` was by ``signal`` (larger is worse), None when it did not report it.

    >>> slowness(Signal.ITL, {"decode_s": 2.0, "completion_tokens": 101}), slowness(Signal.QUEUE_TIME, {})
    (0.02, None)
    """
    value = SLOWNESS[signal](field_getter(row))
    return None if value is None else float(value)


#: The rate signals whose evidence is the requests they counted.
FAULT_SIGNALS = (Signal.LENGTH_TRUNCATION, Signal.REASONING_LEAK, Signal.EMPTY_RESPONSE, Signal.ERROR_RATE)


def shows_fault(signal: Signal, row: Any, markers: Sequence[str]) -> bool:
    """Whether the request log ``row`` (a mapping or an object) is one ``signal`` counts as bad:
    the same rules as the fold's columns (``models.windows.open_window``, ``signal_columns``)."""
    get = field_getter(row)
    if signal is Signal.LENGTH_TRUNCATION:
        return normalise_reason(str(get("finish_reason"))) == "length"
    if signal is Signal.ERROR_RATE:
        status = get("status_code")
        return normalise_reason(str(get("finish_reason"))) in ("error", "abort") or (status or 0) >= 500
    content = get("content")
    if signal is Signal.REASONING_LEAK:
        return leaked(content, markers)
    if signal is Signal.EMPTY_RESPONSE:
        reasoning = get("reasoning_content")
        return bool(reasoning and reasoning.strip()) and not (content and content.strip())
    return False
