"""The event-time contract, without a broker: records too far in the future are
dead letters and never hold offsets back; a skewed host's records are judged, or counted
late, never silently dropped; a re-sent record counts once; and every accepted record is
accounted for: accepted = judged + late + duplicates."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from servewatch.models.windows.segment_keys import is_replica_key
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.windowing import Windower
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.request_log import RequestLog

T0 = 1_767_225_600.0  # 2026-01-01


def log(request_id: str, ts: float, model: str = "m") -> dict[str, Any]:
    base = {"prompt_tokens": 300, "completion_tokens": 40, "e2e_s": 1.2, "ttft_s": 0.2, "finish_reason": "stop"}
    return RequestLog.model_validate({**base, "request_id": request_id, "timestamp": ts, "model": model}).to_row()


def test_a_future_record_is_dead_lettered_and_offsets_keep_moving() -> None:
    one = StageOne(Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0))
    wall = T0 + 40  # the records below are "now"; one is an hour ahead, one in 2099
    messages = [
        [log("a", T0 + 1), log("b", T0 + 3)],
        [log("c", T0 + 5), log("ahead", T0 + 3600), log("d", T0 + 6)],
        [log("far", 4_070_908_800.0)],  # 2099-01-01
        [log("e", T0 + 12)],
        [log("f", T0 + 25)],
    ]
    letters: list[DeadLetter] = []
    for offset, rows in enumerate(messages):
        got, _ = one.process(orjson.dumps(rows), MessageOrigin("requests", 1, offset), token=f"m{offset}", wall=wall)
        letters += got
    assert [(letter.reason, letter.record_index) for letter in letters] == [("future_timestamp", 1),
                                                                          ("future_timestamp", 0)]  # fmt: skip
    assert orjson.loads(letters[0].raw)["request_id"] == "ahead" and "SERVEWATCH_MAX_FUTURE_S" in letters[0].error
    assert letters[1].source_partition == 1 and letters[1].source_offset == 2
    # Windows T0 and T0+10 are closed (the watermark is at T0+25): every message feeding
    # them is acknowledged, the ones that held the future records included.
    assert one.safe_to_ack() == ["m0", "m1", "m2", "m3"]
    assert max(one.windower.max_event_time.values()) == T0 + 25


def test_a_simulated_clock_ahead_of_the_wall_is_not_the_future() -> None:
    """A partition's own event time is the reference too: a replay at 25x runs ahead of the
    wall clock step by step, never by a jump."""
    one = StageOne(Settings(max_lateness_s=0, max_future_s=300))
    wall = T0
    letters: list[DeadLetter] = []
    for step in range(20):  # 20 steps of 100 s: 2,000 s ahead of the wall by the end
        got, _ = one.process(orjson.dumps([log(f"r{step}", T0 + 100 * step)]), MessageOrigin("t", 0, step), wall=wall)
        letters += got
    assert letters == []


def _skewed_hosts(settings: Settings, seconds: int = 600, behind_s: float = 30.0) -> tuple[Replay, int]:
    """Host A logs on time, host B ``behind_s`` behind (its clock, or its shipper's batching),
    both into the same partition: 20 requests/s each, a message per second holding both."""
    replay = Replay(settings)
    sent = 0
    for second in range(seconds):
        rows = [log(f"a{second}-{i}", T0 + second + i / 20) for i in range(20)]
        rows += [log(f"b{second}-{i}", T0 + second + i / 20 - behind_s, model="n") for i in range(20)]
        sent += len(rows)
        replay.feed(orjson.dumps(rows), second)
    replay.finish()
    return replay, sent


def _accounted(replay: Replay) -> tuple[int, int, int]:
    return replay.stage_two.judged_records, replay.stage_two.late_records, replay.stage_one.windower.duplicates


def test_a_host_30_s_behind_is_judged_with_a_learned_lateness() -> None:
    replay, sent = _skewed_hosts(Settings())
    judged, late, duplicates = _accounted(replay)
    assert judged + late + duplicates == sent and duplicates == 0
    assert late < 0.02 * sent  # only while the lateness was being learned
    assert 30.0 <= replay.stage_one.windower.allowed_lateness <= 45.0


def test_a_backlog_ten_minutes_old_is_counted_late_and_no_window_waits_for_it() -> None:
    """Live traffic on time (a message a second, 40 requests), and halfway through one message
    of 2,000 records ten minutes old (a host's backlog, shipped at once): they are counted
    late, and the allowed lateness (how long after its end a window is judged) is back to its
    usual value within two minutes of event time; it never moves at all, in fact."""
    replay, sent, burst_at, burst = Replay(Settings()), 0, 300, 2000
    allowed: list[float] = []
    for second in range(600):
        rows = [log(f"a{second}-{i}", T0 + second + i / 40) for i in range(40)]
        if second == burst_at:
            rows += [log(f"old-{i}", T0 + second - 600.0 + i / 100) for i in range(burst)]
        sent += len(rows)
        replay.feed(orjson.dumps(rows), second)
        allowed.append(replay.stage_one.windower.allowed_lateness)
        if second == burst_at - 1:
            late_before = replay.stage_two.late_records
    late_at_burst = replay.stage_two.late_records - late_before
    replay.finish()
    judged, late, duplicates = _accounted(replay)
    assert judged + late + duplicates == sent and duplicates == 0
    assert late_at_burst >= burst and late <= burst + 40  # the backlog, and at most a second of the rest
    usual = allowed[burst_at - 1]
    assert max(allowed[burst_at + 120 :]) <= usual
    assert max(allowed) <= usual


def test_with_a_fixed_lateness_the_skewed_host_is_counted_late_not_lost() -> None:
    replay, sent = _skewed_hosts(Settings(allowed_lateness_s=1.0, max_lateness_s=0))
    judged, late, _ = _accounted(replay)
    assert judged + late == sent
    assert late > 0.4 * sent  # most of host B: every record whose window closed before it came
    letter = replay.stage_two.late_letters[0]
    where = orjson.loads(letter.raw)
    assert letter.reason == "late" and where["records"] > 0 and where["sources"][0][0] == 0


def test_a_resent_batch_counts_once_while_its_window_is_open_and_late_after() -> None:
    replay = Replay(Settings())
    batch = orjson.dumps([log(f"r{i}", T0 + i / 40) for i in range(300)])  # all in window T0
    replay.feed(batch, 0)
    replay.feed(batch, 1)  # a shipper's retry after a lost acknowledgement: window T0 still open
    replay.feed(orjson.dumps([log("later", T0 + 60)]), 2)  # closes window T0
    replay.feed(batch, 3)  # a retry after the window was judged: its ids are forgotten, it is late
    replay.finish()
    assert _accounted(replay) == (301, 300, 300)


def test_windows_older_than_a_segments_state_are_counted_as_late_not_judged() -> None:
    """A backlog older than what a restored segment already learned is not judged again: it
    is counted (``older_than_state``) and logged, and ``servewatch replay`` judges it."""
    one = StageOne(Settings())
    one.process(orjson.dumps([log(f"r{i}", T0 + i / 10) for i in range(25)]), MessageOrigin("t", 0, 0))
    (old,) = [partial for partial in one.flush_all() if not is_replica_key(partial.key)]
    two = StageTwo(Settings())
    two.bank.segment(old.key).last_window_end = T0 + 600  # as restored from the state table
    two.add(old, now=0.0)
    two.release_all()
    assert (two.judged_records, two.bank.records_skipped, two.bank.windows_skipped) == (0, 25, 1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=30), min_size=1, max_size=25))
def test_repeats_are_counted_exactly_whatever_the_batches(batches: list[list[int]]) -> None:
    """Every id after its first sighting in the window is a repeat, however the stream is cut
    into batches, and however many sorted runs the window's memory holds by then."""
    windower = Windower(Segmenter(), window_s=3600, dedup=True)
    for batch in batches:
        windower.add([log(f"r{i}", T0 + 1) for i in batch])
    every = [i for batch in batches for i in batch]
    assert windower.duplicates == len(every) - len(set(every))
    (window,) = windower.flush_all()
    assert window.requests == len(set(every))


def test_a_message_that_failed_is_acknowledged_only_after_the_earlier_ones() -> None:
    # Faust commits past an unacknowledged offset below an acknowledged one: a failed message
    # acknowledged at once would let a crash lose the earlier messages' records in open windows.
    one = StageOne(Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0))
    wall = T0 + 40
    one.process(orjson.dumps([log("a", T0 + 1)]), MessageOrigin("requests", 1, 0), token="m0", wall=wall)
    one.acknowledge_in_order(1, "m1")  # its processing raised: dead-lettered whole
    assert one.safe_to_ack() == []  # m0 still feeds the open window T0
    one.process(orjson.dumps([log("b", T0 + 25)]), MessageOrigin("requests", 1, 2), token="m2", wall=wall)
    assert one.safe_to_ack() == ["m0", "m1"]


def test_a_message_read_again_after_its_window_was_sent_is_a_duplicate_not_a_second_partial() -> None:
    """The broker frozen past the group's session timeout: the worker rejoins and is handed its
    partitions again at their committed offsets, behind what it had read and, since, sent (the
    window closed as the partition went idle). Folded again, the re-read records would make a
    second partial of that window, together with records read since, which stage 2 drops
    whole as a replay: those records were lost. Re-read, a message is counted and let go."""
    one = StageOne(Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0, topic_partitions=2))
    first = orjson.dumps([log(f"a{i}", T0 + i / 10) for i in range(20)])
    one.process(first, MessageOrigin("requests", 0, 0), now=0.0, token="m0")
    sent = one.flush_idle(now=10_000.0)  # quiet for long: the window goes, as it does at an idle flush
    assert sum(int(p.requests) for p in sent if not is_replica_key(p.key)) == 20 and one.safe_to_ack() == ["m0"]
    one.process(
        first, MessageOrigin("requests", 0, 0), now=10_000.0, token="m0 again"
    )  # the seek to the committed offset
    one.process(
        orjson.dumps([log("b", T0 + 5)]), MessageOrigin("requests", 0, 1), now=10_000.0, token="m1"
    )  # read since
    (partial,) = [p for p in one.flush_idle(now=20_000.0) if not is_replica_key(p.key)]
    assert (partial.requests, partial.sources) == (1, [(0, 1, 1)])  # its own record only: not a replay
    assert one.redelivered == 20 and one.safe_to_ack() == ["m0 again", "m1"]


