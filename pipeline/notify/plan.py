"""When each sink is due to hear about each group: Alertmanager's timing, with an injected clock.

Per sink and group, as Alertmanager defines its three intervals:

- ``group_wait``: a new group waits this long before its first notification, so members
  that fire together arrive in one message;
- ``group_interval``: after a notification, a group that *changed* (a member joined, its
  severity stepped up, it resolved) waits this long before the next one;
- ``repeat_interval``: a group still firing and unchanged is notified again after this long.

A group that resolves before any sink was told of it sends nothing; one that was told is
resolved exactly once. A silence in force mutes a due notification: it is reported once
per group version (to be recorded as ``silenced``) and sent once the silence is over, if
still due. A silence never mutes the resolve of a group the sink was told is firing: a
silence hides what is new, and a muted resolve would leave the sink's page open for ever
(Alertmanager, too, sends the resolve of an alert it notified). ``due`` only plans;
``settle`` books the outcome. Both are pure functions of the state, the configuration and
``now``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from servewatch.pipeline.notify.config import NotifyConfig, SinkConfig
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.routing import labels_of, wants
from servewatch.pipeline.notify.silences import SilenceBook
from servewatch.pipeline.notify.state import GroupState, ModelState, SinkProgress
from servewatch.schemas.anomaly import Status
from servewatch.schemas.delivery import Outcome
from servewatch.schemas.silence import Silence


@dataclass(frozen=True)
class Planned:
    """A notification to send (``kind="send"``) or to record as muted (``"silenced"``)."""

    kind: Literal["send", "silenced"]
    sink: SinkConfig
    model: str
    version: int
    note: Notification
    silence: Silence | None = None


def _due_at(progress: SinkProgress, state: GroupState, status: Status, config: NotifyConfig, sink: SinkConfig) -> float:
    timing = config.timing_of(sink)
    if progress.sent_seq == 0 and progress.last_sent_at is None:
        return progress.first_seen + timing.group_wait
    last = progress.last_sent_at or progress.first_seen
    # A rejected notification books its version without a status: it is not retried until
    # the group moves again or repeat_interval passes (retrying cannot make it acceptable).
    changed = state.version > progress.sent_version or (
        progress.sent_status is not None and status is not progress.sent_status
    )
    return last + (timing.group_interval if changed else timing.repeat_interval)


def _render(template: str | None, **values: str) -> str | None:
    return None if template is None else template.format_map(values)


def due(
    state: ModelState,
    config: NotifyConfig,
    silences: SilenceBook,
    now: float,
    in_flight: frozenset[tuple[str, str]] = frozenset(),
) -> list[Planned]:
    """What is due at ``now``, oldest group first; records ``first_seen`` of new (sink, group) pairs.

    ``in_flight``: (sink name, group key) pairs whose previous notification is still being
    delivered; they wait for its outcome.
    """
    planned = []
    for key, group_state in sorted(state.groups.items(), key=lambda item: _start(item[1])):
        group = group_state.group
        if group is None:
            continue
        members = group_state.sorted_members()
        for sink in config.enabled_sinks:
            if (sink.name, key) in in_flight:
                continue
            progress = group_state.sinks.get(sink.name)
            if progress is None:
                if not wants(sink.route, group, members):
                    continue
                if group.status is Status.RESOLVED:
                    # The sink has no account of a group that is over. Over within its
                    # group_wait: it was never told, so nothing to resolve. Longer: its account
                    # was lost (state recovered short after a crash), and it was most likely
                    # told: a stray resolve costs little, a missing one leaves a page open.
                    if group.window_end - group.window_start <= config.timing_of(sink).group_wait:
                        continue
                    progress = SinkProgress(first_seen=now, sent_status=Status.FIRING)
                else:
                    progress = SinkProgress(first_seen=now)
                group_state.sinks[sink.name] = progress
            if progress.done:
                continue
            if group.status is Status.RESOLVED and progress.sent_status is not Status.FIRING:
                progress.done = True  # never told it fired: nothing to resolve
                continue
            if now < _due_at(progress, group_state, group.status, config, sink):
                continue
            note = Notification(
                sink=sink.name, group=group, members=tuple(members), seq=progress.sent_seq + 1, sent_at=now,
                triage_url=_render(config.triage_url, group=key, model=group.model),
                runbook_url=_render(config.runbook_url, cause=group.cause, model=group.model),
                memo=dict(progress.memo),
            )  # fmt: skip
            # A resolved group gets here only if the sink was told it is firing: no silence
            # holds that resolve back (it would leave the sink's page open).
            silence = None if group.status is Status.RESOLVED else silences.muting(labels_of(group, members), now)
            if silence is None:
                planned.append(Planned("send", sink, state.model, group_state.version, note))
            elif progress.silenced_version != group_state.version:
                progress.silenced_version = group_state.version
                planned.append(Planned("silenced", sink, state.model, group_state.version, note, silence))
        finish_if_done(state, key, now)
    return planned


def settle(state: ModelState, item: Planned, outcome: Outcome, now: float, memo: dict[str, str] | None = None) -> None:
    """Book what became of a planned send; finish the group once every sink is done with it."""
    group_state = state.groups.get(item.note.key)
    if group_state is None or (progress := group_state.sinks.get(item.sink.name)) is None:
        return
    progress.sent_version = item.version
    progress.last_sent_at = now
    if outcome == "sent":
        progress.sent_seq = item.note.seq
        progress.sent_status = item.note.status
        progress.memo.update(memo or {})
    if item.note.status is Status.RESOLVED:
        progress.done = True
    finish_if_done(state, item.note.key, now)


def finish_if_done(state: ModelState, key: str, now: float) -> None:
    group_state = state.groups.get(key)
    if group_state is None or group_state.group is None or group_state.group.status is not Status.RESOLVED:
        return
    if all(p.done or p.sent_status is not Status.FIRING for p in group_state.sinks.values()):
        state.finish(key, now)


def _start(state: GroupState) -> float:
    return state.group.window_start if state.group is not None else float("inf")
