"""``pipeline.messages.decode.decode_message``: one object, a JSON array or NDJSON in; records and dead letters out."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servewatch.pipeline.messages.dead_letters import RAW_KEEP_BYTES
from servewatch.pipeline.messages.decode import Decoded, decode_message
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.schemas import DeadLetter, RequestLog
from tests.samples import VALID_RECORD

VALID: dict[str, Any] = VALID_RECORD
SOURCE = MessageOrigin(topic="servewatch.requests", partition=3, offset=42)


def rec(i: int, **changes: Any) -> dict[str, Any]:
    return {**VALID, "request_id": f"r{i}", **changes}


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def reasons(decoded: Decoded) -> list[str]:
    return [letter.reason for letter in decoded.dead_letters]


def assert_from(letter: DeadLetter, source: MessageOrigin) -> None:
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == (
        source.topic,
        source.partition,
        source.offset,
    )


# -- accepted shapes ------------------------------------------------------------------------


def test_single_object() -> None:
    decoded = decode_message(dumps(VALID))
    assert decoded.dead_letters == []
    assert len(decoded.records) == 1
    assert isinstance(decoded.records[0], dict)
    assert decoded.records[0]["request_id"] == "r1"
    assert decoded.records[0]["timestamp"] == 1767225600.5


def test_json_array_of_three_records_keeps_their_order() -> None:
    decoded = decode_message(dumps([rec(0), rec(1), rec(2)]))
    assert decoded.dead_letters == []
    assert [r["request_id"] for r in decoded.records] == ["r0", "r1", "r2"]


def test_ndjson_with_a_broken_middle_line_loses_only_that_line() -> None:
    raw = dumps(rec(0)) + b"\n" + b'{"request_id": "r1", "timestamp": ' + b"\n" + dumps(rec(2)) + b"\n"
    decoded = decode_message(raw, SOURCE)
    assert [r["request_id"] for r in decoded.records] == ["r0", "r2"]
    assert len(decoded.dead_letters) == 1
    letter = decoded.dead_letters[0]
    assert letter.reason == "invalid_json"
    assert letter.record_index == 1
    assert letter.raw == '{"request_id": "r1", "timestamp": '
    assert letter.error
    assert_from(letter, SOURCE)


def test_ndjson_tolerates_blank_lines_and_crlf() -> None:
    raw = dumps(rec(0)) + b"\r\n\r\n" + dumps(rec(1)) + b"\r\n"
    decoded = decode_message(raw)
    assert decoded.dead_letters == []
    assert [r["request_id"] for r in decoded.records] == ["r0", "r1"]


def test_ndjson_line_that_is_not_an_object() -> None:
    decoded = decode_message(dumps(rec(0)) + b"\n[1, 2]\n" + dumps(rec(2)))
    assert len(decoded.records) == 2
    assert reasons(decoded) == ["not_an_object"]
    assert decoded.dead_letters[0].record_index == 1


# -- one bad record in a batch ----------------------------------------------------------------


def test_array_with_one_invalid_record() -> None:
    decoded = decode_message(dumps([rec(0), rec(1, prompt_tokens=-5), rec(2)]), SOURCE)
    assert [r["request_id"] for r in decoded.records] == ["r0", "r2"]
    assert len(decoded.dead_letters) == 1
    letter = decoded.dead_letters[0]
    assert letter.reason == "validation"
    assert letter.record_index == 1
    assert "prompt_tokens" in letter.error
    assert orjson.loads(letter.raw) == rec(1, prompt_tokens=-5)  # only the bad record, not the batch
    assert not letter.raw_truncated
    assert_from(letter, SOURCE)


def test_validation_error_names_every_bad_field() -> None:
    bad = rec(0, timestamp=1767225600000)
    del bad["model"]
    decoded = decode_message(dumps([bad]))
    letter = decoded.dead_letters[0]
    assert letter.reason == "validation"
    assert "timestamp" in letter.error and "milliseconds" in letter.error
    assert "model" in letter.error


def test_single_invalid_object_has_no_record_index() -> None:
    decoded = decode_message(dumps(rec(0, e2e_s=-1.0)))
    assert decoded.records == []
    assert reasons(decoded) == ["validation"]
    assert decoded.dead_letters[0].record_index is None
    assert "e2e_s" in decoded.dead_letters[0].error


@pytest.mark.parametrize("item", [42, "text", None, True, [VALID], 1.5])
def test_non_object_item_in_array(item: Any) -> None:
    decoded = decode_message(dumps([rec(0), item]))
    assert [r["request_id"] for r in decoded.records] == ["r0"]
    assert reasons(decoded) == ["not_an_object"]
    assert decoded.dead_letters[0].record_index == 1
    assert orjson.loads(decoded.dead_letters[0].raw) == item


@pytest.mark.parametrize("raw", [b"42", b'"hello"', b"null", b"true"])
def test_top_level_scalar_is_not_an_object(raw: bytes) -> None:
    decoded = decode_message(raw)
    assert decoded.records == []
    assert reasons(decoded) == ["not_an_object"]
    assert decoded.dead_letters[0].record_index is None
    assert decoded.dead_letters[0].raw == raw.decode()


def test_empty_array_yields_nothing() -> None:
    decoded = decode_message(b"[]")
    assert decoded.records == [] and decoded.dead_letters == []


@pytest.mark.parametrize("item", [b"[" * 300 + b"]" * 300, b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}"])
def test_deeply_nested_batch_item_costs_only_that_item(item: bytes) -> None:
    raw = b"[" + dumps(rec(0)) + b"," + item + b"]"
    decoded = decode_message(raw, SOURCE)
    assert [r["request_id"] for r in decoded.records] == ["r0"]
    assert len(decoded.dead_letters) == 1
    assert decoded.dead_letters[0].record_index == 1


def test_nesting_beyond_the_parser_limit_is_invalid_json() -> None:
    decoded = decode_message(b"[" * 2000 + b"]" * 2000)
    assert reasons(decoded) == ["invalid_json"]


# -- whole-message failures -------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", None])
def test_empty_message(raw: bytes | None) -> None:
    decoded = decode_message(raw, SOURCE)
    assert decoded.records == []
    assert reasons(decoded) == ["empty"]
    assert decoded.dead_letters[0].raw == ""
    assert_from(decoded.dead_letters[0], SOURCE)


def test_message_over_max_bytes() -> None:
    raw = dumps([rec(i) for i in range(10)])
    decoded = decode_message(raw, SOURCE, max_bytes=len(raw) - 1)
    assert decoded.records == []
    assert reasons(decoded) == ["too_large"]
    assert str(len(raw)) in decoded.dead_letters[0].error
    assert decode_message(raw, SOURCE, max_bytes=len(raw)).dead_letters == []


def test_raw_of_a_huge_dead_letter_is_cut() -> None:
    raw = b"x" * (RAW_KEEP_BYTES + 100)
    letter = decode_message(raw, max_bytes=RAW_KEEP_BYTES).dead_letters[0]
    assert letter.reason == "too_large"
    assert letter.raw_truncated
    assert len(letter.raw) == RAW_KEEP_BYTES


def test_invalid_utf8_becomes_a_dead_letter_with_replacement_chars() -> None:
    raw = b'{"request_id": "r\xff\xfe1", "model": "m"}'
    decoded = decode_message(raw, SOURCE)
    assert decoded.records == []
    assert reasons(decoded) == ["invalid_json"]
    letter = decoded.dead_letters[0]
    assert isinstance(letter.raw, str)
    assert "\ufffd" in letter.raw
    assert letter.raw.startswith('{"request_id": "r')
    assert_from(letter, SOURCE)


def test_invalid_utf8_on_one_ndjson_line() -> None:
    raw = dumps(rec(0)) + b"\n" + b'{"request_id": "\xc3\x28"}' + b"\n" + dumps(rec(2))
    decoded = decode_message(raw)
    assert [r["request_id"] for r in decoded.records] == ["r0", "r2"]
    assert reasons(decoded) == ["invalid_json"]
    assert decoded.dead_letters[0].record_index == 1
    assert "\ufffd" in decoded.dead_letters[0].raw


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_literals_are_invalid_json(literal: bytes) -> None:
    raw = dumps({k: v for k, v in VALID.items() if k != "e2e_s"})[:-1] + b', "e2e_s": ' + literal + b"}"
    decoded = decode_message(raw)
    assert decoded.records == []
    assert reasons(decoded) == ["invalid_json"]
    assert decoded.dead_letters[0].raw == raw.decode()


def test_nan_inside_a_batch_rejects_the_message_as_invalid_json() -> None:
    raw = b"[" + dumps(rec(0)) + b', {"e2e_s": NaN}]'
    assert reasons(decode_message(raw)) == ["invalid_json"]


@pytest.mark.parametrize("raw", [b"{", b"not json", b'{"a": 1} trailing', b"\x00\x01\x02"])
def test_garbage_is_invalid_json(raw: bytes) -> None:
    decoded = decode_message(raw)
    assert decoded.records == []
    assert reasons(decoded) == ["invalid_json"]
    assert decoded.dead_letters[0].record_index is None


# -- provenance -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"x" * 2000,  # too_large below
        b"{broken",
        dumps(rec(0, prompt_tokens=-1)),
        b"7",
        dumps([rec(0), rec(1, e2e_s=-2), 5, rec(3, model="")]),
        dumps(rec(0)) + b"\n{bad\n[]\n" + dumps(rec(3, ttft_s=99.0)),
        b'{"a": "\xff"}',
    ],
)
def test_source_is_copied_into_every_dead_letter(raw: bytes) -> None:
    decoded = decode_message(raw, SOURCE, max_bytes=1000)
    assert decoded.dead_letters
    before = time.time()
    for letter in decoded.dead_letters:
        assert_from(letter, SOURCE)
        assert letter.schema_version == 1
        assert 0 < letter.received_at <= before
        assert DeadLetter.model_validate_json(letter.model_dump_json()) == letter


def test_dead_letters_without_a_source_have_no_provenance() -> None:
    letter = decode_message(b"{broken").dead_letters[0]
    assert letter.source_topic is None and letter.source_partition is None and letter.source_offset is None


def test_batch_dead_letters_have_distinct_indexes() -> None:
    raw = dumps([rec(0, prompt_tokens=-1), rec(1), "x", rec(3, cached_tokens=500), rec(4)])
    decoded = decode_message(raw, SOURCE)
    assert [r["request_id"] for r in decoded.records] == ["r1", "r4"]
    assert [(d.reason, d.record_index) for d in decoded.dead_letters] == [
        ("validation", 0),
        ("not_an_object", 2),
        ("validation", 3),
    ]


# -- properties -------------------------------------------------------------------------------

FIELDS = sorted(RequestLog.model_fields)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(["stop", "STOP", "2026-01-01T00:00:00Z", "1767225600", "NaN", ""])
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=6)
    ),
    max_leaves=25,
)
# Valid records with a few fields replaced by arbitrary JSON-ish values: near misses.
mutated_records = st.builds(
    lambda changes: {**VALID, **changes},
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3),
)
messages = json_values | mutated_records | st.lists(mutated_records | json_values, max_size=8)

PROPERTY = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def check_accounting(raw: bytes, decoded: Decoded) -> None:
    """Every input item ends up as exactly one record or one dead letter."""
    total = len(decoded.records) + len(decoded.dead_letters)
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        assert total >= 1
        return
    if isinstance(parsed, list):
        assert total == len(parsed)
        indexes = [d.record_index for d in decoded.dead_letters]
        assert len(set(indexes)) == len(indexes)
        assert all(i is not None and 0 <= i < len(parsed) for i in indexes)
    else:
        assert total == 1


@PROPERTY
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_never_raise(raw: bytes) -> None:
    decoded = decode_message(raw, SOURCE)
    if raw:
        check_accounting(raw, decoded)
    else:
        assert reasons(decoded) == ["empty"]
    for letter in decoded.dead_letters:
        assert_from(letter, SOURCE)


@PROPERTY
@given(messages)
def test_arbitrary_json_never_raises_and_accounts_for_every_item(value: Any) -> None:
    raw = json.dumps(value, allow_nan=True).encode()
    decoded = decode_message(raw, SOURCE)
    check_accounting(raw, decoded)
    for record in decoded.records:
        assert math.isfinite(record["timestamp"]) and math.isfinite(record["e2e_s"])
        assert record["prompt_tokens"] >= 0 and record["completion_tokens"] >= 0
    for letter in decoded.dead_letters:
        assert_from(letter, SOURCE)
        assert letter.reason in {"invalid_json", "validation", "not_an_object"}


labels = st.text(alphabet=st.characters(categories=["L", "N"]), min_size=1, max_size=20)
valid_records = st.builds(
    lambda rid, ts, model, p, c, e2e, frac, reason: {
        "request_id": rid,
        "timestamp": ts,
        "model": model,
        "prompt_tokens": p,
        "completion_tokens": c,
        "e2e_s": e2e,
        "ttft_s": e2e * frac,
        "finish_reason": reason,
    },
    labels,
    st.floats(min_value=946_684_800.0, max_value=4_102_444_800.0),
    labels,
    st.integers(0, 1_000_000),
    st.integers(0, 100_000),
    st.floats(min_value=0.0, max_value=3600.0),
    st.floats(min_value=0.0, max_value=1.0),
    st.sampled_from(["stop", "length", "ERROR", "weird"]),
)


@PROPERTY
@given(st.lists(valid_records, min_size=1, max_size=10), st.sampled_from(["array", "ndjson"]))
def test_valid_records_always_decode_in_order(records: list[dict[str, Any]], shape: str) -> None:
    raw = dumps(records) if shape == "array" else b"\n".join(dumps(r) for r in records)
    decoded = decode_message(raw)
    assert decoded.dead_letters == []
    assert [r["request_id"] for r in decoded.records] == [r["request_id"] for r in records]
    assert [r["timestamp"] for r in decoded.records] == [r["timestamp"] for r in records]
