"""The shipper's adapters: native, OpenAI-style and field-mapped records -> RequestLog rows or rejections."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servewatch.pipeline.ingest.ship.adapters import (
    AdaptOptions,
    FieldMapping,
    Rejection,
    adapt_native,
    adapt_openai,
    adapter_for,
    lookup,
    parse_defaults,
    prefix_hash,
    prompt_text,
)
from servewatch.schemas.request_log import RequestLog

NATIVE: dict[str, Any] = {
    "request_id": "r1", "timestamp": 1767225600.5, "model": "m", "prompt_tokens": 900, "completion_tokens": 120,
    "e2e_s": 2.1, "finish_reason": "stop", "ttft_s": 0.3, "cached_tokens": 512, "route": "chat",
}  # fmt: skip

SYSTEM = "You are a careful assistant. " * 100  # 2,900 characters: longer than the hashed prefix

OPENAI: dict[str, Any] = {
    "route": "chat",
    "instance": "gpu-1:8000",
    "request": {
        "model": "qwen3-32b",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 6 x 7?"}],
        "max_completion_tokens": 512,
    },
    "response": {
        "id": "chatcmpl-7",
        "object": "chat.completion",
        "created": 1767225598,
        "model": "qwen3-32b",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "42.", "reasoning": "6 x 7 = 42"},
            }
        ],
        "usage": {
            "prompt_tokens": 780,
            "completion_tokens": 25,
            "total_tokens": 805,
            "prompt_tokens_details": {"cached_tokens": 768},
            "completion_tokens_details": {"reasoning_tokens": 20},
        },
    },
    "timing": {"end": "2026-01-01T00:00:01.25Z", "e2e_ms": 2250, "ttft_ms": 180, "queue_ms": 20, "decode_s": 1.9},
}


def valid(row: dict[str, Any] | Rejection) -> dict[str, Any]:
    assert isinstance(row, dict), row
    RequestLog.model_validate(row)  # the authoritative schema accepts every row an adapter returns
    return row


# -- native ---------------------------------------------------------------------------------


def test_a_native_record_passes_as_it_is_and_unknown_fields_are_dropped() -> None:
    assert valid(adapt_native({**NATIVE, "schema_version": 1, "upstream": {"x": 1}})) == NATIVE
    iso = valid(adapt_native({**NATIVE, "timestamp": "2026-01-01T00:00:00.5Z"}))
    assert iso["timestamp"] == 1767225600.5


@pytest.mark.parametrize(
    ("record", "reason", "words"),
    [
        ([NATIVE], "not_an_object", "list"),
        ({**NATIVE, "timestamp": 1767225600500}, "validation", "milliseconds"),
        ({**NATIVE, "prompt_tokens": -1}, "validation", "prompt_tokens"),
        ({**NATIVE, "cached_tokens": 901}, "validation", "cached_tokens exceeds"),
        ({"request_id": "r"}, "validation", "model"),
    ],
)
def test_native_rejections_say_what_is_wrong(record: Any, reason: str, words: str) -> None:
    rejected = adapt_native(record)
    assert isinstance(rejected, Rejection) and rejected.reason == reason and words in rejected.error


def test_the_prompt_becomes_a_prefix_hash_and_is_dropped_unless_kept() -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "question one"}]
    first = valid(adapt_native({**NATIVE, "messages": messages}))
    second = valid(adapt_native({**NATIVE, "messages": [messages[0], {"role": "user", "content": "question two"}]}))
    other_system = valid(adapt_native({**NATIVE, "messages": [{"role": "system", "content": "Be brief."}]}))
    assert "messages" not in first and "prompt" not in first
    # The leading 2,000 characters are the same system prompt: the same prefix.
    assert first["prefix_hash"] == second["prefix_hash"] != other_system["prefix_hash"]
    assert len(first["prefix_hash"]) == 16
    other_model = valid(adapt_native({**NATIVE, "model": "m2", "messages": messages}))
    assert other_model["prefix_hash"] != first["prefix_hash"]  # a prefix cache is per model

    kept = valid(adapt_native({**NATIVE, "prompt": "hello"}, AdaptOptions(keep_prompt=True)))
    assert kept["prompt"] == "hello" and kept["prefix_hash"] == prefix_hash("m", "hello")
    assert "prefix_hash" not in valid(adapt_native({**NATIVE, "prompt": "hello"}, AdaptOptions(prefix_chars=0)))
    own = valid(adapt_native({**NATIVE, "prompt": "hello", "prefix_hash": "sys-v1"}))
    assert own["prefix_hash"] == "sys-v1"  # the record's own hash wins


def test_prompt_text_reads_chat_parts_and_completion_prompts_up_to_the_limit() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image_url"}]}]
    assert prompt_text(None, parts) == "user: Describe [image_url]\n"
    assert prompt_text(["a", "b"], None) == "a\nb"
    assert prompt_text("x" * 5000, None, 2000) == "x" * 2000
    assert (
        prompt_text(None, [{"role": "user", "content": "y" * 10}] * 1000, 50)
        == ("user: " + "y" * 10 + "\n") * 2 + ("user: " + "y" * 10)[:16]
    )
    assert prompt_text(None, None) is None and prompt_text("", []) is None and prompt_text([1, 2], None) is None


def test_defaults_fill_only_missing_labels_and_are_checked() -> None:
    options = AdaptOptions(defaults=parse_defaults(["route=batch", "instance=gpu-9:8000"]))
    row = valid(adapt_native(NATIVE, options))
    assert row["route"] == "chat" and row["instance"] == "gpu-9:8000"
    for bad in (["model=x"], ["engine=tgi"], ["route="]):
        with pytest.raises(ValueError):
            AdaptOptions(defaults=parse_defaults(bad))
    with pytest.raises(ValueError):
        parse_defaults(["route"])


def test_the_replica_label_a_team_logs_is_shipped_as_the_instance_replicas_are_compared_by() -> None:
    pods = AdaptOptions(instance_from="kubernetes.pod_name", defaults={"instance": "unknown"})
    logged = {**NATIVE, "instance": "10.0.0.7:8000", "kubernetes": {"pod_name": "vllm-llama-5f7c9-x2x8q"}}
    assert valid(adapter_for("native", pods)(logged))["instance"] == "vllm-llama-5f7c9-x2x8q"
    assert valid(adapter_for("auto", pods)({**OPENAI, "kubernetes": {"pod_name": "p-2"}}))["instance"] == "p-2"
    # Nothing at the path: the record's own instance, else the default.
    assert valid(adapter_for("native", pods)({**NATIVE, "instance": "gpu-3:8000"}))["instance"] == "gpu-3:8000"
    assert valid(adapter_for("native", pods)(NATIVE))["instance"] == "unknown"
    assert valid(adapter_for("native", AdaptOptions(instance_from="node"))({**NATIVE, "node": 17}))["instance"] == "17"
    for bad in ("kubernetes.", ".pod", "a..b"):
        with pytest.raises(ValueError, match="dotted path"):
            AdaptOptions(instance_from=bad)


# -- openai ---------------------------------------------------------------------------------


def test_an_openai_record_maps_usage_choices_and_the_timing_layout() -> None:
    row = valid(adapt_openai(OPENAI))
    expected = {
        "request_id": "chatcmpl-7", "timestamp": 1767225601.25, "model": "qwen3-32b", "prompt_tokens": 780,
        "completion_tokens": 25, "cached_tokens": 768, "reasoning_tokens": 20, "max_tokens": 512,
        "finish_reason": "stop", "e2e_s": 2.25, "ttft_s": 0.18, "queue_s": 0.02, "decode_s": 1.9,
        "route": "chat", "instance": "gpu-1:8000", "content": "42.", "reasoning_content": "6 x 7 = 42",
    }  # fmt: skip
    assert {k: v for k, v in row.items() if k != "prefix_hash"} == expected
    assert row["prefix_hash"] == prefix_hash("qwen3-32b", prompt_text(None, OPENAI["request"]["messages"]) or "")
    kept = valid(adapt_openai(OPENAI, AdaptOptions(keep_prompt=True)))
    assert kept["messages"] == OPENAI["request"]["messages"]


def variant(**changes: Any) -> dict[str, Any]:
    """OPENAI with dotted paths set (None deletes)."""
    record = copy.deepcopy(OPENAI)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = record
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return record


def test_reasoning_content_wins_over_reasoning_and_either_is_read() -> None:
    both = variant(response__choices__0__message__reasoning_content="old name")
    assert valid(adapt_openai(both))["reasoning_content"] == "old name"
    only_old = variant(
        response__choices__0__message__reasoning=None, response__choices__0__message__reasoning_content="r"
    )
    assert valid(adapt_openai(only_old))["reasoning_content"] == "r"
    neither = variant(response__choices__0__message__reasoning=None, response__choices__0__message__content=None)
    row = valid(adapt_openai(neither))
    assert "reasoning_content" not in row and "content" not in row


def test_timing_alternatives_and_completions() -> None:
    start_plus = variant(timing={"start": 1767225600.0, "e2e_s": 1.5})
    assert valid(adapt_openai(start_plus))["timestamp"] == 1767225601.5
    created = variant(timing={"e2e_s": 2.0})
    assert valid(adapt_openai(created))["timestamp"] == 1767225600.0  # response.created + e2e
    span = variant(timing={"started_at": "2026-01-01T00:00:00Z", "finished_at": "2026-01-01T00:00:03Z"})
    assert valid(adapt_openai(span))["e2e_s"] == 3.0
    legacy = variant(request__max_completion_tokens=None, request__max_tokens=64, response__model=None)
    assert valid(adapt_openai(legacy))["max_tokens"] == 64  # and the model from the request
    completion = variant(response__choices=[{"index": 0, "text": "done", "finish_reason": "length"}])
    row = valid(adapt_openai(completion))
    assert row["content"] == "done" and row["finish_reason"] == "length"
    vllm = variant(timing={"e2e_s": 2.0}, response__metrics={"queue_time_ms": 30.0, "time_to_first_token_ms": 120.0})
    row = valid(adapt_openai(vllm))
    assert row["queue_s"] == 0.03 and row["ttft_s"] == pytest.approx(0.15)  # scheduled-based TTFT + queue


def test_error_responses_count_as_errors_with_their_status() -> None:
    error = {"message": "KV cache transfer failed", "type": "InternalServerError", "code": 500}
    server = {"request_id": "e1", "request": {"model": "m"}, "timing": {"start": 1767225600, "e2e_s": 0.2},
              "response": {"error": error}}  # fmt: skip
    row = valid(adapt_openai(server))
    assert (row["finish_reason"], row["status_code"], row["error"]) == ("error", 500, "KV cache transfer failed")
    assert row["prompt_tokens"] == row["completion_tokens"] == 0
    client = {**server, "response": {"object": "error", "message": "too long", "code": 400}}
    assert valid(adapt_openai(client))["finish_reason"] == "other"  # the client's fault, not an engine error


@pytest.mark.parametrize(
    ("record", "reason", "words"),
    [
        ({"response": "text"}, "layout", "response must be an object"),
        ({"request": {}}, "layout", "no response"),
        (variant(timing={}, response__created=None), "missing_field", "end-to-end"),
        (variant(timing={"e2e_s": 1.0}, response__created=None), "missing_field", "finish time"),
        (variant(response__usage=None), "missing_field", "prompt_tokens"),
        (variant(response__choices=[]), "missing_field", "finish_reason"),
        (variant(response__id=None), "missing_field", "response.id"),
        (variant(timing__ttft_ms="fast"), "validation", "ttft_s"),
    ],
)
def test_openai_rejections_name_the_missing_part(record: Any, reason: str, words: str) -> None:
    rejected = adapt_openai(record)
    assert isinstance(rejected, Rejection) and rejected.reason == reason and words in rejected.error, rejected


def test_auto_tells_the_formats_apart() -> None:
    auto = adapter_for("auto")
    assert valid(auto(NATIVE))["request_id"] == "r1"
    assert valid(auto(OPENAI))["request_id"] == "chatcmpl-7"
    with pytest.raises(ValueError):
        adapter_for("mapping")
    with pytest.raises(ValueError):
        adapter_for("csv")


# -- field mapping --------------------------------------------------------------------------

KIBANA_MAPPING = {
    "request_id": "_id",
    "timestamp": "_source.@timestamp",
    "model": "_source.llm.model",
    "prompt_tokens": "_source.llm.usage.input_tokens",
    "completion_tokens": "_source.llm.usage.output_tokens",
    "e2e_s": {"path": "_source.event.duration", "scale": 1e-9},
    "ttft_s": {"path": "_source.llm.ttft_ms", "scale": 0.001},
    "finish_reason": {"path": "_source.llm.stop_reason", "map": {"end_turn": "stop", "max_tokens": "length"}},
    "route": {"value": "support-bot"},
    "instance": {"path": "_source.host.name", "default": "unknown-host"},
    "messages": "_source.llm.request.messages",
}

KIBANA_HIT: dict[str, Any] = {
    "_index": "llm-logs-2026.01.01",
    "_id": "aXk3",
    "_source": {
        "@timestamp": "2026-01-01T00:00:02.000Z",
        "llm.model": "llama-3.1-70b",  # Elasticsearch exports may flatten field names
        "llm": {
            "usage": {"input_tokens": 1200, "output_tokens": 80},
            "ttft_ms": 350,
            "stop_reason": "max_tokens",
            "request": {"messages": [{"role": "user", "content": "hi"}]},
        },
        "event": {"duration": 2_400_000_000},
    },
}


def test_a_field_mapping_reads_an_elasticsearch_export() -> None:
    mapping = FieldMapping.parse(KIBANA_MAPPING)
    row = valid(mapping.adapt(KIBANA_HIT))
    assert {k: v for k, v in row.items() if k != "prefix_hash"} == {
        "request_id": "aXk3", "timestamp": 1767225602.0, "model": "llama-3.1-70b", "prompt_tokens": 1200,
        "completion_tokens": 80, "e2e_s": 2.4, "ttft_s": 0.35, "finish_reason": "length", "route": "support-bot",
        "instance": "unknown-host",
    }  # fmt: skip
    assert row["prefix_hash"] == prefix_hash("llama-3.1-70b", "user: hi\n")
    adapter = adapter_for("mapping", mapping=mapping)
    missing = adapter({"_id": "x", "_source": {}})
    assert isinstance(missing, Rejection) and missing.reason == "missing_field" and "_source.llm.model" in missing.error
    assert isinstance(adapter([KIBANA_HIT]), Rejection)


def test_lookup_paths() -> None:
    record = {"a": {"b": [{"c": 1}, {"c": 2}]}, "x.y": {"z": 3}, "x": {"y": {"z": 4}}}
    assert lookup(record, ("a", "b", "1", "c")) == 2
    assert lookup(record, ("x", "y", "z")) == 3  # the longest key first
    assert lookup(record, ("a", "b", "7")) is lookup(record, ("nope",))


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ([], "JSON object"),
        ({**KIBANA_MAPPING, "latency": "x"}, "unknown fields"),
        ({k: v for k, v in KIBANA_MAPPING.items() if k != "model"}, "lacks required fields ['model']"),
        ({**KIBANA_MAPPING, "e2e_s": {"path": "x", "scale": -1}}, "scale"),
        ({**KIBANA_MAPPING, "e2e_s": {"path": "x", "value": 1}}, "exactly one"),
        ({**KIBANA_MAPPING, "e2e_s": {"path": "x", "unit": "ms"}}, "unknown keys"),
        ({**KIBANA_MAPPING, "e2e_s": 5}, "path string"),
        ({**KIBANA_MAPPING, "finish_reason": {"path": "x", "map": ["stop"]}}, "map"),
    ],
)
def test_a_bad_mapping_is_refused_when_loaded(spec: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        FieldMapping.parse(spec)


# -- no input crashes an adapter ------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)

#: Values that look like a record's fields, to get past the first checks often.
field_values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1767225600.5, "2026-01-01T00:00:00Z", "2026-13-01", "1767225600", "stop", "LENGTH", "vllm", ""]),
    st.text(max_size=8), json_values,
)  # fmt: skip


def mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` with some top-level and nested values replaced or removed."""
    keys = sorted(base)
    return st.builds(
        lambda changes, drops: {k: changes.get(k, v) for k, v in base.items() if k not in drops},
        st.dictionaries(st.sampled_from(keys), field_values, max_size=4),
        st.sets(st.sampled_from(keys), max_size=3),
    )


