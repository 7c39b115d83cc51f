"""Per-segment gauges: values as judged, removed with their segment, one series per segment and signal."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from servewatch.pipeline.worker.segment_metrics import forget_segment, record_points, segment_label
from servewatch.schemas.series import SeriesPoint, SignalPoint

GAUGES = (
    "servewatch_segment_observed",
    "servewatch_segment_expected",
    "servewatch_segment_band_low",
    "servewatch_segment_band_high",
    "servewatch_segment_score",
    "servewatch_segment_firing",
)


def signal(observed: float, *, low: float | None = 0.1, high: float | None = 0.9, firing: bool = False) -> SignalPoint:
    return SignalPoint(observed=observed, expected=0.5, low=low, high=high, score=2.0, anomalous=firing, firing=firing)


def point(key: str, signals: dict[str, SignalPoint]) -> SeriesPoint:
    labels = dict(part.split("=", 1) for part in key.split("|"))
    return SeriesPoint(
        key=key, segment=labels, window_start=0.0, window_end=10.0, load={"requests_per_s": 5.0}, signals=signals
    )


def samples(name: str, model: str = "segtest") -> dict[tuple[str, str], float]:
    """(segment, signal) -> value of a gauge's series for ``model``."""
    return {
        (s.labels["segment"], s.labels["signal"]): s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == name and s.labels.get("model") == model
    }


KEYS = [f"model=segtest|route=r{i}|prompt_band=<4k" for i in range(3)]


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    yield
    for key in [*KEYS, "model=segtest"]:
        forget_segment(key)


def test_segment_label_drops_the_model_part() -> None:
    assert segment_label("model=m|route=chat|output_band=<1k") == "route=chat|output_band=<1k"
    assert segment_label("model=m") == "all"
    assert segment_label("model=other|segment=overflow") == "segment=overflow"


def test_values_are_set() -> None:
    record_points([point(KEYS[0], {"ttft": signal(0.7, firing=True), "itl": signal(0.02, low=None, high=0.05)})])
    segment = "route=r0|prompt_band=<4k"
    assert samples("servewatch_segment_observed") == {(segment, "ttft"): 0.7, (segment, "itl"): 0.02}
    assert samples("servewatch_segment_expected") == {(segment, "ttft"): 0.5, (segment, "itl"): 0.5}
    assert samples("servewatch_segment_score") == {(segment, "ttft"): 2.0, (segment, "itl"): 2.0}
    assert samples("servewatch_segment_firing") == {(segment, "ttft"): 1.0, (segment, "itl"): 0.0}
    assert samples("servewatch_segment_band_low") == {(segment, "ttft"): 0.1}  # itl has no lower bound
    assert samples("servewatch_segment_band_high") == {(segment, "ttft"): 0.9, (segment, "itl"): 0.05}


def test_later_points_win_and_a_vanished_band_is_removed() -> None:
    record_points([point(KEYS[0], {"ttft": signal(0.7, firing=True)})])
    record_points([point(KEYS[0], {"ttft": signal(0.4, low=None, high=None)})])
    assert samples("servewatch_segment_observed") == {("route=r0|prompt_band=<4k", "ttft"): 0.4}
    assert samples("servewatch_segment_firing") == {("route=r0|prompt_band=<4k", "ttft"): 0.0}
    assert samples("servewatch_segment_band_low") == {}
    assert samples("servewatch_segment_band_high") == {}


def test_model_only_key() -> None:
    record_points([point("model=segtest", {"ttft": signal(1.0)})])
    assert samples("servewatch_segment_observed") == {("all", "ttft"): 1.0}


def test_forget_removes_every_series_of_the_segment() -> None:
    record_points([point(key, {"ttft": signal(0.7), "itl": signal(0.02)}) for key in KEYS[:2]])
    forget_segment(KEYS[0])
    for name in GAUGES:
        assert {segment for segment, _ in samples(name)} == {"route=r1|prompt_band=<4k"}, name
    forget_segment(KEYS[0])  # twice, or a segment never recorded: nothing to do
    forget_segment("model=segtest|route=never")


def test_no_label_explosion() -> None:
    """3 segments × 2 signals = 6 series per gauge, however many windows were judged."""
    for window in range(50):
        record_points([point(key, {"ttft": signal(window / 50), "itl": signal(0.02)}) for key in KEYS])
    for name in GAUGES:
        assert len(samples(name)) == 6, name
    for key in KEYS:
        forget_segment(key)
    for name in GAUGES:
        assert samples(name) == {}, name
