"""Which requests show the fault a rate signal counts: the evidence of a rate event.

A latency event's evidence is its window's slowest requests, kept by location as they are
folded. A rate event's is the requests it counted as bad (cut by the length limit, a
reasoning marker in the answer, an empty answer, a failure). Those are rare, so they are
not kept per segment; when such an event fires, the window's own messages (its
``sources``, offset ranges per partition) are read back and scanned for them
(``pipeline.evidence``). This module says, for one request log, whether it shows the fault.

>>> row = {"finish_reason": "LENGTH", "content": "a </think> b", "status_code": 200}
>>> [s.value for s in FAULT_SIGNALS if shows_fault(s, row, ("</think>",))]
['length_truncation', 'reasoning_leak']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from models.batch import normalise_reason
from models.rows import field_getter
from models.signal_columns import leaked
from schemas.anomaly import Signal

#: The rate signals whose evidence is the requests they counted.
FAULT_SIGNALS = (Signal.LENGTH_TRUNCATION, Signal.REASONING_LEAK, Signal.EMPTY_RESPONSE, Signal.ERROR_RATE)


def shows_fault(signal: Signal, row: Any, markers: Sequence[str]) -> bool:
    """Whether the request log ``row`` (a mapping or an object) is one ``signal`` counts as bad:
    the same rules as the fold's columns (``models.open_window``, ``signal_columns``)."""
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
