"""Small operational faults, each with its cause fixed: the notifier's env variables warned
about, sink URLs that check-config let through and delivery then lost, the worker's
accounting line after a restart, and label values with ``=`` or ``|`` in what users read."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import httpx
import orjson
import pytest
from pydantic import SecretStr

from servewatch.models.detect.grouping import IncidentGrouper
from servewatch.models.windows.batch import RowBatch
from servewatch.models.windows.segment_keys import escape_label, is_replica_key, join_key, parse_key, unescape_label
from servewatch.models.windows.segments import Segmenter
from servewatch.models.windows.windowing import Windower
from servewatch.models.windows.wire import windows_to_wire
from servewatch.pipeline.cli.common import variable_is_read, warn_unknown_variables
from servewatch.pipeline.cli.main import main
from servewatch.pipeline.dev.simulator import Phase, Workload
from servewatch.pipeline.messages.origin import MessageOrigin
from servewatch.pipeline.notify.config import check_http_url, parse_config
from servewatch.pipeline.notify.notification import Notification
from servewatch.pipeline.notify.sinks.slack import SlackWebhookSink
from servewatch.pipeline.settings import Settings
from servewatch.pipeline.web.detail import group_page
from servewatch.pipeline.web.links import LinkTemplates
from servewatch.pipeline.web.store import TriageStore
from servewatch.pipeline.worker import metrics
from servewatch.pipeline.worker.stage_one import StageOne
from servewatch.pipeline.worker.stage_two import StageTwo
from servewatch.schemas.anomaly import AnomalyEvent
from servewatch.schemas.incident_group import IncidentGroup
from tests.test_notifier import Rig, events, feed

# -- (a) every variable something reads is known; typos are still warned about -------------


def test_a_notifier_sinks_variable_is_read_so_not_warned_about_and_typos_still_are(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ = {
        "SERVEWATCH_NOTIFY__PAGER__ROUTING_KEY": "R0UT1NG",  # read by the notify config
        "SERVEWATCH_KAFKA_JARS": "/opt/kafka/libs",  # read by the Apache Kafka test broker
        "SERVEWATCH_BROKER": "kafka:9092",
        "SERVEWATCH_BROKR": "kafka:9092",
        "SERVEWATCH_NOTIFY_PAGER__ROUTING_KEY": "R0UT1NG",  # one underscore short
        "SERVEWATCH_NOTIFY__PAGER": "R0UT1NG",  # no field
    }
    with caplog.at_level(logging.WARNING, logger="servewatch.pipeline.cli.common"):
        unknown = warn_unknown_variables(environ)
    assert unknown == ["SERVEWATCH_BROKR", "SERVEWATCH_NOTIFY_PAGER__ROUTING_KEY", "SERVEWATCH_NOTIFY__PAGER"]
    said = [record.getMessage() for record in caplog.records]
    assert "unknown setting SERVEWATCH_BROKR ignored; did you mean SERVEWATCH_BROKER?" in said
    assert any("SERVEWATCH_NOTIFY_PAGER__ROUTING_KEY ignored; a notifier sink's field is" in s for s in said)
    assert not any("SERVEWATCH_NOTIFY__PAGER__ROUTING_KEY" in s for s in said)
    # what the warning lets through, the notify config applies
    text = "sinks:\n  - {name: pager, type: pagerduty, routing_key: from-file}\n"
    config = parse_config(text, ".yaml", environ={"SERVEWATCH_NOTIFY__PAGER__ROUTING_KEY": "R0UT1NG"})
    assert config.sinks[0].routing_key.get_secret_value() == "R0UT1NG"  # type: ignore[union-attr]
    assert variable_is_read("SERVEWATCH_NOTIFY__ON_CALL_SLACK__URL")


def test_check_config_with_a_sinks_variable_set_warns_about_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "notify.yaml"
    path.write_text("sinks:\n  - {name: pager, type: pagerduty, routing_key: from-file}\n")
    monkeypatch.setenv("SERVEWATCH_NOTIFY__PAGER__ROUTING_KEY", "R0UT1NG")
    with caplog.at_level(logging.WARNING):
        assert main(["check-config", str(path)]) == 0
    assert not [r for r in caplog.records if "unknown setting" in r.getMessage()]


# -- (b) sink URLs: checked when the config loads; at delivery, never a traceback ----------

BAD_SLACK = """\
sinks:
  - name: oncall-slack
    type: slack
    url: "http://[::1/hooks/T000/B000/SECRETPATH"
  - {name: hook, type: webhook, url: "ftp://files.example.com/in"}
