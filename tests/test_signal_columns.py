"""Window figures behind the phase, throughput, completion and cache signals."""

from __future__ import annotations

import base64
import functools
import math
from typing import Any

import numpy as np

from servewatch.models.windows.open_window import aggregate_rows
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.signal_columns import PrefixMemory
from servewatch.models.windows.window import WindowStats
from servewatch.models.windows.wire import PREVIOUS_WIDTH, windows_from_wire, windows_to_wire

T0 = 1_700_000_000.0


def row(i: int, **extra: Any) -> dict[str, Any]:
    base = dict(
        request_id=f"r{i}", timestamp=T0 + 1 + i * 0.01, model="m", prompt_tokens=1000, cached_tokens=200,
        completion_tokens=101, e2e_s=3.0, ttft_s=0.5, queue_s=0.1, prefill_s=0.4, decode_s=2.0, finish_reason="stop",
    )  # fmt: skip
    return {**base, **extra}


def window(rows: list[dict[str, Any]], dimensions: tuple[str, ...] = ("model",), **kwargs: Any) -> WindowStats:
    [only] = aggregate_rows(rows, Segmenter(dimensions=dimensions), 10.0, **kwargs)
    return only


def replica_window(rows: list[dict[str, Any]]) -> WindowStats:
    """A window of one instance's requests, keyed by instance as replica rows are: it also
    sums them weighed by how recent they are (``recent_columns``)."""
    return window([{**r, "instance": "10.0.0.1:8000"} for r in rows], dimensions=("model", "instance"))


def test_phases_are_log_moments_of_the_requests_that_reported_them() -> None:
    w = window([row(0), row(1, queue_s=0.4), row(2, queue_s=None)])
    queue = w.phase("queue")
    assert queue.n == 2
    assert math.isclose(queue.geometric_mean, 0.2, rel_tol=1e-9)  # sqrt(0.1 * 0.4)
    assert math.isclose(w.phase("itl").geometric_mean, 0.02, rel_tol=1e-9)  # 2 s over 100 decoded tokens
    assert w.decode_tokens == 300 and math.isclose(w.decode_s, 6.0)
    assert w.prefill_tokens == 2400  # uncached tokens of requests that reported prefill time
    assert w.phase("prefill").n == 3 and w.phase("e2e").n == 3


def test_completion_signals_count_leaks_and_empty_answers_among_logged_answers() -> None:
    w = window(
        [
            row(0, content="The answer is 4."),
            row(1, content="thinking...</think>The answer is 4."),
            row(2, content="", reasoning_content="long reasoning that never ended"),
            row(3),  # no text logged: not in the denominator
            row(4, content="<|end|>", finish_reason="length"),
        ],
        markers=("</think>", "<|end|>"),
    )
    assert w.rate("reasoning_leaks", "content_reported") == (2, 4)
    assert w.rate("empty_answers", "content_reported") == (1, 4)
    assert w.truncated == 1


def test_shared_prefixes_count_hashes_seen_before_across_batches() -> None:
    memory = PrefixMemory()
    first = window(
        [row(0, prefix_hash="sys"), row(1, prefix_hash="sys"), row(2, prefix_hash="u1"), row(3)], prefixes=memory
    )
    assert first.rate("prefix_shared", "prefix_reported") == (1, 3)
    second = window([row(0, prefix_hash="u1"), row(1, prefix_hash="u2")], prefixes=memory)
    assert second.rate("prefix_shared", "prefix_reported") == (1, 2)


def test_prefix_memory_stays_bounded() -> None:
    memory = PrefixMemory(capacity=100)
    for start in range(0, 1000, 50):
        memory.seen_before([f"h{i}" for i in range(start, start + 50)])
        assert len(memory) <= 100


def test_new_figures_survive_merge_and_the_wire_format() -> None:
    a = window([row(0, content="x</think>", prefix_hash="p"), row(1, queue_s=0.4)])
    b = window([row(2, content="fine", prefix_hash="p")])
    a.merge(b)
    [c] = windows_from_wire(windows_to_wire([a]))
    assert c.rate("reasoning_leaks", "content_reported") == (1, 2)
    assert c.prefix_reported == 2
    assert c.phase("queue") == a.phase("queue") and c.phase("queue").n == 3


def test_replicas_recent_sums_weigh_each_request_by_the_share_of_its_life_in_its_window() -> None:
    # Window [T0, T0 + 10): the first request finished 1 s into it after 4 s of life, the
    # second lived all its 0.5 s in it; the third logged no decode (no inter-token latency).
    w = replica_window([row(0, e2e_s=4.0), row(1, e2e_s=0.5), row(2, completion_tokens=1)])
    itl = math.log(0.02 / 1e-4)  # log_seconds of 2 s over 100 decoded tokens
    close = functools.partial(math.isclose, rel_tol=1e-6)  # unix timestamps: ~0.2 µs apart
    assert close(w.itl_recent_w, 0.25 + 1.0)
    assert close(w.itl_recent_log, 1.25 * itl) and close(w.itl_recent_w2, 0.25**2 + 1.0)
    assert close(w.prefill_token_recent_w, 0.25 + 1.0 + 1.02 / 3.0)  # the third: 1.02 s of 3


def test_partials_of_a_stage_one_from_before_the_recent_sums_are_still_read() -> None:
    """A rolling upgrade: a stage 1 not yet upgraded sends sums without the last columns."""
    a = replica_window([row(0), row(1, queue_s=0.4)])
    [group] = windows_to_wire([a])
    sums = np.frombuffer(base64.b64decode(group["sums"]), dtype="<f8")[:PREVIOUS_WIDTH]
    [c] = windows_from_wire([{**group, "sums": base64.b64encode(sums.astype("<f8").tobytes()).decode()}])
    assert c.phase("queue") == a.phase("queue") and c.requests == 2
    assert c.itl_recent_w == 0.0 and a.itl_recent_w > 0
