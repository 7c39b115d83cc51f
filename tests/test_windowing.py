"""Stage 1 / stage 2 windowing: partials add up, watermarks decide, replays are idempotent."""

from __future__ import annotations

import collections
import math
import random
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servewatch.models.stats.sketch import LogHistogram
from servewatch.models.windows import segments
from servewatch.models.windows.batch import RowBatch
from servewatch.models.windows.open_window import OpenWindow, aggregate_rows, fold_batch
from servewatch.models.windows.segment_keys import DIMENSIONS, OVERFLOW_KEY
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.window import WindowStats
from servewatch.models.windows.windowing import WindowAssembler, Windower
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.schemas.request_log import RequestLog

T0 = 1_767_225_600.0


def log(i: int, ts: float, ttft: float = 0.2, **extra: object) -> dict[str, Any]:
    """A validated row, as the decoder hands them to stage 1."""
    base = {"model": "m", "prompt_tokens": 100, "completion_tokens": 10, "e2e_s": 1.0, "finish_reason": "stop"}
    return RequestLog.model_validate({**base, "request_id": f"r{i}", "timestamp": ts, "ttft_s": ttft, **extra}).to_row()


def test_histogram_quantiles_within_bucket_error() -> None:
    import numpy as np

    values = np.random.default_rng(0).lognormal(0, 1, 10_000)
    hist = LogHistogram()
    hist.add(values)
    for q in (0.5, 0.9, 0.99):
        assert abs(hist.quantile(q) / np.quantile(values, q) - 1) < 0.08


def test_histogram_sparse_round_trip_and_rejects_garbage() -> None:
    hist = LogHistogram()
    hist.add(__import__("numpy").array([0.01, 1.0, 1e9, 0.0]))
    again = LogHistogram.from_sparse({str(k): v for k, v in hist.to_sparse().items()})
    assert (again.counts == hist.counts).all()
    for bad in ({"-1": 1}, {"100000": 1}, {"3": -2}):
        try:
            LogHistogram.from_sparse(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad}")


def test_segment_cap_sends_new_combinations_to_overflow() -> None:
    seg = Segmenter(max_segments=3)
    keys = {seg.key_for(model=f"m{i}", prompt_tokens=10, output_tokens=10) for i in range(10)}
    assert OVERFLOW_KEY in keys and len(keys) == 4
    assert seg.overflowed == 7 and seg.live_segments == 3


def test_windower_closes_on_watermark_only() -> None:
    w = Windower(Segmenter(), window_s=10, allowed_lateness_s=5)
    w.add([log(1, T0 + 1), log(2, T0 + 12)], partition=0, offset=0)
    assert w.close_due() == []  # watermark T0+7 < first window end T0+10
    w.add([log(3, T0 + 16)], partition=0, offset=1)
    closed = w.close_due()
    assert [(p.start, p.requests, p.sources) for p in closed] == [(T0, 1, [(0, 0, 0)])]
    assert closed[0].watermark == T0 + 11


def test_partial_merge_equals_single_pass_and_survives_json() -> None:
    records = [log(i, T0 + i % 10, ttft=0.1 + i / 100) for i in range(40)]
    seg = Segmenter()
    [whole] = aggregate_rows(records, seg, 10.0)
    parts = [aggregate_rows(records[i::3], seg, 10.0)[0] for i in range(3)]
    merged = WindowStats.from_dict(orjson.loads(orjson.dumps(parts[0].to_dict())))
    for p in parts[1:]:
        merged.merge(WindowStats.from_dict(orjson.loads(orjson.dumps(p.to_dict()))))
    assert merged.requests == whole.requests == 40
    assert merged.ttft_count == whole.ttft_count == 40
    assert [merged.ttft_quantile(q) for q in (0.1, 0.5, 0.95)] == [whole.ttft_quantile(q) for q in (0.1, 0.5, 0.95)]
    # Same slowest requests (each part saw its records at other positions of its own message).
    assert [r.ttft_s for r in merged.kept_requests()] == [r.ttft_s for r in whole.kept_requests()]
    assert merged.kept_requests()[0].ttft_s == max(r["ttft_s"] for r in records)
    assert merged.finish_reasons == {"stop": 40} and merged.errors == 0


