"""``RequestLog`` validation, JSON Schema export and ``AnomalyEvent`` round trips."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from servewatch.schemas import EXPORTED, AnomalyEvent, FinishReason, Hint, RequestLog, Severity, Signal, Status
from servewatch.schemas.request_log import MAX_TOKENS_PER_REQUEST
from tests.samples import VALID_RECORD

VALID: dict[str, Any] = VALID_RECORD
REQUIRED = ("request_id", "timestamp", "model", "prompt_tokens", "completion_tokens", "e2e_s", "finish_reason")


def record(**changes: Any) -> RequestLog:
    return RequestLog.model_validate({**VALID, **changes})


def rejected(**changes: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        record(**changes)
    return info.value


def test_minimal_record_is_valid() -> None:
    log = record()
    assert log.request_id == "r1"
    assert log.timestamp == 1767225600.5
    assert log.finish_reason is FinishReason.STOP
    assert log.cached_tokens is None


# -- timestamps ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        1767225600.5,
        "1767225600.5",
        "2026-01-01T00:00:00.5Z",
        "2026-01-01T00:00:00.500+00:00",
        "2026-01-01T01:00:00.5+01:00",
    ],
)
def test_iso_8601_and_unix_seconds_parse_to_the_same_float(value: Any) -> None:
    assert record(timestamp=value).timestamp == 1767225600.5


def test_integer_unix_seconds_become_a_float() -> None:
    log = record(timestamp=1767225600)
    assert isinstance(log.timestamp, float)
    assert log.timestamp == 1767225600.0


@pytest.mark.parametrize("value", [1767225600000, 1767225600000.0, "1767225600000", 1767225600000000])
def test_milliseconds_timestamps_are_rejected_with_a_hint(value: Any) -> None:
    error = rejected(timestamp=value)
    assert "milliseconds" in str(error)
    assert error.errors()[0]["loc"] == ("timestamp",)


@pytest.mark.parametrize(
    "value", [0, -1, 946_684_799.0, 4_102_444_801.0, "1999-12-31T23:59:59Z", "2100-01-02T00:00:00Z"]
)
def test_timestamps_outside_2000_to_2100_are_rejected(value: Any) -> None:
    rejected(timestamp=value)


@pytest.mark.parametrize("value", [True, False])
def test_booleans_are_not_timestamps(value: bool) -> None:
    error = rejected(timestamp=value)
    assert "boolean" in str(error)


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf"), "nan", "inf", "1e999", "", "yesterday", None, [1], {"s": 1}]
)
def test_malformed_timestamps_are_rejected(value: Any) -> None:
    rejected(timestamp=value)


def test_huge_integer_timestamp_is_a_validation_error() -> None:
    rejected(timestamp=10**400)


def test_iso_timestamp_without_offset_is_utc(monkeypatch: pytest.MonkeyPatch) -> None:
    if not hasattr(time, "tzset"):
        pytest.skip("time.tzset is POSIX-only")
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        value = record(timestamp="2026-01-01T00:00:00.5").timestamp
    finally:
        monkeypatch.undo()
        time.tzset()
    assert value == 1767225600.5


# -- finish_reason ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("stop", FinishReason.STOP),
        ("STOP", FinishReason.STOP),
        ("  Length ", FinishReason.LENGTH),
        ("Tool_Calls", FinishReason.TOOL_CALLS),
        ("abort", FinishReason.ABORT),
        ("content_filter", FinishReason.OTHER),
        ("eos", FinishReason.OTHER),
        ("", FinishReason.OTHER),
    ],
)
def test_finish_reason_is_normalised_and_unknown_becomes_other(value: str, expected: FinishReason) -> None:
    assert record(finish_reason=value).finish_reason is expected


@pytest.mark.parametrize("value", [None, 1, ["stop"]])
def test_finish_reason_must_be_a_string(value: Any) -> None:
    rejected(finish_reason=value)


# -- token counts and timings ----------------------------------------------------------------


@pytest.mark.parametrize(
    "field", ["prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens", "max_tokens"]
)
def test_negative_token_counts_are_rejected(field: str) -> None:
    error = rejected(**{field: -1})
    assert error.errors()[0]["loc"] == (field,)


@pytest.mark.parametrize("field", ["prompt_tokens", "completion_tokens", "reasoning_tokens", "max_tokens"])
def test_token_counts_above_the_maximum_are_rejected(field: str) -> None:
    rejected(**{field: MAX_TOKENS_PER_REQUEST + 1})
    rejected(**{field: 10**30})


def test_token_count_at_the_maximum_is_accepted() -> None:
    assert record(prompt_tokens=MAX_TOKENS_PER_REQUEST).prompt_tokens == MAX_TOKENS_PER_REQUEST


@pytest.mark.parametrize("value", [1.5, "many", None])
def test_non_integer_token_counts_are_rejected(value: Any) -> None:
    rejected(prompt_tokens=value)


@pytest.mark.parametrize("field", ["e2e_s", "ttft_s", "queue_s", "prefill_s", "decode_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -0.1, 86_400.5])
def test_non_finite_negative_or_absurd_timings_are_rejected(field: str, value: float) -> None:
    error = rejected(**{field: value})
    assert field in {err["loc"][0] for err in error.errors()}


def test_cached_tokens_may_not_exceed_prompt_tokens() -> None:
    assert record(cached_tokens=100).cached_tokens == 100
    error = rejected(cached_tokens=101)
    assert "cached_tokens" in str(error)


def test_ttft_may_not_exceed_e2e() -> None:
    assert record(ttft_s=1.5).ttft_s == 1.5
    error = rejected(ttft_s=2.0)
    assert "ttft_s" in str(error)


@pytest.mark.parametrize("field", ["prompt_tokens", "completion_tokens", "e2e_s"])
def test_booleans_are_not_counts_or_timings(field: str) -> None:
    rejected(**{field: True})


# -- required, extra and other fields ----------------------------------------------------------


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_fields_are_rejected(field: str) -> None:
    data = {k: v for k, v in VALID.items() if k != field}
    with pytest.raises(ValidationError) as info:
        RequestLog.model_validate(data)
    assert any(err["type"] == "missing" and err["loc"] == (field,) for err in info.value.errors())


@pytest.mark.parametrize("field", ["request_id", "model"])
@pytest.mark.parametrize("value", ["", "x" * 257])
def test_labels_must_be_short_and_non_empty(field: str, value: str) -> None:
    rejected(**{field: value})


def test_labels_are_kept_as_sent_and_segment_without_their_blanks() -> None:
    """No stripping: the request id must match the user's own log store byte for byte."""
    from servewatch.models.windows.segments import Segmenter

    log = RequestLog.model_validate({**VALID_RECORD, "request_id": " r-1 ", "route": "   "})
    assert log.request_id == " r-1 " and log.route == "   "
    seg = Segmenter()
    ids = seg.ids_for_columns({"model": [" m ", "m"], "route": ["   ", None]}, np.array([1, 1]), np.array([1, 1]))
    assert ids[0] == ids[1] and seg.keys[ids[0]].startswith("model=m|route=-|")


