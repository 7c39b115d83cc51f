"""Pages an on-call keeps: load is told as load, and lost capacity still pages.

A burst of arrivals beyond what the engines can serve builds a queue that lengthens TTFT,
queue time and end-to-end time in every segment of the model. That is capacity to plan, told
once as an ``info`` group that never pages. The same queue at the usual arrivals, with half
of every engine's slots gone, is a fault: it pages, as ``capacity_lost``. Both run real
arrival traces (Mooncake) through slot-limited engines, through the worker's code and the
grouping agent's.
"""

from __future__ import annotations

import orjson
import pytest

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.pipeline.dev.serving_sim import CHAT_MODEL, SimPhase, TraceWorkload
from servewatch.pipeline.replay.request_logs import Replay
from servewatch.schemas.incident_group import IncidentGroup

NORMAL_S = 1800.0


def grouped(injected: SimPhase, seed: int) -> tuple[TraceWorkload, dict[str, list[IncidentGroup]]]:
    """The chat model's traffic with ``injected`` after half an hour, each group's records."""
    workload = TraceWorkload((SimPhase("normal", NORMAL_S), injected, SimPhase("normal", 900.0)),
                             models=(CHAT_MODEL,), seed=seed)  # fmt: skip
    batches = [orjson.dumps(batch) for _, batch in workload.seconds() if batch]
    grouper, groups = IncidentGrouper(), {}
    for event in Replay(reread=lambda n: batches[n] if 0 <= n < len(batches) else None).run(batches):
        for record in grouper.add(event)[1]:
            groups.setdefault(record.group, []).append(record)
    return workload, groups


@pytest.mark.parametrize("seed", [7, 8])
def test_a_burst_beyond_capacity_is_one_info_group_and_no_page(seed: int) -> None:
    workload, groups = grouped(SimPhase("burst", 120.0, traffic=2.5), seed)
    # The burst did overload the engines: requests waited for a slot through most of it.
    assert workload.occupancy(CHAT_MODEL.name).saturated_share(NORMAL_S, NORMAL_S + 120.0) > 0.5
    burst = [records for records in groups.values() if records[0].window_start >= workload.start + NORMAL_S - 10]
    assert len(burst) == 1, [records[-1].title for records in burst]
    assert burst[0][0].explained_by_load and burst[0][0].cause == "capacity_saturated"
    assert not any(record.pages for records in groups.values() for record in records)


@pytest.mark.parametrize("seed", [7, 8])
def test_the_same_queue_at_usual_arrivals_with_half_the_slots_gone_pages_capacity_lost(seed: int) -> None:
    workload, groups = grouped(SimPhase("half_slots", 300.0, capacity_factor=0.5), seed)
    paged = [records for records in groups.values() if any(record.pages for record in records)]
    assert [records[0].cause for records in paged] == ["capacity_lost"]
    first_page = min(record.window_end for record in paged[0] if record.pages)
    # At 60 % of the slots' demand against 50 % of them, the queue grows by a tenth of the
    # arrivals: it takes a few windows before waits stand out. Within a minute of the loss.
    assert first_page - (workload.start + NORMAL_S) <= 60.0