def test_assembler_drops_duplicates_and_counts_late_partials() -> None:
    a = WindowAssembler(max_wait_s=10)
    p = WindowStats(key="k", start=T0, length=10, requests=5, sources=[(0, 0, 9)])
    a.add(p, now=0.0)
    a.add(WindowStats.from_dict(p.to_dict()), now=0.1)  # replayed after a crash: same offsets
    assert a.duplicate_partials == 1
    a.heartbeat(source=0, watermark=T0 + 10, now=0.2)
    [released] = a.due(now=0.2)
    assert released.requests == 5
    a.add(WindowStats(key="k", start=T0, length=10, requests=1, sources=[(1, 0, 0)]), now=0.3)
    assert a.late_partials == 1
    # Re-read after a rebalance, once the window was judged: a duplicate still, not late.
    a.add(WindowStats.from_dict(p.to_dict()), now=0.4)
    assert (a.duplicate_partials, a.late_partials) == (2, 1)
    # Records read after the window was judged (offsets beyond its own): late.
    a.add(WindowStats(key="k", start=T0, length=10, requests=2, sources=[(0, 10, 11)]), now=0.5)
    assert a.late_partials == 2


def test_assembler_waits_for_every_expected_partition() -> None:
    a = WindowAssembler(max_wait_s=10, expected_partitions=2)
    a.add(WindowStats(key="k", start=T0, length=10, requests=1, sources=[(0, 0, 0)]), now=0.0)
    a.heartbeat(source=0, watermark=T0 + 20, now=0.0)
    assert a.due(now=1.0) == []  # partition 1 has not spoken yet
    a.add(WindowStats(key="k", start=T0, length=10, requests=2, sources=[(1, 0, 0)]), now=1.0)
    a.heartbeat(source=1, watermark=T0 + 20, now=1.0)
    [window] = a.due(now=1.0)
    assert window.requests == 3
    a.add(WindowStats(key="k", start=T0 + 10, length=10, requests=1, sources=[(0, 1, 1)]), now=2.0)
    assert [w.start for w in a.due(now=12.5)] == [T0 + 10]  # max_wait releases whatever is missing


def test_a_restarted_silence_keeps_waiting_for_sources_the_broker_held_back() -> None:
    """Two sources went quiet together for 40 s (the broker did not answer). Measured through
    that, both count as idle, and the first partial of a window after it is released alone."""

    def after_the_pause(restart: bool) -> list[int]:
        a = WindowAssembler(max_wait_s=30)
        for source in (0, 1):
            a.heartbeat(source=source, watermark=T0 + 5, now=0.0)
        if restart:
            a.restart_silence(now=40.0)
        a.add(WindowStats(key="k", start=T0, length=10, requests=3, sources=[(0, 0, 2)]), now=40.0)
        released = [int(w.requests) for w in a.due(now=40.5)]
        for source in (0, 1):
            a.add(WindowStats(key="k", start=T0, length=10, requests=4, sources=[(source, 3, 6)]), now=41.0)
            a.heartbeat(source=source, watermark=T0 + 20, now=41.0)
        return released + [int(w.requests) for w in a.due(now=41.0)] + [a.late_partials]

    assert after_the_pause(restart=False) == [3, 2]  # released alone; the rest late
    assert after_the_pause(restart=True) == [11, 0]  # the sources' partials came, merged


