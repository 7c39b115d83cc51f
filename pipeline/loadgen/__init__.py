"""The load generator: a workload profile's requests against an OpenAI-compatible
server, streamed and measured client-side (``client``), with text of the right length and
shared prefixes (``prompts``), at a rate or up a concurrency ramp (``run``)."""

from servewatch.pipeline.loadgen.client import Outcome, Target
from servewatch.pipeline.loadgen.run import LoadGenerator, RampReport, RunSummary

__all__ = ["LoadGenerator", "Outcome", "RampReport", "RunSummary", "Target"]