"""


def test_check_config_reports_a_malformed_sink_url_as_a_problem_on_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "notify.yaml"
    path.write_text(BAD_SLACK)
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err
    assert "line 4: sinks.0.slack.url: not a valid URL: Invalid IPv6 URL" in err
    assert "line 5: sinks.1.webhook.url: the URL must start with http:// or https://" in err
    assert "SECRETPATH" not in err and "Traceback" not in err  # a Slack webhook's path is its secret


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://[::1/hooks/x", "Invalid IPv6 URL"),
        ("hooks.slack.com/services/x", "must start with http:// or https://"),
        ("https:///services/x", "has no host"),
        ("http://alert manager:9093", "holds characters no host name can"),
        ("http://alertmanager:99999", "Port out of range"),
        ("http://user:pa55w0rd@h\u2100x/", "[redacted]@"),  # the reason quotes the host, not the password
    ],
)
def test_a_sink_url_is_refused_with_a_reason(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)) as refused:
        check_http_url(url)
    assert "pa55w0rd" not in str(refused.value)


@pytest.mark.parametrize(
    "url", ["https://hooks.slack.com/services/T0/B0/X", "http://alertmanager:9093", "http://[::1]:8080/in"]
)
def test_a_good_sink_url_passes(url: str) -> None:
    assert check_http_url(url) == url


def test_a_bad_url_from_the_environment_is_refused_too() -> None:
    text = "sinks:\n  - {name: chat, type: slack, url: 'https://hooks.slack.com/services/x'}\n"
    with pytest.raises(ValueError, match=re.escape("sinks.0.slack.url: not a valid URL")):
        parse_config(text, ".yaml", environ={"SERVEWATCH_NOTIFY__CHAT__URL": "http://[::1/hooks/x"})


def _rig_with_slack_at(url: str) -> Rig:
    """A notifier whose Slack sink has ``url``, past the config's checks (as a config loaded
    by an older version, or a URL httpx refuses for a reason the loader does not know)."""
    text = """
defaults: {group_wait: 0s, group_interval: 0s, repeat_interval: 1h}
retry: {initial: 10ms, max_wait: 20ms, give_up_after: 1s}
sinks:
  - {name: chat, type: slack, url: "https://hooks.slack.com/services/x", route: {min_severity: info}}