def test_shuffled_delivery_loses_no_partial() -> None:
    """Two stages over 4 partitions with bundles delivered in random interleavings, as Kafka may."""
    settings = Settings(topic_partitions=4)
    one, two = StageOne(settings), StageTwo(settings)
    judged: list[int] = []  # requests per judged window
    observe = two.bank.observe
    two.bank.observe = lambda window, *rest: (judged.append(window.requests), observe(window, *rest))[1]  # type: ignore[method-assign]
    rng = random.Random(1)
    queues: dict[int, collections.deque[bytes]] = collections.defaultdict(collections.deque)
    offsets: collections.Counter[int] = collections.Counter()
    sent, now = 0, 0.0
    for _, batch in Workload((Phase("normal", 300),), seed=3).seconds():
        if not batch:
            continue
        sent += len(batch)
        p = rng.randrange(4)
        _, partials = one.process(orjson.dumps(batch), MessageOrigin("t", p, offsets[p]), now=now)
        offsets[p] += 1
        for k, bundle in one.bundles(partials, 4):
            queues[k].append(bundle)
        now += 0.05
        for _ in range(rng.randrange(12)):
            k = rng.randrange(4)
            if queues[k]:
                two.receive(queues[k].popleft(), via=k, now=now)
    assert judged, "windows are judged while data flows, not only at the end"
    for k, bundle in one.bundles(one.flush_all(), 4):
        queues[k].append(bundle)
    for k in range(4):
        while queues[k]:
            two.receive(queues[k].popleft(), via=k, now=now)
    two.release_all()
    assert two.assembler.late_partials == 0
    assert sum(judged) == sent > 5_000


def test_messages_are_acknowledged_only_after_their_windows_are_sent() -> None:
    """At-least-once: a message's offset may be committed only once every window it fed is released."""
    one = StageOne(Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0))
    batch = lambda *ts: orjson.dumps([log(i, t) for i, t in enumerate(ts)])  # noqa: E731
    one.process(batch(T0 + 1, T0 + 11), MessageOrigin("t", 0, 0), token="m0")  # feeds windows T0 and T0+10
    one.process(batch(T0 + 12), MessageOrigin("t", 0, 1), token="m1")  # closes T0 only
    assert one.safe_to_ack() == []  # m0 still has records in the open window T0+10
    one.process(batch(T0 + 25), MessageOrigin("t", 0, 2), token="m2")  # closes T0+10
    assert one.safe_to_ack() == ["m0", "m1"]
    one.flush_all()
    assert one.safe_to_ack() == ["m2"]


def _closed_windows(settings: Settings, messages: list[tuple[int, bytes]]) -> list[tuple[object, ...]]:
    """Every partial stage 1 sends for ``messages`` (partition, raw), with when it was sent."""
    one, offsets, out = StageOne(settings), collections.Counter[int](), []

    def seen(step: int, partials: list[WindowStats]) -> list[tuple[object, ...]]:
        return [
            (step, p.start, p.key, p.requests, round(p.ttft_sum, 9), p.sources, p.kept_requests()) for p in partials
        ]

    for step, (partition, raw) in enumerate(messages):
        _, partials = one.process(raw, MessageOrigin("t", partition, offsets[partition]), now=float(step))
        offsets[partition] += 1
        out += seen(step, partials)
    return out + seen(-1, one.flush_all())


def test_folding_many_messages_at_once_sends_what_folding_each_would() -> None:
    """Stage 1 folds decoded messages in one pass per few thousand records, yet every window
    closes after the same message, with the same sums, sources and evidence."""
    rng = random.Random(5)
    messages = []
    for _, batch in Workload((Phase("normal", 95),), seed=11).seconds():
        for start in range(0, len(batch), 7):
            messages.append((rng.randrange(3), orjson.dumps(batch[start : start + 7])))
    assert len(messages) > 300
    each = _closed_windows(Settings(fold_records=1, allowed_lateness_s=2, max_lateness_s=0), messages)
    batched = _closed_windows(Settings(fold_records=400, allowed_lateness_s=2, max_lateness_s=0), messages)
    assert len({row[1] for row in each}) >= 9 and batched == each


def test_unfolded_messages_are_not_acknowledged() -> None:
    one = StageOne(Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0, fold_records=100))
    one.process(orjson.dumps([log(0, T0 + 1)]), MessageOrigin("t", 0, 0), token="m0")  # first of its partition: folded
    one.process(orjson.dumps([log(1, T0 + 2)]), MessageOrigin("t", 0, 1), token="m1")  # same window: waits
    assert one.pending_records == 1 and one.oldest_pending_offset == {0: 1}
    one.process(orjson.dumps([log(2, T0 + 13)]), MessageOrigin("t", 0, 2), token="m2")  # next window: folds, closes T0
    assert one.pending_records == 0 and one.safe_to_ack() == ["m0", "m1"]


