"""A model that goes dark pages ``traffic_drop``; a segment that goes silent with an
incident open resolves it as ``no_data``; segments idle long enough are forgotten."""

from __future__ import annotations

from collections import deque

import orjson
import pytest

from servewatch.models.detect.bank import DetectorBank
from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.pipeline.dev.simulator import EPOCH, Phase, Workload
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.messages.partitioning import partials_partition
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.schemas.anomaly import AnomalyEvent, Signal, Status

DARK = "qwen3-32b"
#: Event seconds from the start: errors begin (both models), then one model goes dark.
ERRORS_AT, DARK_AT = 1200.0, 1320.0


@pytest.fixture(scope="module")
def dark_model_events() -> list[AnomalyEvent]:
    """Two models at flat traffic; 5 % errors in both from ``ERRORS_AT``; ``DARK`` sends
    nothing from ``DARK_AT`` on, while the other goes on."""
    phases = (Phase("normal", ERRORS_AT), Phase("errors", 900, error_rate=0.05))
    workload = Workload(phases, seed=11)

    def batches() -> list[bytes]:
        out = []
        for _, batch in workload.seconds():
            kept = [r for r in batch if r["model"] != DARK or r["timestamp"] < EPOCH + DARK_AT]
            if kept:
                out.append(orjson.dumps(kept))
        return out

    # Events of the stream's drain (requests still finishing after its last second, a few
    # per window) are left out: real streams do not stop.
    end = EPOCH + workload.duration_s
    return [e for e in Replay().run(batches()) if e.window_end <= end]


def test_a_model_that_goes_dark_pages_traffic_drop(dark_model_events: list[AnomalyEvent]) -> None:
    drops = [e for e in dark_model_events if e.signal is Signal.TRAFFIC and e.pages]
    assert drops and {e.segment["model"] for e in drops} == {DARK}
    first = min(drops, key=lambda e: e.window_end)
    assert first.window_end - (EPOCH + DARK_AT) <= 40  # a few windows
    assert first.hints[0].code == "traffic_drop" and first.observed == 0
    assert not [e for e in dark_model_events if e.signal is Signal.TRAFFIC and e.segment["model"] != DARK]


def test_a_silent_segments_open_incident_resolves_as_no_data(dark_model_events: list[AnomalyEvent]) -> None:
    dark_errors = [e for e in dark_model_events if e.signal is Signal.ERROR_RATE and e.segment["model"] == DARK]
    fired = {e.fingerprint for e in dark_errors if e.status is Status.FIRING}
    ended = {e.fingerprint: e for e in dark_errors if e.status is Status.RESOLVED}
    assert fired and fired <= ended.keys()  # every incident of the dark model ended ...
    for event in ended.values():
        assert event.hints[0].code == "no_data"  # ... as no_data, not as recovered
        assert event.window_end - (EPOCH + DARK_AT) >= DetectorConfig().no_data_after_s


def test_segments_idle_for_long_are_forgotten() -> None:
    bank = DetectorBank(DetectorConfig(segment_idle_s=600.0))
    replay = Replay(Settings())
    replay.stage_two.bank = bank
    workload = Workload((Phase("normal", 900),), seed=3)
    quiet = {"route": "rag"}  # every rag segment stops after 5 minutes; chat goes on

    def keep(record: dict) -> bool:
        return record["route"] != quiet["route"] or record["timestamp"] < EPOCH + 300

    list(replay.run(orjson.dumps([r for r in b if keep(r)]) for _, b in workload.seconds()))
    assert bank.expired and all("route=rag" in key for key in bank.expired)
    assert not [key for key in bank.detectors if "route=rag" in key]


def test_an_idle_segments_id_goes_to_a_new_label_combination_not_to_the_overflow() -> None:
    from servewatch.models.windows.segment_keys import OVERFLOW_KEY
    from servewatch.models.windows.segments import Segmenter

    segmenter = Segmenter(max_segments=2, idle_s=600.0)
    a = segmenter.key_for(model="a", prompt_tokens=10, output_tokens=10)
    b = segmenter.key_for(model="b", prompt_tokens=10, output_tokens=10)
    segmenter.note_seen([0, 1], 10.0)
    assert segmenter.key_for(model="c", prompt_tokens=10, output_tokens=10) == OVERFLOW_KEY  # nobody idle yet
    segmenter.note_seen([1], 900.0)  # b goes on, a has been silent for 890 s
    c = segmenter.key_for(model="d", prompt_tokens=10, output_tokens=10)
    assert c.startswith("model=d") and segmenter.keys[0] == c and segmenter.reclaimed == 1
    assert segmenter.key_for(model="b", prompt_tokens=10, output_tokens=10) == b
    assert segmenter.key_for(model="a", prompt_tokens=10, output_tokens=10) == OVERFLOW_KEY != a  # back: full