def test_a_partition_taken_over_holds_the_windows_while_its_records_are_unread() -> None:
    """Partition 1 taken over from a crashed worker, its backlog not fetched yet: silent, but
    the consumer knows records wait there. Taken for idle after ``idle_flush_s``, the window
    would go without them and they would be late; it is held for ``assembler_max_wait_s``."""
    config = Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0, topic_partitions=2)

    def sent_at(now: float, unread: set[int]) -> int:
        one = StageOne(config)
        one.take_over({0, 1}, now=0.0)
        one.process(orjson.dumps([log(f"a{i}", T0 + i / 10) for i in range(20)]), MessageOrigin("requests", 0, 0),
                    now=0.0, token="m0")  # fmt: skip
        one.process(orjson.dumps([log("b", T0 + 15)]), MessageOrigin("requests", 0, 1), now=now, token="m1")
        return sum(int(p.requests) for p in one.flush_idle(now=now, unread=unread) if not is_replica_key(p.key))

    idle_s, max_wait_s = config.windows.idle_flush_s, config.windows.assembler_max_wait_s
    assert sent_at(idle_s, unread=set()) == 20  # nothing left to read: partition 1 is idle
    assert sent_at(idle_s, unread={1}) == 0  # records wait there: the window waits for them
    assert sent_at(max_wait_s - 1, unread={1}) == 0
    assert sent_at(max_wait_s, unread={1}) == 20  # a read stuck that long: judged without it