def near_openai() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda response, timing, usage, top: {**top, "response": {**response, "usage": usage}, "timing": timing},
        mutated(OPENAI["response"]), mutated(OPENAI["timing"]), mutated(OPENAI["response"]["usage"]),
        mutated({k: v for k, v in OPENAI.items() if k not in ("response", "timing")}),
    )  # fmt: skip


def check(result: Any) -> None:
    if isinstance(result, Rejection):
        assert result.reason and result.error
    else:
        RequestLog.model_validate(result)
        orjson.dumps(result)  # and it can be sent


ADAPTERS = {
    "native": adapter_for("native"),
    "openai": adapter_for("openai", AdaptOptions(keep_prompt=True)),
    "auto": adapter_for("auto", AdaptOptions(defaults={"route": "r"})),
    "mapping": adapter_for("mapping", mapping=FieldMapping.parse(KIBANA_MAPPING)),
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.one_of(json_values, mutated(NATIVE), near_openai(), mutated(KIBANA_HIT["_source"])))
def test_no_input_crashes_an_adapter(value: Any) -> None:
    """Every input yields a row RequestLog accepts, or a rejection with a reason."""
    for adapter in ADAPTERS.values():
        check(adapter(value))


@settings(max_examples=200, deadline=None)
@given(source=mutated(KIBANA_HIT["_source"]), llm=mutated(KIBANA_HIT["_source"]["llm"]))
def test_no_export_crashes_the_mapping(source: dict[str, Any], llm: dict[str, Any]) -> None:
    check(ADAPTERS["mapping"]({"_id": "x", "_source": {**source, "llm": llm}}))