def test_columnar_aggregation_counts_what_a_record_by_record_reading_would() -> None:
    rows = [
        log(0, T0 + 1, ttft=0.5, cached_tokens=60, finish_reason="STOP"),
        log(1, T0 + 2, ttft=0.1, finish_reason="length"),
        log(2, T0 + 3, ttft=0.3, finish_reason="abort"),
        log(3, T0 + 4, ttft=0.2, status_code=503, finish_reason="weird-engine-value"),
        log(4, T0 + 14, ttft=0.9, route="rag", prompt_tokens=9000),
    ]
    partials = aggregate_rows(rows, Segmenter(), 10.0, evidence_k=2)
    assert [(p.start, p.key, p.requests) for p in partials] == [
        (T0, "model=m|route=-|prompt_band=<4k|output_band=<1k", 4),
        (T0 + 10, "model=m|route=rag|prompt_band=4k-32k|output_band=<1k", 1),
    ]
    first = partials[0]
    assert first.finish_reasons == {"stop": 1, "length": 1, "abort": 1, "other": 1}
    assert first.errors == 2  # abort, and a 503
    assert (first.cached_tokens, first.cache_reported_prompt_tokens, first.uncached_prompt_tokens) == (60, 100, 340)
    # Evidence by reference: the slowest two, as positions in the batch (r0 and r2).
    assert [r.location.index for r in first.kept_requests()] == [0, 2]
    assert first.ttft_count == 4 and first.e2e_sum == 4.0


def test_vectorised_segment_ids_agree_with_key_for() -> None:
    import numpy as np

    rows = [log(i, T0, route=r, prompt_tokens=p) for i, (r, p) in enumerate([("a", 10), ("b", 5000), ("a", 40000)])]
    seg = Segmenter()
    labels = {"model": [r["model"] for r in rows], "route": [r["route"] for r in rows]}
    ids = seg.ids_for_columns(labels, np.array([10, 5000, 40000]), np.array([10, 10, 10]))
    expected = [Segmenter().key_for(model="m", route=r["route"], prompt_tokens=r["prompt_tokens"], output_tokens=10)
                for r in rows]  # fmt: skip
    assert [seg.keys[i] for i in ids] == expected
    assert ids[0] == seg.ids_for_columns({"model": ["m"], "route": [" a "]}, np.array([1]), np.array([1]))[0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "model": st.sampled_from(["m", "n|x", "100%"]),
                "prompt_tokens": st.sampled_from([0, 1, 4095, 4096, 4097, 32767, 32768, 90_000]),
                "completion_tokens": st.sampled_from([0, 1023, 1024, 5000]),
                "route": st.sampled_from([None, "", " chat ", "chat", "a|b"]),
                "tenant": st.sampled_from([None, "t"]),
                "instance": st.sampled_from([None, "10.0.0.1:8000"]),
                "engine": st.sampled_from([None, "vllm"]),
            }
        ),
        max_size=40,
    ),
    st.sampled_from([("model", "route", "prompt_band", "output_band"), DIMENSIONS]),
)
def test_a_remembered_row_key_is_the_key_built_afresh(rows: list[dict[str, Any]], dimensions: tuple[str, ...]) -> None:
    """``key_of_row`` remembers keys by labels and bands; every one is what ``natural_key`` builds."""
    seg = Segmenter(dimensions=dimensions, max_segments=2)  # a bound of 8 remembered keys: some are forgotten
    for row in rows + rows:
        built = seg.natural_key(model=row["model"], prompt_tokens=row["prompt_tokens"],
                                output_tokens=row["completion_tokens"], route=row["route"], tenant=row["tenant"],
                                instance=row["instance"], engine=row["engine"])  # fmt: skip
        assert seg.key_of_row(row) == built
    assert len(seg._row_keys) <= 8


