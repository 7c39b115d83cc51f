"""Wire formats of servewatch (pydantic v2 only; nothing else may be imported here)."""

from pydantic import BaseModel

from servewatch.schemas.anomaly import AnomalyEvent, Hint, Severity, Signal, Status
from servewatch.schemas.change_marker import ChangeMarker, ChangeRef
from servewatch.schemas.change_report import ChangeReport
from servewatch.schemas.dead_letter import DeadLetter
from servewatch.schemas.delivery import Delivery
from servewatch.schemas.engine_interval import EngineInterval
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import GroupMember, IncidentGroup, parse_anomaly_record
from servewatch.schemas.request_log import Engine, FinishReason, RequestLog
from servewatch.schemas.series import SeriesPoint
from servewatch.schemas.silence import Silence
from servewatch.schemas.version import SCHEMA_VERSION
from servewatch.schemas.workload_profile import WorkloadProfile

#: Schemas that ``servewatch schema NAME`` exports as JSON Schema.
EXPORTED: dict[str, type[BaseModel]] = {
    "RequestLog": RequestLog,
    "AnomalyEvent": AnomalyEvent,
    "IncidentGroup": IncidentGroup,
    "EngineInterval": EngineInterval,
    "DeadLetter": DeadLetter,
    "ChangeMarker": ChangeMarker,
    "ChangeReport": ChangeReport,
    "SeriesPoint": SeriesPoint,
    "Feedback": Feedback,
    "Silence": Silence,
    "Delivery": Delivery,
    "WorkloadProfile": WorkloadProfile,
}

__all__ = [
    "EXPORTED",
    "SCHEMA_VERSION",
    "AnomalyEvent",
    "ChangeMarker",
    "ChangeRef",
    "ChangeReport",
    "DeadLetter",
    "Engine",
    "EngineInterval",
    "FinishReason",
    "GroupMember",
    "Hint",
    "IncidentGroup",
    "RequestLog",
    "Severity",
    "Signal",
    "Status",
    "WorkloadProfile",
    "parse_anomaly_record",
]
