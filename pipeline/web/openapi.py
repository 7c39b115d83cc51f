"""The OpenAPI 3.1 description of the triage page's API (``/openapi.json``).

Scripts and other tools read the same data as the page; this says what they get. Record
shapes come from the wire formats' own JSON Schema (pydantic), so they cannot drift from
what the topics carry; the paths are written out here, and a test checks that every
``/api`` route of the app is described.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

import servewatch
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.change_marker import ChangeMarker
from servewatch.schemas.change_report import ChangeReport
from servewatch.schemas.feedback import Feedback
from servewatch.schemas.incident_group import IncidentGroup
from servewatch.schemas.series import SeriesPoint, SignalPoint

REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _query(name: str, description: str, kind: str = "string", **extra: Any) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": kind, **extra}}  # fmt: skip


def _path(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "description": description, "schema": {"type": "string"}}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


FILTERS = [
    _query("model", "only this model's records"),
    _query("signal", "only records of this signal (a group: one of its signals)"),
    _query("severity", "at least this severe", enum=["info", "warning", "critical"]),
    _query("status", "firing or resolved", enum=["firing", "resolved"]),
]
UNAUTHORIZED = {"401": {"description": "a token is set and none (or a wrong one) was given"}}


def _extra_schemas() -> dict[str, Any]:
    listed = {"type": "array", "items": _ref("Feedback")}
    return {
        "GroupView": {"allOf": [_ref("IncidentGroup"), {"type": "object", "properties": {"verdicts": listed}}]},
        "GroupDetail": {"type": "object", "properties": {
            "group": _ref("GroupView"), "members": {"type": "array", "items": _ref("AnomalyEvent")}}},
        "SegmentOverview": {"type": "object", "properties": {
            "key": {"type": "string"}, "segment": {"type": "object", "additionalProperties": {"type": "string"}},
            "window_end": {"type": "number"}, "load": {"type": "object", "additionalProperties": {"type": "number"}},
            "signals": {"type": "object", "additionalProperties": _ref("SignalPoint")},
            "sparklines": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "number"}}},
            "dashboard": {"type": ["string", "null"]}}},
        "ChangeView": {"type": "object", "properties": {
            "marker": _ref("ChangeMarker"), "report": {"anyOf": [_ref("ChangeReport"), {"type": "null"}],
                                                       "description": "the latest report, null until one"},
            "incidents": {"type": "array", "items": {"type": "string"},
                          "description": "ids of the incident events held that started soon after it"}}},
        "FeedbackRequest": {"type": "object", "required": ["verdict"], "properties": {
            "verdict": {"enum": ["expected", "not_expected", "acknowledged", "acknowledge"]},
            "comment": {"type": "string", "maxLength": 2000},
            "by": {"type": "string", "description": "who gives it, unless the credentials name a user"}}},
    }  # fmt: skip


def openapi() -> dict[str, Any]:
    kinds: tuple[type[BaseModel], ...] = (AnomalyEvent, IncidentGroup, SeriesPoint, SignalPoint, Feedback,
                                          ChangeMarker, ChangeReport)  # fmt: skip
    models: list[tuple[type[BaseModel], Literal["serialization"]]] = [(m, "serialization") for m in kinds]
    _, defs = models_json_schema(models, ref_template=REF)
    schemas = {**defs.get("$defs", {}), **_extra_schemas()}
    paths = {
        "/api/groups": {"get": {"summary": "Firing and recently resolved incident groups, newest first",
                                "parameters": FILTERS, "responses": {"200": _json({"type": "object", "properties": {
                                    "groups": {"type": "array", "items": _ref("GroupView")}}}, "the groups"),
                                    **UNAUTHORIZED}}},
        "/api/groups/{key}": {"get": {"summary": "One group with its incidents (latest event each) and verdicts",
                                      "parameters": [_path("key", "the group's key")],
                                      "responses": {"200": _json(_ref("GroupDetail"), "the group"),
                                                    "404": {"description": "no such group held"}, **UNAUTHORIZED}}},
        "/api/groups/{key}/feedback": {"post": {
            "summary": "Give a verdict on a group; written to servewatch.feedback with who and when",
            "parameters": [_path("key", "the group's key"),
                           {"name": "X-CSRF-Token", "in": "header", "required": True, "schema": {"type": "string"},
                            "description": "from the page's csrf-token meta tag or GET /api/csrf"}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("FeedbackRequest")}}},
            "responses": {"201": _json({"type": "object", "properties": {"feedback": _ref("Feedback"),
                                        "all": {"type": "array", "items": _ref("Feedback")}}}, "recorded"),
                          "400": {"description": "not a verdict, or nobody named"},
                          "403": {"description": "missing or wrong CSRF token, or a foreign Origin"},
                          "404": {"description": "no such group held"},
                          "503": {"description": "the feedback topic could not be written"}, **UNAUTHORIZED}}},
        "/api/csrf": {"get": {"summary": "The CSRF token to send with verdicts", "responses": {
            "200": _json({"type": "object", "properties": {"csrf": {"type": "string"}}}, "the token"),
            **UNAUTHORIZED}}},
        "/api/anomalies": {"get": {"summary": "Incident events, newest first", "parameters": [
            *FILTERS, _query("group", "only this group's"), _query("limit", "at most this many", "integer")],
            "responses": {"200": _json({"type": "object", "properties": {
                "anomalies": {"type": "array", "items": _ref("AnomalyEvent")}}}, "the events"), **UNAUTHORIZED}}},
        "/api/anomalies/{id}": {"get": {"summary": "One incident event", "parameters": [_path("id", "the event's id")],
                                        "responses": {"200": _json(_ref("AnomalyEvent"), "the event"),
                                                      "404": {"description": "not held"}, **UNAUTHORIZED}}},
        "/api/segments": {"get": {"summary": "Each segment's latest judged window, with sparkline values",
                                  "parameters": [FILTERS[0]], "responses": {"200": _json({"type": "object",
                                      "properties": {"segments": {"type": "array",
                                                                  "items": _ref("SegmentOverview")}}},
                                      "the segments"), **UNAUTHORIZED}}},
        "/api/series": {"get": {"summary": "A segment's judged windows (observed, expected, band, load) over time",
                                "parameters": [
                                    {**_query("key", "the segment key"), "required": True},
                                    _query("signal", "keep only this signal in each point"),
                                    _query("since", "Unix seconds (default: all held)", "number"),
                                    _query("until", "Unix seconds (default: all held)", "number")],
                                "responses": {"200": _json({"type": "object", "properties": {
                                    "key": {"type": "string"},
                                    "points": {"type": "array", "items": _ref("SeriesPoint")}}}, "the points"),
                                    "400": {"description": "a bad number"}, **UNAUTHORIZED}}},
        "/api/changes": {"get": {"summary": "Change markers, newest first, each with its latest ChangeReport",
                                 "parameters": [FILTERS[0]], "responses": {"200": _json({"type": "object",
                                     "properties": {"changes": {"type": "array", "items": _ref("ChangeView")}}},
                                     "the changes"), **UNAUTHORIZED}}},
        "/api/changes/{id}": {"get": {"summary": "One change marker with its latest ChangeReport",
                                      "parameters": [_path("id", "the marker's id")],
                                      "responses": {"200": _json(_ref("ChangeView"), "the change"),
                                                    "404": {"description": "not held"}, **UNAUTHORIZED}}},
        "/api/stream": {"get": {"summary": "Server-sent events: each message one record (its 'kind' says which)",
                                "parameters": [_query("kinds", "comma-separated kinds: group, incident, feedback, "
                                                      "series, change_marker, change_report (default: group, "
                                                      "incident, feedback)")],
                                "responses": {"200": {"description": "an event stream", "content": {
                                    "text/event-stream": {"schema": {"type": "string"}}}}, **UNAUTHORIZED}}},
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "servewatch triage API",
            "version": servewatch.__version__,
            "description": "What the triage page shows, as JSON. With a token set, send "
            "'Authorization: Bearer <token>'.",
        },
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