def test_extra_unknown_fields_are_ignored() -> None:
    log = record(vendor_field=1, nested={"a": [1, 2]}, temperature=0.7)
    assert not hasattr(log, "vendor_field")
    dumped = log.model_dump()
    assert "vendor_field" not in dumped and "nested" not in dumped and "temperature" not in dumped
    assert log == record()


@pytest.mark.parametrize("value", [99, 600])
def test_status_code_must_be_an_http_status(value: int) -> None:
    rejected(status_code=value)


def test_records_are_frozen() -> None:
    log = record()
    with pytest.raises(ValidationError):
        log.prompt_tokens = 5  # type: ignore[misc]


# -- derived properties ----------------------------------------------------------------------


@pytest.mark.parametrize(("cached", "expected"), [(None, 100), (0, 100), (30, 70), (100, 0)])
def test_uncached_prompt_tokens(cached: int | None, expected: int) -> None:
    assert record(cached_tokens=cached).uncached_prompt_tokens == expected


@pytest.mark.parametrize(
    ("finish_reason", "status_code", "expected"),
    [
        ("stop", None, False),
        ("length", 200, False),
        ("stop", 429, False),
        ("stop", 499, False),
        ("error", None, True),
        ("ERROR", 200, True),
        ("abort", None, True),
        ("stop", 500, True),
        ("other", 503, True),
        ("length", 599, True),
    ],
)
def test_is_error(finish_reason: str, status_code: int | None, expected: bool) -> None:
    assert record(finish_reason=finish_reason, status_code=status_code).is_error is expected