"""
    config = parse_config(text, ".yaml", environ={})
    sink_config = config.sinks[0].model_copy(update={"url": SecretStr(url)})  # not validated
    config = config.model_copy(update={"sinks": [sink_config]})
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    return Rig([SlackWebhookSink(sink_config, client)], {}, config)  # type: ignore[list-item, arg-type]


async def test_a_request_that_cannot_be_built_ends_as_a_dead_lettered_delivery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = _rig_with_slack_at("http://[::1/hooks/T000/B000/SECRETPATH")
    with caplog.at_level(logging.DEBUG, logger="servewatch.pipeline.notify"):
        await feed(rig.notifier, events()[:1])
        await rig.run_until_idle(ticks=5)
    [delivery] = rig.deliveries
    assert (delivery.sink, delivery.outcome, delivery.attempts) == ("chat", "rejected", 1)
    assert "cannot build the request" in delivery.detail and "SECRETPATH" not in delivery.detail
    [letter] = rig.letters
    assert letter.reason == "notify_rejected"
    assert not rig.notifier.busy  # not in flight for good: the group is settled
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]  # no traceback


class _Broken:
    """A sink that fails before any request, as a bug in building a payload would."""

    name, type = "chat", "slack"

    async def send(self, note: Notification) -> dict[str, str]:
        raise KeyError("lead")


async def test_any_failure_of_a_sink_ends_as_a_delivery_record(caplog: pytest.LogCaptureFixture) -> None:
    rig = _rig_with_slack_at("https://hooks.slack.com/services/x")
    rig.notifier.runners["chat"].sink = _Broken()
    with caplog.at_level(logging.INFO, logger="servewatch.pipeline.notify"):
        await feed(rig.notifier, events()[:1])
        await rig.run_until_idle(ticks=5)
    assert [(d.outcome, d.detail) for d in rig.deliveries] == [("rejected", "could not send: KeyError: 'lead'")]
    assert len(rig.letters) == 1 and not rig.notifier.busy
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]


# -- (c) the worker's accounting line after a restart ---------------------------------------


def _record(i: int, at: float) -> dict[str, object]:
    return {"request_id": f"r{i}", "timestamp": at, "model": "m", "prompt_tokens": 50, "completion_tokens": 5,
            "e2e_s": 0.5, "finish_reason": "stop", "ttft_s": 0.1}  # fmt: skip


def _previous_lifetimes_bundle(records: int, start: float) -> bytes:
    """Partials a worker sent before it restarted (its counters died with it): folded by a
    bare ``Windower``, which counts nothing in this process."""
    windower = Windower(Settings().segmenter(), window_s=10.0)
    windower.add(RowBatch([_record(i, start + i / records) for i in range(records)]))
    partials = windower.flush_all()
    return orjson.dumps({"windows": windows_to_wire(partials), "watermarks": {}})  # the window not complete yet


def _in_open_windows() -> int:
    match = re.search(r"(-?[\d,]+) in open windows", metrics.accounting_line())
    assert match, metrics.accounting_line()
    return int(match[1].replace(",", ""))


def test_in_open_windows_counts_what_the_windows_hold_and_is_right_after_a_restart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(metrics._Watched, "stages", None)  # whatever another test watched comes back after
    settings = Settings(topic_partitions=1)
    one, two = StageOne(settings), StageTwo(settings)
    assert _in_open_windows() == 0
    metrics.watch_open_windows(one, two)
    assert _in_open_windows() == 0
    # the restarted worker judges 500 records it never read...
    two.receive(_previous_lifetimes_bundle(500, 1767225600.0), via=0, now=0.0)
    assert _in_open_windows() == 500  # held by stage 2 until the window is judged
    two.release_all()
    assert two.judged_records == 500
    # ...and reads 7 of its own, still in stage 1's open window
    one.process(orjson.dumps([_record(i, 1767225700.0 + i) for i in range(7)]), MessageOrigin("t", 0, 0), now=0.0)
    one.fold_pending()
    assert _in_open_windows() == 7
    one.process(orjson.dumps([_record(7, 1767225701.5)]), MessageOrigin("t", 0, 1), now=0.0)
    assert _in_open_windows() == 8  # decoded, not folded yet: held all the same
    partials = one.flush_all()
    assert _in_open_windows() == 0 and sum(int(p.requests) for p in partials if not is_replica_key(p.key)) == 8


# -- (d) '=' and '|' in label values: escaped in the key, shown as they are -----------------


def test_plain_keys_do_not_change_and_separators_round_trip() -> None:
    segmenter = Segmenter()
    plain = segmenter.key_for(model="llama-3.1-70b", route="chat", prompt_tokens=500, output_tokens=50)
    assert plain == "model=llama-3.1-70b|route=chat|prompt_band=<4k|output_band=<1k"  # as stored before
    assert segmenter.key_for(model="50%-off", prompt_tokens=1, output_tokens=1).startswith("model=50%-off|")
    key = segmenter.key_for(model="org/llama=v2", route="a|b=c", prompt_tokens=500, output_tokens=50)
    assert key == "model=org/llama=v2|route=a%7Cb=c|prompt_band=<4k|output_band=<1k"
    assert parse_key(key) == {"model": "org/llama=v2", "route": "a|b=c", "prompt_band": "<4k", "output_band": "<1k"}
    for value in ["", "|", "%", "%7C", "%257C", "%%7C|", "a=b|c%25d", "100%", "%7c"]:
        assert "|" not in escape_label(value) and unescape_label(escape_label(value)) == value
        assert parse_key(join_key({"model": value, "route": value})) == {"model": value, "route": value}


def _pipeline_records(model: str) -> list[AnomalyEvent | IncidentGroup]:
    """Prefix caching lost on ``model``: the worker's two stages, then the incident grouper."""
    settings = Settings(topic_partitions=1)
    one, two = StageOne(settings), StageTwo(settings)
    workload = Workload((Phase("normal", 300), Phase("cache_off", 120, prefix_caching=False)), models=(model,), seed=8)
    incidents: list[AnomalyEvent] = []
    for offset, (_, batch) in enumerate(workload.seconds()):
        _, partials = one.process(orjson.dumps(batch), MessageOrigin("t", 0, offset), now=0.0)
        for _, bundle in one.bundles(partials, 1):
            incidents += two.receive(bundle, via=0, now=0.0)
    grouper, records = IncidentGrouper(), list[AnomalyEvent | IncidentGroup]()
    for incident in incidents:
        event, told = grouper.add(incident)
        records += [event, *told]
    return records


def test_a_model_named_with_equals_reads_so_in_events_titles_and_the_triage_page() -> None:
    model = "org/llama=v2"
    records = _pipeline_records(model)
    incidents = [r for r in records if isinstance(r, AnomalyEvent)]
    groups = [r for r in records if isinstance(r, IncidentGroup)]
    assert incidents and groups
    assert {e.segment["model"] for e in incidents} == {model}
    assert all(model in e.summary for e in incidents)
    assert all(g.model == model and model in g.title and model in g.summary for g in groups)
    store = TriageStore()
    for record in records:
        store.add(record)
    group = groups[-1]
    page = group_page(group, store.members(group.group), [], series_of=store.series, links=LinkTemplates(),
                      csrf="c", user=None)  # fmt: skip
    assert f"model <strong>{model}</strong>" in page
    shown = " ".join([*(e.summary for e in incidents), *(g.title + g.summary for g in groups), page])
    assert "org/llama:v2" not in shown
