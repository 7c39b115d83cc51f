"""Requests read in batches: ``StageOne.process_batch`` and ``RequestAggregation.on_batch``
give what message-by-message reading gives, whatever the messages hold; the
``BatchReader`` commits only what was acknowledged (its broker-backed test is in
``test_batch_reader_kafka``)."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servewatch.models.windows.wire import windows_to_wire
from servewatch.pipeline import topics
from servewatch.pipeline.messages.decode import decode_records, one_record_line
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.schemas.dead_letter import DeadLetter
from tests.test_worker_stages import Acked, stages

START = 1_767_225_600.0
WALL = START + 10_000.0  # the wall clock the stages see: past every record, as in a backfill


def request(n: int, ts: float, **extra: Any) -> dict[str, Any]:
    return {
        "request_id": f"r{n}", "timestamp": ts, "model": "m" if n % 3 else "n", "prompt_tokens": 50 + n % 700,
        "completion_tokens": 1 + n % 90, "e2e_s": 0.5 + (n % 7) / 10, "ttft_s": 0.05 + (n % 5) / 100,
        "finish_reason": "length" if n % 11 == 0 else "stop", **extra,
    }  # fmt: skip


#: One message: one record (the common case, with or without a trailing newline), a batch,
#: a record that breaks a rule, bytes that are not JSON, one far ahead of every clock.
KINDS = ("one", "one", "one", "one_newline", "array", "invalid", "garbage", "future")


def message(kind: str, n: int, ts: float) -> bytes:
    if kind == "one":
        return orjson.dumps(request(n, ts))
    if kind == "one_newline":
        return orjson.dumps(request(n, ts)) + b"\n"
    if kind == "array":
        return orjson.dumps([request(n * 100 + k, ts + k / 10) for k in range(3)])
    if kind == "invalid":
        return orjson.dumps(request(n, ts, prompt_tokens=-1))
    if kind == "future":
        return orjson.dumps(request(n, WALL + 10 * 86_400))
    return b"{not json"


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[bytes], list[int]]:
    """Messages of one partition (time moving on with disorder, now and then past a window
    boundary) and where a reader's batches split them."""
    count = draw(st.integers(1, 120))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=count, max_size=count))
    steps = draw(st.lists(st.floats(-3.0, 4.0), min_size=count, max_size=count))
    ts, values = START, []
    for n, (kind, step) in enumerate(zip(kinds, steps, strict=True)):
        ts += step
        values.append(message(kind, n, ts))
    cuts = sorted(set(draw(st.lists(st.integers(1, count), max_size=6))) | {count})
    return values, cuts


def run_each(values: list[bytes], cuts: list[int]) -> tuple[StageOne, list[Any], list[Any], list[str | None]]:
    """Message by message; the last message acknowledged by the end of each batch of ``cuts``."""
    stage, closed, letters, acked = StageOne(Settings()), [], [], []
    tokens = [Acked(str(offset)) for offset in range(len(values))]
    last: str | None = None
    for offset, value in enumerate(values):
        more_letters, more_closed = stage.process(value, MessageOrigin("t", 0, offset), 0.0, tokens[offset], WALL)
        letters += more_letters
        closed += more_closed
        last = next((token.name for token in reversed(stage.safe_to_ack())), last)
        if offset + 1 in cuts:
            acked.append(last)
    return stage, closed, letters, acked


def run_batched(values: list[bytes], cuts: list[int]) -> tuple[StageOne, list[Any], list[Any], list[str | None]]:
    stage, closed, letters, acked = StageOne(Settings()), [], [], []
    tokens = [Acked(str(offset)) for offset in range(len(values))]
    start, last = 0, None
    for stop in cuts:
        batch = [(values[k], k) for k in range(start, stop)]
        more_letters, more_closed = stage.process_batch("t", 0, batch, tokens.__getitem__, 0.0, WALL)
        letters += more_letters
        closed += more_closed
        last = next((token.name for token in reversed(stage.safe_to_ack())), last)
        acked.append(last)
        start = stop
    return stage, closed, letters, acked


def described(letters: list[DeadLetter]) -> list[tuple[str, int | None, int | None]]:
    return [(letter.reason, letter.source_offset, letter.record_index) for letter in letters]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_a_batch_gives_what_its_messages_give_one_by_one(stream: tuple[list[bytes], list[int]]) -> None:
    values, cuts = stream
    each, each_closed, each_letters, each_acked = run_each(values, cuts)
    batched, batched_closed, batched_letters, batched_acked = run_batched(values, cuts)
    assert windows_to_wire(batched_closed) == windows_to_wire(each_closed)
    assert described(batched_letters) == described(each_letters)
    assert windows_to_wire(batched.flush_all()) == windows_to_wire(each.flush_all())
    # Tokens are cumulative in a batch: the last acknowledged covers every message before it,
    # and after each batch it is the message reading them one by one had acknowledged.
    assert batched_acked == each_acked


def test_a_run_read_again_is_counted_as_duplicates_and_still_acknowledged() -> None:
    values = [orjson.dumps(request(n, START + n)) for n in range(20)]
    stage = StageOne(Settings())
    tokens = [Acked(str(n)) for n in range(20)]
    stage.process_batch("t", 0, [(v, n) for n, v in enumerate(values)], tokens.__getitem__, 0.0, WALL)
    stage.process_batch("t", 0, [(v, n) for n, v in enumerate(values)][10:], tokens.__getitem__, 0.0, WALL)
    assert stage.redelivered == 10
    stage.flush_all()
    assert [token.name for token in stage.safe_to_ack()][-1] == "19"


def test_one_record_messages_are_decoded_together_or_not_at_all() -> None:
    lines = [orjson.dumps(request(n, START)) for n in range(3)]
    assert all(map(one_record_line, [*lines, lines[0] + b"\n"]))
    assert not any(map(one_record_line, [b"[{}]", b'{"a":\n1}', b"", None]))
    rows = decode_records([lines[0] + b"\n", *lines[1:]])
    assert rows is not None and len(rows) == 3 and rows.positions.tolist() == [0, 0, 0]
    assert decode_records([lines[0], orjson.dumps(request(9, START, prompt_tokens=-1))]) is None


async def test_a_batch_with_bad_messages_dead_letters_them_and_sends_the_rest() -> None:
    outbox, _, aggregation, _ = stages(Settings(topic_partitions=1))
    values = [b"{not json", orjson.dumps([request(1, START), request(2, START, prompt_tokens=-1)]),
              orjson.dumps(request(3, START + 1)), orjson.dumps(request(4, START + 100))]  # fmt: skip
    tokens = [Acked(str(n)) for n in range(len(values))]
    await aggregation.on_batch("t", 0, [(v, n) for n, v in enumerate(values)], tokens.__getitem__)
    letters = [DeadLetter.model_validate_json(value) for value in outbox.values(topics.DEADLETTER)]
    assert described(letters) == [("invalid_json", 0, None), ("validation", 1, 1)]
    bundles = [orjson.loads(value) for value in outbox.values(topics.PARTIALS)]
    assert sum(len(bundle["windows"]) for bundle in bundles) and any(bundle["watermarks"] for bundle in bundles)
    assert [token.name for token in tokens if token.acks] == ["0", "1", "2"]  # the last feeds an open window
