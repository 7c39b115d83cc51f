"""The notifier's timing and bookkeeping (pipeline/notify/plan.py, state.py), with a fake clock."""

from __future__ import annotations

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.notify.config import parse_config
from servewatch.pipeline.notify.plan import Planned, due, settle
from servewatch.pipeline.notify.silences import SilenceBook
from servewatch.pipeline.notify.state import ModelState
from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.incident_group import IncidentGroup
from servewatch.schemas.silence import Matcher, Silence

CONFIG = parse_config(
    """
defaults: {group_wait: 30s, group_interval: 5m, repeat_interval: 4h}
sinks:
  - {name: chat, type: slack, url: "http://127.0.0.1:1/x", route: {min_severity: info}}
  - {name: pager, type: pagerduty, routing_key: k, url: "http://127.0.0.1:1/y", route: {min_severity: critical}}
""",
    ".yaml",
    environ={},
)


def incident(fp: str, route: str, *, status: str = "firing", transition: str = "firing", end: float = 10.0,
             severity: Severity = Severity.WARNING, explained: bool = False) -> AnomalyEvent:  # fmt: skip
    return AnomalyEvent(
        id=f"{fp}:{transition}:{end}", fingerprint=fp, status=Status(status), transition=transition,  # type: ignore[arg-type]
        signal=Signal.TTFT, segment={"model": "m", "route": route}, window_start=end - 10, window_end=end,
        observed=2.0, expected=1.0, score=6.0, severity=severity, load={"requests_per_s": 3.0},
        explained_by_load=explained, hints=[Hint(code="prefix_cache_ineffective", message="hit rate fell")],
        summary=f"TTFT up on {route}",
    )  # fmt: skip


class Feed:
    """Incidents through the real grouper into one model's notifier state."""

    def __init__(self) -> None:
        self.grouper = IncidentGrouper()
        self.state = ModelState(model="m")
        self.records: list[AnomalyEvent | IncidentGroup] = []

    def add(self, event: AnomalyEvent) -> None:
        grouped, told = self.grouper.add(event)
        for record in (grouped, *told):
            self.records.append(record)
            self.state.apply(record)


def deliver(state: ModelState, planned: list[Planned], now: float) -> list[tuple[str, str, int]]:
    for item in planned:
        if item.kind == "send":
            settle(state, item, "sent", now)
    return [(p.sink.name, p.note.status.value, p.note.seq) for p in planned if p.kind == "send"]


def test_group_wait_then_one_message_for_members_that_fire_together() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    assert due(feed.state, CONFIG, SilenceBook(), now=1000.0) == []  # group_wait starts
    feed.add(incident("b", "rag", end=20.0))
    planned = due(feed.state, CONFIG, SilenceBook(), now=1030.0)
    assert [(p.sink.name, len(p.note.members), p.note.group.segments) for p in planned] == [("chat", 2, 2)]


def test_changes_wait_group_interval_and_quiet_groups_repeat_interval() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    assert deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=30.0), 30.0) == [("chat", "firing", 1)]
    feed.add(incident("b", "rag", end=20.0))  # a member joins: the group changed
    assert due(feed.state, CONFIG, SilenceBook(), now=300.0) == []
    assert deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=330.0), 330.0) == [("chat", "firing", 2)]
    assert due(feed.state, CONFIG, SilenceBook(), now=330.0 + 3600) == []
    assert deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), 330.0 + 4 * 3600), 0) == [("chat", "firing", 3)]


def test_resolved_once_after_firing_and_then_forgotten() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=30.0), 30.0)
    feed.add(incident("a", "chat", status="resolved", transition="resolved", end=60.0))
    sent = deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=330.0), 330.0)
    assert sent == [("chat", "resolved", 2)]
    assert feed.state.groups == {} and len(feed.state.done) == 1
    for record in feed.records:  # a replay after a crash changes nothing and pages nobody
        assert not feed.state.apply(record)
    assert due(feed.state, CONFIG, SilenceBook(), now=10_000.0) == []


def test_a_group_that_resolves_within_group_wait_sends_nothing() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    feed.add(incident("a", "chat", status="resolved", transition="resolved", end=20.0))
    assert due(feed.state, CONFIG, SilenceBook(), now=100.0) == []
    assert feed.state.groups == {}


def test_routes_by_severity_and_a_severity_step_reaches_the_pager() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    assert deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=30.0), 30.0) == [("chat", "firing", 1)]
    feed.add(incident("a", "chat", transition="update", end=20.0, severity=Severity.CRITICAL))
    due(feed.state, CONFIG, SilenceBook(), now=40.0)  # the pager first wants the group now: its group_wait
    assert deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=70.0), 70.0) == [("pager", "firing", 1)]
    assert [p.sink.name for p in due(feed.state, CONFIG, SilenceBook(), now=330.0)] == ["chat"]  # changed


def test_a_silence_mutes_once_per_version_and_the_group_is_sent_when_it_ends() -> None:
    feed = Feed()
    book = SilenceBook()
    book.apply(Silence(id="maint", matchers=[Matcher(name="model", value="m")], starts_at=0.0, ends_at=100.0))
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, book, now=0.0)
    first = due(feed.state, CONFIG, book, now=30.0)
    assert [(p.kind, p.silence.id if p.silence else None) for p in first] == [("silenced", "maint")]
    assert due(feed.state, CONFIG, book, now=60.0) == []  # recorded once, not every tick
    assert [p.kind for p in due(feed.state, CONFIG, book, now=100.0)] == ["send"]