def test_partials_read_again_when_their_partition_comes_back_are_replays_not_judged_twice() -> None:
    """A partials partition revoked and handed back to the same worker at its committed offset
    (the group lost while the broker was frozen): the windows it released are known still, so
    the partials read again are replays, neither judged again nor counted late."""
    config = Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0, topic_partitions=1)
    one, two = StageOne(config), StageTwo(config)
    one.process(orjson.dumps([log(f"r{i}", T0 + i / 10) for i in range(25)]), MessageOrigin("requests", 0, 0))
    _, partials = one.process(orjson.dumps([log("later", T0 + 25)]), MessageOrigin("requests", 0, 1))
    bundles = one.bundles(partials, 1)
    for via, bundle in bundles:
        two.receive(bundle, via, now=0.0, token="m0")
    assert two.judged_records == 25
    two.hand_over({0})
    assert two.unacked == {}
    for via, bundle in bundles:  # read again from the committed offset
        two.receive(bundle, via, now=1.0, token="m0 again")
    assert two.judged_records == 25 and two.bank.windows_skipped == 0
    assert two.assembler.duplicate_partials == len(partials) and two.assembler.late_partials == 0


def test_a_partials_message_is_let_go_once_its_windows_are_judged_and_in_stored_state() -> None:
    """A worker killed while a window waits in stage 2 for another partition, or before a quiet
    segment's state was stored, must read that window's partials again: their message is
    acknowledged only once both are done."""
    config = Settings(
        window_s=10, allowed_lateness_s=0, max_lateness_s=0, topic_partitions=2, state_every_windows=3,
        compare_replicas=False,  # one partials partition holds the window
    )  # fmt: skip
    one, two = StageOne(config), StageTwo(config)
    one.process(orjson.dumps([log(f"r{i}", T0 + i / 10) for i in range(25)]), MessageOrigin("requests", 0, 0))
    _, partials = one.process(orjson.dumps([log("later", T0 + 25)]), MessageOrigin("requests", 0, 1))
    for n, (via, bundle) in enumerate(one.bundles(partials, 2)):
        two.receive(bundle, via, now=0.0, token=f"m{n}")
    ((via, fed),) = [(via, token) for via, held in two.unacked.items() for token, until in held if until > T0]
    two.bank.states_to_save(every_one=True)
    assert two.judged_records == 0 and fed not in two.judged_and_stored()  # T0 waits for partition 1

    two.heartbeat(1, T0 + 25, via, now=0.0)
    two.release_due(now=0.0)
    assert two.judged_records == 25
    assert two.bank.states_to_save() == []  # judged once: not due (every 3 windows)
    assert fed not in two.judged_and_stored()  # so a crash now would lose what it taught
    # No more partials: once quiet for idle_flush_s, the segments judged last are stored.
    assert not two.quiet(now=config.windows.idle_flush_s / 2) and two.quiet(now=config.windows.idle_flush_s)
    assert [key for key, _ in two.bank.states_to_save(unsaved=True)] == [partials[0].key]
    assert two.judged_and_stored() == [fed]


def test_a_segment_gone_quiet_is_stored_and_holds_no_acknowledgement_back() -> None:
    config = Settings(window_s=10, allowed_lateness_s=0, max_lateness_s=0, topic_partitions=1, state_every_windows=3)
    one, two = StageOne(config), StageTwo(config)
    batches = [[log(f"a{i}", T0 + i / 10, model="quiet") for i in range(25)]]
    batches += [[log(f"b{w}-{i}", T0 + 10 * w + i / 10, model="busy") for i in range(25)] for w in range(10)]
    stored_until = []
    for offset, batch in enumerate(batches):
        _, partials = one.process(orjson.dumps(batch), MessageOrigin("requests", 0, offset))
        for via, bundle in one.bundles(partials, 1):
            two.receive(bundle, via, now=0.0)
        two.bank.states_to_save()
        stored_until.append(two.bank.stored_until())
    # The quiet segment's one window holds stored_until at T0 until it is 2 x 3 windows old.
    assert stored_until[2:6] == [T0] * 4 and stored_until[-1] > T0 + 30
