"""Small shared test data."""

from __future__ import annotations

from typing import Any

#: A minimal valid RequestLog as a shipper would send it.
VALID_RECORD: dict[str, Any] = {
    "request_id": "r1",
    "timestamp": 1767225600.5,
    "model": "m",
    "prompt_tokens": 100,
    "completion_tokens": 20,
    "e2e_s": 1.5,
    "finish_reason": "stop",
    "ttft_s": 0.2,
}
