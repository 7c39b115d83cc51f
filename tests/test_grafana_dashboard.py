"""deploy/grafana/servewatch.json queries only metrics servewatch exports, and is a well-formed dashboard.

A renamed metric would otherwise leave an empty chart that nobody notices until it is needed.
The metric names come from prometheus_client's default registry after importing every module
that defines servewatch's metrics, exposed as Prometheus sees them (a counter ``x`` is ``x_total``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

# Imported for their side effect: each registers its metrics in prometheus_client's REGISTRY.
import servewatch.pipeline.notify.delivery
import servewatch.pipeline.worker.metrics
import servewatch.pipeline.worker.segment_metrics  # noqa: F401

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "servewatch.json"

#: PromQL functions, aggregations and keywords, and Grafana's templating functions: every other
#: identifier in a query is a metric name.
FUNCTIONS = """
abs absent absent_over_time acos acosh asin asinh atan atan2 atanh avg_over_time ceil changes clamp clamp_max
clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv
double_exponential_smoothing exp floor histogram_avg histogram_count histogram_fraction histogram_quantile
histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase irate label_join label_replace
last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi predict_linear
present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort sort_by_label
sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time sum_over_time tan tanh time timestamp vector year
"""
AGGREGATIONS = "avg bottomk count count_values group limit_ratio limitk max min quantile stddev stdvar sum topk"
KEYWORDS = "and bool by end group_left group_right ignoring inf nan offset on or start unless without"
GRAFANA = "label_names label_values metrics query_result"
PROMQL = set(" ".join([FUNCTIONS, AGGREGATIONS, KEYWORDS, GRAFANA]).split())

#: Grafana's built-in variables (``$__rate_interval``...), never declared by the dashboard.
BUILTIN = re.compile(r"__\w+")


def exposed_metric_names() -> set[str]:
    """Names Prometheus scrapes from this process: counters as ``<name>_total``, gauges as their
    name, plus every sample present (labelled metrics have none until a label set is used)."""
    names = set()
    for family in REGISTRY.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type in {"gauge", "untyped", "unknown"}:
            names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def metric_names(expr: str) -> set[str]:
    """Identifiers of ``expr`` that name metrics: not in strings, label matchers, ranges,
    ``by (...)`` lists, variables or numbers, and not PromQL's own words.

    >>> sorted(metric_names('time() - max by (sink) (x_total{a=~"$v"}[$__rate_interval]) > 5m'))
    ['x_total']
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\{?\w+(?::\w+)?\}?", "", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:e[+-]?\d+|ms|[smhdwy])?\b", "", text)
    return {name for name in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text) if name not in PROMQL}


def label_values_args(query: str) -> tuple[str, str]:
    """(series selector, label) of a ``label_values(selector, label)`` variable query."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", query)
    assert match, f"not a label_values(selector, label) query: {query}"
    return match[1], match[2]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = dashboard["templating"]["list"]
    return found


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = [
        (f"panel {panel['title']!r} target {target['refId']}", target["expr"])
        for panel in all_panels(dashboard["panels"])
        for target in panel.get("targets", [])
    ]
    for variable in variables(dashboard):
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            found.append((f"variable {variable['name']}", label_values_args(query)[0]))
    return found


def test_there_are_queries_of_both_rows(dashboard: dict[str, Any]) -> None:
    named = {name for _, expr in queries(dashboard) for name in metric_names(expr)}
    assert {"servewatch_records_total", "servewatch_notifications_total", "servewatch_segment_observed"} <= named
    assert {"servewatch_segment_expected", "servewatch_segment_band_low", "servewatch_segment_band_high"} <= named


def test_every_queried_metric_exists(dashboard: dict[str, Any]) -> None:
    exposed = exposed_metric_names()
    missing, foreign = [], []
    for where, expr in queries(dashboard):
        for name in metric_names(expr):
            if not name.startswith("servewatch_"):
                foreign.append(f"{where}: {name}")
            elif name not in exposed:
                missing.append(f"{where}: {name}")
    assert not foreign, f"not servewatch metrics: {foreign}"
    assert not missing, f"servewatch exports no such metric: {missing}"


def test_panels_have_unique_ids_titles_and_the_datasource(dashboard: dict[str, Any]) -> None:
    panels = list(all_panels(dashboard["panels"]))
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    source = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels:
        assert panel.get("title"), f"panel {panel['id']} has no title"
        assert "gridPos" in panel, panel["title"]
        if panel["type"] == "row":  # a row holds panels, it queries nothing
            continue
        assert panel.get("datasource") == source, panel["title"]
        targets = panel.get("targets", [])
        assert targets, f"{panel['title']}: no queries"
        assert all(target.get("datasource") == source for target in targets), panel["title"]
        refs = [target["refId"] for target in targets]
        assert len(refs) == len(set(refs)), panel["title"]
    titles = {panel["title"] for panel in panels if panel["type"] == "row"}
    assert titles == {"servewatch health", "per model: observed vs expected"}


def test_referenced_variables_exist(dashboard: dict[str, Any]) -> None:
    declared = {variable["name"] for variable in variables(dashboard)}
    source = next(variable for variable in variables(dashboard) if variable["name"] == "datasource")
    assert (source["type"], source["query"]) == ("datasource", "prometheus")
    text = json.dumps(dashboard)
    used = set(re.findall(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", text))
    referenced = {name for groups in used for name in groups if name and not BUILTIN.fullmatch(name)}
    assert {"model", "signal", "datasource"} <= referenced
    assert referenced <= declared, f"undeclared variables: {referenced - declared}"
    repeats = {panel["repeat"] for panel in all_panels(dashboard["panels"]) if "repeat" in panel}
    assert repeats <= declared


def test_variables_read_the_segment_gauges(dashboard: dict[str, Any]) -> None:
    by_name = {variable["name"]: variable for variable in variables(dashboard)}
    for name in ("model", "signal"):
        query = by_name[name]["query"]
        selector, label = label_values_args(query["query"] if isinstance(query, dict) else query)
        assert metric_names(selector) == {"servewatch_segment_observed"}
        assert label == name