def test_a_models_traffic_survives_a_restart_through_the_state_table() -> None:
    """What each model's traffic usually is goes to the state table with the segments', so a
    restarted worker judges a model going dark at once instead of relearning for minutes (a
    model must send once after the restart to be met: one dark all along is not)."""
    from servewatch.models.detect.traffic_watch import TrafficWatch

    config = DetectorConfig()
    before = TrafficWatch(config)
    for i in range(200):
        before.observe(10.0 * i, 10.0 * i + 10, {"m": 40 + i % 7, "n": 30})
    stored = dict(before.states())
    assert set(stored) == {"~traffic|m", "~traffic|n"}
    after = TrafficWatch(config, restore=stored.get)
    events = after.observe(2000.0, 2010.0, {"m": 44, "n": 30})  # the first window after the restart
    for i in range(201, 204):  # then "m" goes dark
        events += after.observe(10.0 * i, 10.0 * i + 10, {"n": 30})
    assert [(e.segment["model"], e.hints[0].code) for e in events if e.pages] == [("m", "traffic_drop")]
    fresh = TrafficWatch(config)  # without the stored state: a young model says nothing for minutes
    fresh.observe(2000.0, 2010.0, {"m": 44, "n": 30})
    assert not [e for i in range(201, 204) for e in fresh.observe(10.0 * i, 10.0 * i + 10, {"n": 30})]


def _judged_with_one_partition_behind(hold: tuple[float, float] | None) -> list[AnomalyEvent]:
    """A cache-off incident judged by the worker's stage 2 over two partials partitions;
    with ``hold`` (event seconds from the start), partition 1 is not read in that stretch,
    then catches up at three messages a second while partition 0 goes on live: a partition
    taken over after a crash, read minutes behind the other."""
    settings = Settings(topic_partitions=2)
    one = StageOne(settings)
    two = StageTwo(settings, via_of=lambda key: partials_partition(key, 2))
    workload = Workload((Phase("normal", 240), Phase("cache_off", 900, prefix_caching=False), Phase("normal", 300)),
                        seed=41)  # fmt: skip
    events: list[AnomalyEvent] = []
    backlog: deque[bytes] = deque()
    for offset, (second, batch) in enumerate(workload.seconds()):
        now = second - EPOCH  # read as it happens
        _, partials = one.process(orjson.dumps(batch), MessageOrigin("requests", 0, offset), now=now)
        for via, bundle in one.bundles(partials, 2):
            if via == 1 and hold is not None and (hold[0] <= now or backlog):
                backlog.append(bundle)
            else:
                events += two.receive(bundle, via=via, now=now)
        if hold is not None and now >= hold[1]:
            for _ in range(min(3, len(backlog))):
                events += two.receive(backlog.popleft(), via=1, now=now)
    return events


def test_a_partials_partition_read_minutes_behind_the_others_closes_no_incident_as_no_data() -> None:
    """Silence is measured in a segment's own stream: a partition caught up after a crash,
    minutes behind the other in event time, is not a segment gone quiet. Its open incidents
    are neither closed as ``no_data`` nor opened a second time: the events are those of the
    partitions read in step, id for id."""
    in_step = _judged_with_one_partition_behind(hold=None)
    behind = _judged_with_one_partition_behind(hold=(300.0, 300.0 + 1.2 * DetectorConfig().no_data_after_s))

    def ids(events: list[AnomalyEvent]) -> set[tuple[str, Status, float, str | None]]:
        return {(event.fingerprint, event.status, event.window_start, event.transition) for event in events}

    assert not [e for e in behind if e.status is Status.RESOLVED and e.hints and e.hints[0].code == "no_data"]
    assert any(e.transition == "firing" for e in in_step) and ids(behind) == ids(in_step)


def test_a_models_traffic_is_judged_whole_when_its_partials_partitions_release_apart() -> None:
    """A model's segments travel through several partials partitions, released apart: one a
    window behind the other must not leave a window's traffic counted from the first alone
    (``WindowAssembler.complete_until``), which reads as the model going dark where its
    segments all travel through the partitions behind. (Both partitions stay under the
    assembler's wait for a silent one: a partition silent longer is idle, and the windows go
    without it.)"""
    settings = Settings(topic_partitions=2, assembler_max_wait_s=60)
    one = StageOne(settings)
    two = StageTwo(settings, via_of=lambda key: partials_partition(key, 2))
    judged: dict[float, dict[str, int]] = {}
    observe = two.bank.traffic.observe

    def spy(start: float, end: float, counts: dict[str, int]) -> list[AnomalyEvent]:
        judged[start] = dict(counts)
        return observe(start, end, counts)

    two.bank.traffic.observe = spy  # type: ignore[method-assign]
    workload = Workload((Phase("normal", 600),), seed=12)
    truth: dict[float, dict[str, int]] = {}
    behind: deque[tuple[float, bytes]] = deque()  # partition 1's bundles, read 15 s late
    for offset, (second, batch) in enumerate(workload.seconds()):
        now = second - EPOCH
        for record in batch:
            window = truth.setdefault(10.0 * (record["timestamp"] // 10.0), {})
            window[record["model"]] = window.get(record["model"], 0) + 1
        _, partials = one.process(orjson.dumps(batch), MessageOrigin("requests", 0, offset), now=now)
        for via, bundle in one.bundles(partials, 2):
            # A watermark sent says every window ending by it was sent: none still open.
            assert all(mark <= one.windower.oldest_open_start for mark in orjson.loads(bundle)["watermarks"].values())
            if via == 1:
                behind.append((now + 15.0, bundle))
            else:
                two.receive(bundle, via=via, now=now)
        while behind and behind[0][0] <= now:
            two.receive(behind.popleft()[1], via=1, now=now)
    assert two.assembler.late_partials == 0 and len(judged) > 40
    wrong = {start - EPOCH: (judged[start], truth[start]) for start in judged if judged[start] != truth[start]}
    assert not wrong, wrong
