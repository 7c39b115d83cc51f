"""Replay of fixed workloads gives the same events, id for id, and the same incident groups.

A refactor of the worker's stages, the decoding or the event path must not change what a
replay publishes. A change that is meant to (a model, a threshold, the wording of an id) updates
the recorded file on purpose, in the same commit, by running this module:

    .venv/bin/python -m tests.test_replay_golden
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.dev.scenarios import BY_NAME, run_scenario
from servewatch.pipeline.messages.decode import read_incident_event

RECORDED = Path(__file__).with_name("golden") / "replay_events.json"
#: Scenarios whose replay is recorded: rates read from answer text with evidence read back
#: (truncation, leaked reasoning markers), and real arrivals through slot-limited engines with
#: the prefix cache switched off (latencies conditioned on load, the cache's own test).
WORKLOADS = (("truncation", 7), ("trace_cache_off", 7))


def published(name: str, seed: int) -> dict[str, Any]:
    """What a replay of the scenario publishes: each event's identity and each group record."""
    result = run_scenario(BY_NAME[name], seed)
    grouper, groups = IncidentGrouper(), []
    events = []
    for event in result.events:
        event, told = grouper.add(event)
        events.append([event.id, event.status.value, event.severity.value, event.group, len(event.evidence)])
        groups += [[record.group, record.transition, record.severity.value] for record in told]
    return {"records": result.records, "events": events, "groups": groups}


def record_all() -> dict[str, Any]:
    return {f"{name}/{seed}": published(name, seed) for name, seed in WORKLOADS}


@pytest.mark.parametrize(("name", "seed"), WORKLOADS)
def test_a_replay_publishes_what_it_published_before(name: str, seed: int) -> None:
    recorded = json.loads(RECORDED.read_text())[f"{name}/{seed}"]
    now = published(name, seed)
    assert now["records"] == recorded["records"]
    assert now["events"] == recorded["events"]
    assert now["groups"] == recorded["groups"]


def _one_line_each(text: str) -> str:
    """Innermost lists on one line: an event or a group record a line, for readable diffs."""
    return re.sub(r"\[\n\s+([^\[\]{}]*?)\n\s+\]", lambda m: "[" + re.sub(r",\n\s+", ", ", m.group(1)) + "]", text)


def test_every_event_a_replay_publishes_reads_back_byte_for_byte() -> None:
    """What the grouping stage reads off the incidents topic is what was written: re-encoded,
    each real event (evidence, facets, hints, floats) gives the same bytes."""
    events = run_scenario(BY_NAME["truncation"], 7).events
    assert events
    for event in events:
        raw = event.model_dump_json().encode()
        assert read_incident_event(raw).model_dump_json().encode() == raw


if __name__ == "__main__":
    RECORDED.write_text(_one_line_each(json.dumps(record_all(), indent=1)) + "\n")
    print(f"recorded {RECORDED}")