def test_only_requests_that_name_their_instance_make_replica_rows() -> None:
    """A replica row compares instances: requests of no instance (or a blank one) make none,
    and a window whose requests name none has no replica table at all."""
    windower = Windower(Segmenter(), window_s=10, allowed_lateness_s=0, replicas=Settings().replica_segmenter())
    named = [log(i, T0 + i, instance="10.0.0.1:8000") for i in range(3)]
    unnamed = [log(10 + i, T0 + i) for i in range(3)]
    unnamed[1]["instance"], unnamed[2]["instance"] = "", "  "  # blank: as a shipper might send it
    windower.add(unnamed + named, 0, 7)
    windower.add([log(20, T0 + 11)], 0, 8)  # a window of no instance, and the watermark past the first
    windower.add([log(21, T0 + 25)], 0, 9)
    closed = windower.close_due()
    replica_rows = [
        (p.start, p.key.split("instance=")[1].split("|")[0], p.requests) for p in closed if p.key.startswith("~")
    ]
    assert replica_rows == [(T0, "10.0.0.1:8000", 3)]
    assert [p.requests for p in closed if not p.key.startswith("~")] == [6, 1]
    assert [p.sources for p in closed if p.key.startswith("~")] == [[(0, 7, 7)]]
    assert windower.replicas is not None and len(windower.replicas.keys) == 1  # nor a replica segment for them


def test_narrow_histograms_widen_before_they_overflow() -> None:
    """Open windows count TTFT buckets in 8 bits while segments are small (most of a live
    segment's memory), and widen as a segment's requests grow; no count is ever lost."""
    seg = Segmenter()
    windows: dict[float, OpenWindow] = {}
    fold_batch(RowBatch([log(i, T0 + 1, ttft=0.25) for i in range(200)]), seg, 10.0, windows)
    assert windows[T0].block.hist.dtype == np.uint8
    rows = [log(i, T0 + 1, ttft=0.25) for i in range(40_000)]
    fold_batch(RowBatch(rows), seg, 10.0, windows)
    assert windows[T0].block.hist.dtype == np.uint16
    fold_batch(RowBatch(rows), seg, 10.0, windows)
    assert windows[T0].block.hist.dtype == np.int32
    [partial] = windows[T0].partials(seg.keys)
    assert partial.ttft_count == 80_200 and partial.requests == 80_200
    assert partial.finish_reasons == {"stop": 80_200}
    small = aggregate_rows([log(i, T0 + 2, ttft=0.25) for i in range(250)], seg, 10.0)[0]
    small.merge(aggregate_rows([log(i, T0 + 2, ttft=0.25) for i in range(250)], seg, 10.0)[0])  # merging widens too
    assert small.ttft_count == 500 and small.finish_reasons == {"stop": 500}
    big = aggregate_rows(rows, seg, 10.0)[0]  # 16-bit counts
    small.merge(big)  # into 8-bit ones
    assert small.ttft_count == 40_500 and small.block.hist.dtype == np.uint16


def test_partitions_share_windows_that_close_when_the_slowest_has_passed() -> None:
    """One open window per worker, not per partition: one partial per segment window, with
    every partition's offsets, closed only when no partition can still add to it."""
    w = Windower(Segmenter(), window_s=10, allowed_lateness_s=0)
    w.add([log(1, T0 + 1)], partition=0, offset=0)
    w.add([log(2, T0 + 2)], partition=1, offset=7)
    w.add([log(3, T0 + 12)], partition=0, offset=1)
    assert w.close_due() == []  # partition 1 may still send records of the first window
    w.add([log(4, T0 + 11)], partition=1, offset=8)
    [closed] = w.close_due()
    assert closed.requests == 2 and closed.sources == [(0, 0, 0), (1, 7, 7)]
    assert sorted(r.location.partition for r in closed.kept_requests()) == [0, 1]
    w.add([log(5, T0 + 25)], partition=0, offset=2)
    assert w.close_due() == []  # partition 1 is quiet at T0+11
    assert [p.start for p in w.advance_idle(20.0, partition=1)] == [T0 + 10]  # silence moves it on
    w.forget({1})  # handed to another worker: no longer holds windows back
    assert w.watermark == T0 + 25


