"""Workload profiles: a model's real request mix from its logs (``profile``),
requests and arrival times drawn from one for ``servewatch loadgen`` (``sample``), and the
capacity a concurrency ramp finds (``knee``). Pure numpy, no I/O."""

from servewatch.models.workload.knee import KNEE_FACTOR, StepSummary, find_knee, summarise_step
from servewatch.models.workload.profile import WorkloadProfiler
from servewatch.models.workload.sample import RequestSpec, WorkloadSampler

__all__ = [
    "KNEE_FACTOR",
    "RequestSpec",
    "StepSummary",
    "WorkloadProfiler",
    "WorkloadSampler",
    "find_knee",
    "summarise_step",
]