# -- JSON Schema export ----------------------------------------------------------------------


def test_exported_schemas_are_the_wire_formats() -> None:
    assert set(EXPORTED) == {"RequestLog", "AnomalyEvent", "IncidentGroup", "EngineInterval", "DeadLetter",
                             "SeriesPoint", "Feedback", "Silence", "Delivery", "ChangeMarker", "ChangeReport",
                             "WorkloadProfile"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXPORTED))
def test_json_schema_export_works(name: str) -> None:
    schema = EXPORTED[name].model_json_schema()
    assert isinstance(schema, dict)
    assert isinstance(schema["properties"], dict) and schema["properties"]
    assert "schema_version" in schema["properties"]
    assert set(schema.get("required", [])) <= set(schema["properties"])


def test_request_log_schema_lists_the_required_fields() -> None:
    schema = RequestLog.model_json_schema()
    assert set(schema["required"]) == set(REQUIRED)


# -- AnomalyEvent ----------------------------------------------------------------------------


def event(**changes: Any) -> AnomalyEvent:
    data: dict[str, Any] = {
        "id": "ev-1",
        "fingerprint": "fp-1",
        "status": Status.FIRING,
        "signal": Signal.TTFT,
        "segment": {"model": "m", "route": "chat"},
        "window_start": 1767225600.0,
        "window_end": 1767225610.0,
        "observed": 2.21,
        "expected": 0.55,
        "score": 6.5,
        "severity": Severity.WARNING,
        "load": {"requests_per_s": 4.3, "prompt_tokens_per_s": 12000.0},
        "explained_by_load": False,
        "hints": [Hint(code="prefix_cache_ineffective", message="check that prefix caching is enabled")],
        "evidence": [{"request_id": "r1", "ttft_s": 2.5, "cached_tokens": 0}],
        "summary": "TTFT p95 is 2.21 s against 0.55 s expected.",
    }
    data.update(changes)
    return AnomalyEvent.model_validate(data)


def test_anomaly_event_round_trips_through_json() -> None:
    original = event()
    text = original.model_dump_json()
    again = AnomalyEvent.model_validate_json(text)
    assert again == original
    assert again.model_dump_json() == text
    assert again.hints[0].code == "prefix_cache_ineffective"
    assert again.status is Status.FIRING and again.signal is Signal.TTFT


def test_an_anomaly_event_is_changed_only_by_copies() -> None:
    """Built once (``models.detect.events``); each enrichment after judging returns a new one."""
    original = event()
    with pytest.raises(ValidationError):
        original.summary = "changed in place"
    again = original.model_copy(update={"summary": "a copy"})
    assert again.summary == "a copy" and original.summary != "a copy"


def test_anomaly_event_forbids_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        event(unexpected=1)


def test_a_newer_minor_versions_records_are_read_without_their_new_fields() -> None:
    """Built in code an unknown field is a typo; read off the topic it is a newer writer's
    (a rolling upgrade), ignored. A record wrong in a field this version knows still fails."""
    from servewatch.schemas.incident_group import parse_anomaly_record

    original = event()
    newer = {**original.model_dump(mode="json"), "added_later": {"x": 1}}
    assert parse_anomaly_record(orjson.dumps(newer)) == original
    with pytest.raises(ValidationError):
        parse_anomaly_record(orjson.dumps({**newer, "severity": "apocalyptic"}))


@pytest.mark.parametrize(
    ("status", "severity", "pages"),
    [
        (Status.FIRING, Severity.INFO, False),
        (Status.FIRING, Severity.WARNING, True),
        (Status.FIRING, Severity.CRITICAL, True),
        (Status.RESOLVED, Severity.INFO, False),
        (Status.RESOLVED, Severity.WARNING, False),
        (Status.RESOLVED, Severity.CRITICAL, False),
    ],
)
def test_pages_only_when_firing_above_info(status: Status, severity: Severity, pages: bool) -> None:
    assert event(status=status, severity=severity).pages is pages
    assert AnomalyEvent.model_validate_json(event(status=status, severity=severity).model_dump_json()).pages is pages