@pytest.mark.parametrize("rows", [300, 12_000])  # 12,000 distinct rows overflow int64 mixing: the tuple path
def test_vectorised_segment_ids_match_keys_row_by_row(rows: int) -> None:
    rng = random.Random(rows)
    dims = ("model", "route", "tenant", "instance", "engine", "prompt_band", "output_band")
    seg, reference = Segmenter(dimensions=dims, max_segments=50_000), Segmenter(dimensions=dims, max_segments=50_000)
    distinct = rows > 1000
    labels = {
        "model": [f"m{i}" if distinct else f"m{rng.randrange(3)}" for i in range(rows)],
        "route": [f"r{i}" if distinct else rng.choice(["chat", "rag", None, " chat ", "a|b"]) for i in range(rows)],
        "tenant": [f"t{i}" if distinct else rng.choice(["x", None]) for i in range(rows)],
        "instance": [f"i{i}" if distinct else "10.0.0.1:8000" for i in range(rows)],
        "engine": [f"e{i}" if distinct else rng.choice(["vllm", "sglang"]) for i in range(rows)],
    }
    prompt = np.array([rng.choice([10, 5000, 40000]) for _ in range(rows)])
    output = np.array([rng.choice([10, 2000]) for _ in range(rows)])
    ids = seg.ids_for_columns(labels, prompt, output)
    for row in range(0, rows, max(rows // 300, 1)):
        expected = reference.key_for(
            model=labels["model"][row].strip(), route=(labels["route"][row] or "").strip() or None,
            tenant=labels["tenant"][row], instance=labels["instance"][row], engine=labels["engine"][row],
            prompt_tokens=int(prompt[row]), output_tokens=int(output[row]),
        )  # fmt: skip
        assert seg.keys[ids[row]] == expected


def test_many_possible_combinations_few_met_take_the_vectorised_map() -> None:
    """Routes times tenants: hundreds of millions of possible combinations, a table of 4 bytes
    each would take a gigabyte. The segmenter keeps only the combinations met (12 bytes each),
    and maps every row as ``key_for`` does."""
    rng = random.Random(11)
    dims = ("model", "route", "tenant", "prompt_band", "output_band")
    seg, reference = Segmenter(dimensions=dims, max_segments=5_000), Segmenter(dimensions=dims, max_segments=5_000)
    n = 3_000
    tenants = [f"t{rng.randrange(n)}" for _ in range(n)]
    labels = {"model": ["m"] * n, "route": [f"r{i}" for i in range(n)], "tenant": tenants}
    prompt, output = np.full(n, 10), np.full(n, 10)
    ids = seg.ids_for_columns(labels, prompt, output)
    assert math.prod(seg._lookup_of[1]) > 1 << 28  # possible combinations
    assert len(seg._lookup) == n and seg._lookup.nbytes == 12 * n  # met ones
    for row in range(0, n, 7):
        expected = reference.key_for(
            model="m", route=labels["route"][row], tenant=labels["tenant"][row], prompt_tokens=10, output_tokens=10
        )
        assert seg.keys[ids[row]] == expected
    again = seg.ids_for_columns(labels, prompt, output)  # from the map: no Python per row
    assert again.tolist() == ids.tolist() and len(seg.keys) == n


@pytest.mark.parametrize("mixed", [True, False], ids=["mixed codes", "per distinct row"])
def test_an_idle_segment_back_in_a_batch_keeps_its_id_from_a_new_key_in_the_same_batch(
    mixed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new route doubles the routes seen, so every combination is met afresh; the batch
    brings back a segment idle long enough to be reclaimed and a new key past the cap. The
    new key must not take the returning segment's id, which its rows were just given."""
    if not mixed:
        monkeypatch.setattr(segments, "_MIXED_MAX", 0)  # as with more combinations than an int64 holds
    seg = Segmenter(max_segments=2, idle_s=600.0)
    ten = np.full(1, 10)
    first = seg.ids_for_columns({"model": ["m"], "route": ["r0"]}, ten, ten)
    second = seg.ids_for_columns({"model": ["m"], "route": ["r1"]}, ten, ten)
    seg.note_seen(first.tolist() + second.tolist(), 10.0)
    seg.note_seen(first.tolist(), 900.0)  # r1 silent for 890 s: idle, its id free to take
    three = np.full(2, 10)
    ids = seg.ids_for_columns({"model": ["m", "m"], "route": ["r1", "r2"]}, three, three)
    assert [seg.keys[i] for i in ids] == [
        "model=m|route=r1|prompt_band=<4k|output_band=<1k",
        "model=other|segment=overflow",  # the cap is full and nobody else is idle
    ]
    assert seg.reclaimed == 0


def test_segment_ids_stay_right_across_batches_as_label_values_arrive_and_codes_start_over() -> None:
    """The lookup table of label combinations is kept between batches: it must follow new
    label values (new radices) and a start-over of the label codes (a new generation)."""
    rng = random.Random(5)
    seg, reference = Segmenter(max_segments=10_000), Segmenter(max_segments=10_000)
    seg._label_codes.max_values = 8  # start over often
    generations = set()
    for batch in range(40):
        n = 50
        labels = {
            "model": [f"m{rng.randrange(batch // 4 + 1)}" for _ in range(n)],
            "route": [rng.choice(["chat", "rag", None, f"r{batch % 5}"]) for _ in range(n)],
        }
        prompt = np.array([rng.choice([10, 5000, 40000]) for _ in range(n)])
        output = np.array([rng.choice([10, 2000]) for _ in range(n)])
        ids = seg.ids_for_columns(labels, prompt, output)
        generations.add(seg._label_codes.generation)
        expected = [
            reference.key_for(model=labels["model"][i], route=labels["route"][i],
                              prompt_tokens=int(prompt[i]), output_tokens=int(output[i]))
            for i in range(n)
        ]  # fmt: skip
        assert [seg.keys[i] for i in ids] == expected
    assert len(generations) > 1


def test_fold_agrees_with_plain_python_sums_across_windows_and_missing_fields() -> None:
    """The vectorised fold (bincount per column over slots) against a per-record reference,
    on a batch spanning several windows with optional fields missing at random."""
    import collections
    import math

    rng = random.Random(3)
    rows = []
    for i in range(3000):
        e2e = rng.uniform(0.1, 5)
        row = log(i, T0 + rng.uniform(0, 30), ttft=e2e / 10, model=rng.choice(["a", "b"]),
                  route=rng.choice(["chat", "rag", None]),
                  prompt_tokens=rng.choice([100, 5000, 40000]), completion_tokens=rng.randint(1, 2000), e2e_s=e2e,
                  finish_reason=rng.choice(["stop", "length", "error"]))  # fmt: skip
        for name, value, share in (("ttft_s", e2e / 10, 0.7), ("queue_s", 0.01, 0.5), ("status_code", 503, 0.2)):
            row.pop(name, None)
            if rng.random() < share:
                row[name] = value
        row["cached_tokens"] = row["prompt_tokens"] // 2 if rng.random() < 0.5 else None
        rows.append(row)
    seg = Segmenter()
    expected: dict[tuple[str, float], collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in rows:
        key = seg.key_for(model=r["model"], route=r.get("route"), prompt_tokens=r["prompt_tokens"],
                          output_tokens=r["completion_tokens"])  # fmt: skip
        sums = expected[(key, math.floor(r["timestamp"] / 10) * 10.0)]
        sums["requests"] += 1
        sums["prompt_tokens"] += r["prompt_tokens"]
        sums["cached_tokens"] += r["cached_tokens"] or 0
        sums["errors"] += r["finish_reason"] == "error" or r.get("status_code", 0) >= 500
        sums["ttft_count"] += "ttft_s" in r
    partials = aggregate_rows(rows, seg, 10.0)
    assert len(partials) == len(expected)
    for p in partials:
        got = {"requests": p.requests, "prompt_tokens": p.prompt_tokens, "cached_tokens": p.cached_tokens,
               "errors": p.errors, "ttft_count": p.ttft_count}  # fmt: skip
        assert got == {name: expected[(p.key, p.start)][name] for name in got}, p.key


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    records=st.integers(1, 300),
    windows=st.integers(1, 8),
    evidence_k=st.sampled_from([0, 1, 3]),
)
def test_a_batch_spanning_windows_folds_as_its_windows_folded_one_by_one(
    seed: int, records: int, windows: int, evidence_k: int
) -> None:
    """A replayed file's batch spans many windows, and is counted for all of them at once: every
    table (sums, histograms, finish reasons, evidence, replica rows) holds what folding each
    window's records on its own gives, to the last bit."""
    rng = random.Random(seed)
    rows = []
    for i in range(records):
        row = log(i, T0 + rng.uniform(0, 10 * windows), ttft=min(rng.lognormvariate(-1, 1), 1.0),
                  model=rng.choice("ab"), route=rng.choice(["chat", "rag"]),
                  prompt_tokens=rng.choice([100, 5000, 40000]),
                  completion_tokens=rng.randint(1, 3000), e2e_s=rng.uniform(1, 40), cached_tokens=rng.choice([0, 50]),
                  finish_reason=rng.choice(["stop", "length", "error", "abort"]))  # fmt: skip
        row["instance"] = rng.choice(["10.0.0.1:8000", "10.0.0.2:8000", "", None])  # blank: as a shipper might send it
        if rng.random() < 0.2:
            del row["ttft_s"]
        rows.append(row)

    def tables(batches: list[RowBatch]) -> dict[tuple[float, str], tuple[Any, ...]]:
        main, replicas = Segmenter(), Settings().replica_segmenter()
        # Segments met in the same order either way: a window's rows follow their segment ids,
        # and its model totals add its rows in that order.
        fold_batch(RowBatch(rows), main, 10.0, {}, also=[(replicas, {})])
        into: dict[float, OpenWindow] = {}
        replica_windows: dict[float, OpenWindow] = {}
        for batch in batches:
            fold_batch(batch, main, 10.0, into, evidence_k=evidence_k, also=[(replicas, replica_windows)])
        out = {}
        for seg, opened in ((main, into), (replicas, replica_windows)):
            for window in opened.values():
                for p in window.partials(seg.keys):
                    b, r = p.block, p.row
                    out[(p.start, p.key)] = (b.sums[r].tobytes(), b.hist[r].tolist(), b.reasons[r].tolist(),
                                             b.evidence_ttft[r].tobytes(), b.evidence_at[r].tobytes())  # fmt: skip
        return out

    positions = np.arange(len(rows))
    window_of = np.floor(np.array([r["timestamp"] for r in rows]) / 10.0)
    one_by_one = [
        RowBatch([rows[i] for i in picked], positions[picked])
        for w in np.unique(window_of)
        if len(picked := np.flatnonzero(window_of == w))
    ]
    assert tables([RowBatch(rows, positions)]) == tables(one_by_one)


def test_a_partial_re_read_with_new_records_is_neither_merged_nor_lost() -> None:
    """A successor re-reading from older offsets folds records its window merged already
    together with new ones: merging would count the first twice, dropping it as a replay
    would lose the second. It is counted apart and dead-lettered with its ranges."""
    two = StageTwo(Settings())
    two.add(WindowStats(key="k", start=T0, length=10, requests=10, sources=[(0, 0, 4)]), now=0.0)
    two.add(WindowStats(key="k", start=T0, length=10, requests=6, sources=[(0, 5, 7)]), now=0.0)
    # Every offset merged already, across two partials: a replay.
    two.add(WindowStats(key="k", start=T0, length=10, requests=16, sources=[(0, 0, 7)]), now=0.1)
    assert (two.assembler.duplicate_partials, two.assembler.overlapping_partials) == (1, 0)
    # Offsets 0-7 again with 8-9 new: neither merged nor dropped silently.
    two.add(WindowStats(key="k", start=T0, length=10, requests=20, sources=[(0, 0, 9)]), now=0.2)
    assert two.assembler.overlapping_partials == 1 and two.late_records == 20
    [letter] = two.late_letters
    assert letter.reason == "partly_merged" and orjson.loads(letter.raw)["sources"] == [[0, 0, 9]]
    # Records from another partition are new: merged.
    two.add(WindowStats(key="k", start=T0, length=10, requests=3, sources=[(1, 0, 2)]), now=0.3)
    [window] = two.assembler.flush_all()
    assert window.requests == 19