def test_explained_by_load_routes_to_a_sink_that_asks_for_it_only() -> None:
    config = parse_config(
        """
sinks:
  - {name: fyi, type: slack, url: "http://x", route: {min_severity: info, explained_by_load: true}}
  - {name: real, type: slack, url: "http://y", route: {min_severity: info, explained_by_load: false}}
""",
        ".yaml",
        environ={},
    )
    feed = Feed()
    feed.add(incident("a", "chat", severity=Severity.INFO, explained=True))
    due(feed.state, config, SilenceBook(), now=0.0)
    assert [p.sink.name for p in due(feed.state, config, SilenceBook(), now=30.0)] == ["fyi"]


def test_state_round_trips_through_json_with_what_was_sent() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    planned = due(feed.state, CONFIG, SilenceBook(), now=30.0)
    settle(feed.state, planned[0], "sent", 31.0, memo={"ts": "1.0001"})
    again = ModelState.model_validate_json(feed.state.model_dump_json())
    assert again == feed.state
    assert due(again, CONFIG, SilenceBook(), now=32.0) == []  # nothing sent twice after a restart
    progress = next(iter(again.groups.values())).sinks["chat"]
    assert (progress.sent_seq, progress.memo) == (1, {"ts": "1.0001"})


def test_in_flight_pairs_wait_for_their_outcome() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    planned = due(feed.state, CONFIG, SilenceBook(), now=30.0)
    key = planned[0].note.key
    assert due(feed.state, CONFIG, SilenceBook(), now=31.0, in_flight=frozenset({("chat", key)})) == []


def test_a_sink_with_no_account_of_a_long_group_still_gets_its_resolve() -> None:
    """State recovered short after a crash: the resolve goes out rather than leave a page open."""
    feed = Feed()
    feed.add(incident("a", "chat", end=10.0))
    feed.add(incident("a", "chat", status="resolved", transition="resolved", end=100.0))
    lost = ModelState(model="m")  # a notifier whose stored account lost the firing it sent
    for record in feed.records:
        lost.apply(record)
    due(lost, CONFIG, SilenceBook(), now=0.0)
    sent = deliver(lost, due(lost, CONFIG, SilenceBook(), now=300.0), 300.0)
    assert sent == [("chat", "resolved", 1)]


def maintenance(starts_at: float, ends_at: float = 100_000.0) -> SilenceBook:
    book = SilenceBook()
    book.apply(Silence(id="maint", matchers=[Matcher(name="model", value="m")], starts_at=starts_at, ends_at=ends_at))
    return book


def test_a_silence_added_after_the_firing_went_out_never_holds_back_its_resolve() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    assert deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=30.0), 30.0) == [("chat", "firing", 1)]
    book = maintenance(starts_at=100.0)  # the silence comes in while the page is open
    feed.add(incident("a", "chat", status="resolved", transition="resolved", end=60.0))
    planned = due(feed.state, CONFIG, book, now=330.0)
    assert [(p.kind, p.silence) for p in planned] == [("send", None)]
    assert deliver(feed.state, planned, 330.0) == [("chat", "resolved", 2)]
    assert feed.state.groups == {}  # done with, as without the silence


def test_a_group_silenced_from_the_start_sends_nothing_when_it_resolves() -> None:
    feed = Feed()
    book = maintenance(starts_at=0.0)
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, book, now=0.0)
    assert [p.kind for p in due(feed.state, CONFIG, book, now=30.0)] == ["silenced"]
    feed.add(incident("a", "chat", status="resolved", transition="resolved", end=60.0))
    assert due(feed.state, CONFIG, book, now=330.0) == []  # never told it fired: nothing to resolve
    assert feed.state.groups == {}
    assert due(feed.state, CONFIG, SilenceBook(), now=1000.0) == []  # nor once the silence is over


def test_a_severity_step_during_a_silence_stays_muted_and_the_resolve_reaches_only_who_was_told() -> None:
    feed = Feed()
    feed.add(incident("a", "chat"))
    due(feed.state, CONFIG, SilenceBook(), now=0.0)
    assert deliver(feed.state, due(feed.state, CONFIG, SilenceBook(), now=30.0), 30.0) == [("chat", "firing", 1)]
    book = maintenance(starts_at=100.0)
    feed.add(incident("a", "chat", transition="update", end=20.0, severity=Severity.CRITICAL))
    due(feed.state, CONFIG, book, now=200.0)  # the pager first wants the group now
    muted = due(feed.state, CONFIG, book, now=330.0)  # chat: group_interval; pager: group_wait
    assert sorted((p.kind, p.sink.name, p.note.status.value) for p in muted) == [
        ("silenced", "chat", "firing"),
        ("silenced", "pager", "firing"),
    ]
    assert due(feed.state, CONFIG, book, now=400.0) == []  # muted once per version, not every tick
    feed.add(incident("a", "chat", status="resolved", transition="resolved", end=60.0))
    planned = due(feed.state, CONFIG, book, now=700.0)
    assert deliver(feed.state, planned, 700.0) == [("chat", "resolved", 2)]  # the pager was never told
    assert feed.state.groups == {}
