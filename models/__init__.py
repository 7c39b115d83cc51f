"""Online statistical models of servewatch (river + numpy; no Kafka, no I/O).

``REGISTRY`` lists every model that judges windows; the conformance test in
``tests/test_model_conformance.py`` runs over all of them.
"""

from servewatch.models.stats.cache_hits import CacheHitRate
from servewatch.models.stats.latency import LoadConditionedLatency
from servewatch.models.stats.rates import BetaBinomialRate
from servewatch.models.stats.series_level import SeriesLevel
from servewatch.models.stats.share import ShareLevel
from servewatch.models.stats.traffic import TrafficModel

REGISTRY: dict[str, type] = {
    "load_conditioned_latency": LoadConditionedLatency,
    "beta_binomial_rate": BetaBinomialRate,
    "share_level": ShareLevel,
    "cache_hit_rate": CacheHitRate,
    "traffic": TrafficModel,
    "series_level": SeriesLevel,
}

__all__ = [
    "REGISTRY",
    "BetaBinomialRate",
    "CacheHitRate",
    "LoadConditionedLatency",
    "SeriesLevel",
    "ShareLevel",
    "TrafficModel",
]
