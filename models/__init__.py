"""Online statistical models of servewatch (river + numpy; no Kafka, no I/O).

``REGISTRY`` lists every model that judges windows; the conformance test in
``tests/test_model_conformance.py`` runs over all of them.
"""

from models.cache_hits import CacheHitRate
from models.latency import LoadConditionedLatency
from models.rates import BetaBinomialRate
from models.share import ShareLevel
from models.traffic import TrafficModel

REGISTRY: dict[str, type] = {
    "load_conditioned_latency": LoadConditionedLatency,
    "beta_binomial_rate": BetaBinomialRate,
    "share_level": ShareLevel,
    "cache_hit_rate": CacheHitRate,
    "traffic": TrafficModel,
}

__all__ = ["REGISTRY", "BetaBinomialRate", "CacheHitRate", "LoadConditionedLatency", "ShareLevel", "TrafficModel"]
