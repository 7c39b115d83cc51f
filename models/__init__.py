"""Online statistical models of servewatch (river + numpy; no Kafka, no I/O).

``REGISTRY`` lists every model that judges windows; the conformance test in
``tests/test_model_conformance.py`` runs over all of them.
"""

from models.latency import LoadConditionedLatency

REGISTRY: dict[str, type] = {
    "load_conditioned_latency": LoadConditionedLatency,
}

__all__ = ["REGISTRY", "LoadConditionedLatency"]
