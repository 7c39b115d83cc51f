"""All of servewatch's knobs: read once from ``SERVEWATCH_*`` variables, grouped by concern.

``Settings`` holds one of each group (``pipeline.setting_groups``): ``settings.kafka.broker``,
``settings.windows.window_s``, ``settings.ship.batch_records``... A command reads the groups
it needs. Each setting has one name, its variable's without ``SERVEWATCH_`` in lower case
(``window_s``, ``ship_batch_records``): ``Settings(window_s=5)`` and ``updated(broker=...)``
take those names, as the environment does, and put each value in its group.
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.models.explain.evidence_sample import EvidenceBudget
from servewatch.models.windows.segment_keys import REPLICA_PREFIX
from servewatch.models.windows.segments import Segmenter
from servewatch.pipeline.setting_groups import (
    ChangeSettings,
    DeliverySettings,
    DetectionSettings,
    EvidenceSettings,
    GrafanaSettings,
    KafkaSettings,
    LoadgenSettings,
    ProcessSettings,
    ReplicaSettings,
    SegmentSettings,
    ShipSettings,
    WebSettings,
    WindowSettings,
    _Group,
)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    process: ProcessSettings = Field(default_factory=ProcessSettings)
    windows: WindowSettings = Field(default_factory=WindowSettings)
    segments: SegmentSettings = Field(default_factory=SegmentSettings)
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    detection: DetectionSettings = Field(default_factory=DetectionSettings)
    evidence: EvidenceSettings = Field(default_factory=EvidenceSettings)
    changes: ChangeSettings = Field(default_factory=ChangeSettings)
    delivery: DeliverySettings = Field(default_factory=DeliverySettings)
    ship: ShipSettings = Field(default_factory=ShipSettings)
    web: WebSettings = Field(default_factory=WebSettings)
    grafana: GrafanaSettings = Field(default_factory=GrafanaSettings)
    loadgen: LoadgenSettings = Field(default_factory=LoadgenSettings)

    @model_validator(mode="before")
    @classmethod
    def _read_each_group(cls, data: Any) -> Any:
        """Each group read from the environment, with the values given by their one name on
        top; a bad value names its setting's one name (``ship_batch_records``)."""
        if not isinstance(data, dict):
            return data
        given: dict[str, dict[str, Any]] = {attr: {} for attr in GROUPS}
        built: dict[str, Any] = {}
        for name, value in data.items():
            if name in GROUPS:
                built[name] = value
            elif name in NAMES:
                attr, field = NAMES[name]
                given[attr][field] = value
            else:
                built[name] = value  # refused below as an unknown field
        for attr, group in GROUPS.items():
            if attr in built:
                continue
            try:
                built[attr] = group(**given[attr])
            except ValidationError as exc:
                raise _named(exc, _prefix(group)) from None
        return built

    def updated(self, **values: Any) -> Settings:
        """A copy with ``values`` (by their one name) in their groups, validated."""
        groups: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            attr, field = NAMES[name]
            groups.setdefault(attr, {})[field] = value
        update = {
            attr: type(getattr(self, attr)).model_validate({**getattr(self, attr).model_dump(), **fields})
            for attr, fields in groups.items()
        }
        return self.model_copy(update=update)

    def segmenter(self) -> Segmenter:
        segments = self.segments
        return Segmenter(
            dimensions=tuple(segments.segment_dimensions),
            prompt_band_edges=tuple(segments.prompt_band_edges),
            output_band_edges=tuple(segments.output_band_edges),
            max_segments=segments.max_segments,
            idle_s=segments.segment_idle_s,
        )

    def replica_segmenter(self) -> Segmenter | None:
        """The segmenter of replica rows (segment and instance), or None when not compared
        (off, or the segments are per instance already)."""
        segments, replicas = self.segments, self.replicas
        if not replicas.compare_replicas or "instance" in segments.segment_dimensions:
            return None
        return Segmenter(
            dimensions=(*segments.segment_dimensions, "instance"),
            prompt_band_edges=tuple(segments.prompt_band_edges),
            output_band_edges=tuple(segments.output_band_edges),
            max_segments=replicas.max_replica_rows,
            idle_s=segments.segment_idle_s,
            key_prefix=REPLICA_PREFIX,
        )

    def evidence_budget(self) -> EvidenceBudget:
        evidence = self.evidence
        uniform = min(evidence.evidence_uniform, evidence.evidence_per_window)
        return EvidenceBudget(
            worst=evidence.evidence_per_window - uniform,
            uniform=uniform,
            baseline=evidence.evidence_baseline,
            excerpt_chars=evidence.excerpt_chars,
            markers=tuple(self.detection.reasoning_markers),
        )

    def detector_config(self) -> DetectorConfig:
        detection, segments, replicas = self.detection, self.segments, self.replicas
        return DetectorConfig(
            threshold=detection.threshold,
            critical=detection.critical,
            min_requests=detection.min_requests,
            fire_after=detection.fire_after,
            fire_within=detection.fire_within,
            resolve_after=detection.resolve_after,
            update_every=detection.update_every,
            grace_windows=detection.grace_windows,
            no_data_after_s=segments.no_data_after_s,
            segment_idle_s=segments.segment_idle_s,
            replica_min_ratio=replicas.replica_min_ratio,
            replica_warmup_requests=replicas.replica_warmup_requests,
        )


#: Each group, by the attribute ``Settings`` holds it in (its fields, read once here).
GROUPS: dict[str, type[_Group]] = {
    attr: cast(type[_Group], field.annotation) for attr, field in Settings.model_fields.items()
}


def _prefix(group: type[_Group]) -> str:
    """What a group's field names get in front in their one name (``ship_`` for the shipper's)."""
    return str(group.model_config.get("env_prefix", "SERVEWATCH_")).removeprefix("SERVEWATCH_").lower()


#: Every setting's one name (its variable's, without ``SERVEWATCH_``) -> (group, field).
NAMES: dict[str, tuple[str, str]] = {
    _prefix(group) + field: (attr, field) for attr, group in GROUPS.items() for field in group.model_fields
}


def variable_names() -> frozenset[str]:
    """Every ``SERVEWATCH_*`` variable a setting is read from."""
    return frozenset(f"SERVEWATCH_{name.upper()}" for name in NAMES)


def _named(exc: ValidationError, prefix: str) -> ValidationError:
    """``exc`` with each error at its setting's one name, as the environment spells it."""
    errors: list[Any] = []
    for error in exc.errors():
        loc = error["loc"]
        named = (prefix + str(loc[0]), *loc[1:]) if loc else ()
        errors.append({**error, "loc": named})
    return ValidationError.from_exception_data("Settings", errors)
