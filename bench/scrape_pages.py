"""The detection bench's scrapes-only rows: a scenario's traffic as a /metrics-only fleet sees it.

The same simulated engines (``pipeline/dev/serving_sim.py``) rendered as the vLLM scrapes a
scraper would record every 10 s (``pipeline/dev/sim_scrapes.py``), replayed through the
worker's engine stage and grouped as the grouping agent does. Counted as a pager receives
it: incident groups starting to page (their first record above ``info``), inside the
injected fault and its aftermath (caught, with the windows from the fault's start to the end
of that first paging window) or outside it (false), after the detector's history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from servewatch.pipeline.dev.scenarios import Scenario
from servewatch.pipeline.dev.sim_scrapes import run_scrape_scenario
from servewatch.schemas.incident_group import IncidentGroup

WINDOW_S = 10.0


@dataclass
class ScrapeOutcome:
    """What a scenario's scrapes paged."""

    caught_after: float | None  # windows from the fault's start to its first paging group's window end
    false: list[IncidentGroup] = field(default_factory=list)
    normal_s: float = 0.0  # event seconds of normal traffic judged


def scrape_outcome(scenario: Scenario, seed: int) -> ScrapeOutcome:
    workload = scenario.build(seed)
    run = run_scrape_scenario(workload)
    start = float(workload.start)
    judged_from = start + scenario.judged_from_s
    injected_at = start + scenario.warmup_s
    fault_end = injected_at + scenario.injected_duration_s + scenario.aftermath_s
    end = start + float(workload.duration_s)

    def in_fault(group: IncidentGroup) -> bool:
        return bool(scenario.must_page) and group.window_end > injected_at and group.window_start < fault_end

    pages = [g for g in run.paging_groups if judged_from < g.window_end <= end]
    caught = [g for g in pages if in_fault(g)]
    onset = WINDOW_S * math.floor(injected_at / WINDOW_S)
    after = (min(g.window_end for g in caught) - onset) / WINDOW_S if caught else None
    fault_s = (fault_end - injected_at) if scenario.must_page else 0.0
    return ScrapeOutcome(after, [g for g in pages if not in_fault(g)], max(end - judged_from - fault_s, 0.0))