# -- the hot path's validator never accepts more than RequestLog -------------------------------
import msgspec  # noqa: E402
import orjson  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from servewatch.pipeline.messages.fast_rows import FastRow, decode_array  # noqa: E402

_values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 20_000_000), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5), st.sampled_from(["stop", "LENGTH", " vllm ", " ", "2026-01-01T00:00:00Z", "1767225600"]),
)  # fmt: skip
_near_misses = st.builds(
    lambda base, changes: {**base, **changes},
    st.just(VALID_RECORD),
    st.dictionaries(
        st.sampled_from([*VALID_RECORD, "cached_tokens", "status_code", "engine", "route", "max_tokens"]), _values
    ),
)


def _inconsistent(row: FastRow) -> bool:
    cached, ttft = row.cached_tokens, row.ttft_s
    return (cached is not None and cached > row.prompt_tokens) or (ttft is not None and ttft > row.e2e_s + 1e-3)


@settings(max_examples=400, deadline=None)
@given(_near_misses)
def test_fast_row_validator_accepts_only_what_requestlog_accepts(item: dict[str, Any]) -> None:
    """Both ways into a ``FastRow``: JSON bytes (the hot path) and a parsed dict (the careful path)."""
    raw = orjson.dumps(item)  # as a shipper sends it (NaN and infinity become null)
    for decode, judge in (
        (lambda: decode_array(b"[" + raw + b"]")[0], lambda: RequestLog.model_validate_json(raw)),
        (lambda: msgspec.convert(item, FastRow), lambda: RequestLog.model_validate(item)),
    ):
        try:
            row = decode()
        except msgspec.ValidationError:
            continue
        if _inconsistent(row):
            continue  # the decoder sends these to RequestLog, which rejects them
        model_row = judge().to_row()  # must not raise
        assert {k: v for k, v in row.to_row().items() if k != "finish_reason"} == {
            k: v for k, v in model_row.items() if k != "finish_reason"
        }


def test_fast_row_has_exactly_the_fields_of_requestlog() -> None:
    assert set(FastRow.__struct_fields__) == set(RequestLog.model_fields) - {"schema_version"}


def _constraints(prop: dict, defs: dict) -> dict:
    """A field's bounds from a JSON Schema property, null branch left out, refs followed."""
    branches = prop.get("anyOf", [prop])
    out: dict = {}
    for branch in branches:
        if "$ref" in branch:
            branch = defs[branch["$ref"].split("/")[-1]]
        if branch.get("type") == "null":
            continue
        for key in ("minimum", "maximum", "minLength", "maxLength", "enum"):
            if key in branch:
                out[key] = sorted(branch[key]) if key == "enum" else float(branch[key])
        if "const" in branch:
            out.setdefault("enum", []).append(branch["const"])
    return out


def test_the_hot_paths_row_and_request_log_agree_field_by_field() -> None:
    """One source of truth. The msgspec twin of ``RequestLog`` has the same fields,
    the same required ones and, where it checks a bound, the same bound (it may accept less:
    ISO timestamps and string status codes are left to ``RequestLog``)."""
    import msgspec

    from servewatch.pipeline.messages.fast_rows import FastRow

    fast_schema = msgspec.json.schema(FastRow)
    fast_defs = fast_schema.get("$defs", {})
    fast = fast_defs.get("FastRow", fast_schema)
    full = RequestLog.model_json_schema()
    full_defs = full.get("$defs", {})
    assert set(fast["properties"]) == set(full["properties"]) - {"schema_version"}
    assert set(fast["required"]) == set(full["required"])
    mismatched = []
    for name, prop in fast["properties"].items():
        mine, theirs = _constraints(prop, fast_defs), _constraints(full["properties"][name], full_defs)
        mismatched += [(name, key, bound, theirs.get(key)) for key, bound in mine.items() if theirs.get(key) != bound]
    # RequestLog checks these in code (ISO timestamps, status codes as strings, finish reasons
    # normalised), so its JSON Schema shows no bound: the constants are shared instead.
    assert {name for name, *_ in mismatched} <= CHECKED_IN_CODE, mismatched


CHECKED_IN_CODE = {"timestamp", "status_code", "finish_reason"}
