"""On-call said "expected": the group's signals get a wider tolerance in its model for a while.

A verdict of ``expected`` on an incident group (``schemas.feedback``) means the change it
reported is known and accepted: a planned migration, a new prompt template, a load test.
Until it has had time to become the segments' normal (the models adopt a lasting level
after ``adopt_after`` windows anyway), paging on it again would be noise. So, for
``hold_s`` seconds of event time from when the verdict arrives, the group's signals in
every segment of its model are judged with the threshold and the critical level raised by
``factor`` (1.5: a surprise of 4 must reach 6 to page). Nothing is learned differently and
the incident's lifecycle is unchanged; only how surprising a window must be to count.
``not_expected`` and ``acknowledged`` change nothing here: they are for people.

>>> from servewatch.models.detect.signal_detector import DetectorConfig
>>> from servewatch.schemas.feedback import Feedback
>>> tolerances = Tolerances()
>>> tolerances.apply(Feedback(group="g", model="m", verdict="expected", signals=["ttft"], by="ann", at=0.0), now=100.0)
>>> tolerances.config_for("m", "ttft", DetectorConfig(), now=200.0).threshold
6.0
>>> tolerances.config_for("m", "itl", DetectorConfig(), now=200.0) is None
True
>>> tolerances.config_for("m", "ttft", DetectorConfig(), now=100.0 + 86_401.0) is None
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from servewatch.models.detect.signal_detector import DetectorConfig
from servewatch.schemas.feedback import Feedback


@dataclass
class Tolerances:
    factor: float = 1.5
    hold_s: float = 86_400.0
    until: dict[tuple[str, str], float] = field(default_factory=dict)  # (model, signal) -> event time

    def apply(self, feedback: Feedback, now: float) -> None:
        """Take a verdict in at event time ``now`` (only ``expected`` widens anything)."""
        if feedback.verdict != "expected":
            return
        for signal in feedback.signals:
            key = (feedback.model, signal)
            self.until[key] = max(self.until.get(key, now), now + self.hold_s)

    def config_for(self, model: str, signal: str, config: DetectorConfig, now: float) -> DetectorConfig | None:
        """The widened config for this model's signal at event time ``now``, or None."""
        until = self.until.get((model, signal))
        if until is None or now > until:
            return None
        return dataclasses.replace(config, threshold=config.threshold * self.factor,
                                   critical=config.critical * self.factor)  # fmt: skip
