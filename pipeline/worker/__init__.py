"""The worker: request logs and engine intervals in, incident events and groups out.

``create_app`` is its entry point; the stages it wires (``aggregation``, ``judging``,
``grouping_stage``) and what they build on are importable on their own, without Faust's app.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servewatch.pipeline.worker.app import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    # Imported on first use: replay and the other commands use the stages without Faust's app.
    if name == "create_app":
        from servewatch.pipeline.worker.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
