"""The triage page in headless Chromium while anomalies arrive (its acceptance test).

``servewatch web`` runs as a user would start it, against the session's broker; records go
to the topics the worker writes. A new incident group must appear without a reload, its
detail view must show the chart (band, shaded anomalous windows) and the evidence, and
'not expected' must land on ``servewatch.feedback``. Request content carrying script and
image payloads must show as text and never run. A screenshot of the detail view is kept
in ``tests/artifacts/triage-detail.png``. The changes view shows a change's report
and announces a new one, and the incident after the change marks it on its chart.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from servewatch.pipeline import topics
from servewatch.pipeline.kafka import ensure_topics, producer
from servewatch.schemas.change_marker import ChangeRef
from servewatch.schemas.feedback import Feedback
from tests.conftest import Broker, first_matching
from tests.web_samples import (
    IMG,
    SCRIPT,
    WINDOW_S,
    evidence,
    incident,
    incident_group,
    key_of,
    marker,
    report,
    segment,
    series,
)

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ARTIFACT = Path(__file__).parent / "artifacts" / "triage-detail.png"
WAIT_S = 60  # a hang bound only: on two busy cores the web process and Chromium take their time


async def produce(bootstrap: str, records: list[tuple[str, str, bytes]]) -> None:
    """(topic, key, value) records, in order, each acknowledged."""
    client = producer(bootstrap)
    await client.start()
    try:
        for topic, key, value in records:
            await client.send_and_wait(topic, value, key=key.encode())
    finally:
        await client.stop()


@pytest.fixture
def web_url(broker: Broker, tmp_path: Path) -> Iterator[str]:
    """``servewatch web`` on a free loopback port; yields its URL; SIGTERM stops it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SERVEWATCH_")}
    env.update(PYTHONUNBUFFERED="1", SERVEWATCH_METRICS_PORT="0")
    log = (tmp_path / "web.log").open("w")
    command = [sys.executable, "-m", "servewatch", "web", "--broker", broker.bootstrap, "--port", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the command prints its URL once it listens
        match = re.match(r"triage page: (http://127\.0\.0\.1:\d+/)", line)
        assert match, f"{line!r}; log: {(tmp_path / 'web.log').read_text()}"
        yield match.group(1)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            assert process.wait(timeout=10) == 0, (tmp_path / "web.log").read_text()
        finally:
            if process.poll() is None:
                process.kill()
            log.close()


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[WebDriver]:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"needs {CHROMIUM} and {CHROMEDRIVER} (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    arguments = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
                 f"--user-data-dir={tmp_path / 'chromium'}", "--window-size=1400,2200"]  # fmt: skip
    for argument in arguments:
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))  # no driver download
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def held(url: str, group: str) -> bool:
    with urllib.request.urlopen(f"{url}api/groups", timeout=5) as answer:
        return any(g["group"] == group for g in json.load(answer)["groups"])


def reported(url: str, model: str, change_id: str) -> bool:
    """Whether the page holds the change and a report on it."""
    with urllib.request.urlopen(f"{url}api/changes?model={model}", timeout=5) as answer:
        return any(c["marker"]["id"] == change_id and c["report"] for c in json.load(answer)["changes"])


def test_the_page_follows_anomalies_live_and_records_a_verdict(
    broker: Broker, web_url: str, chromium: WebDriver
) -> None:
    bootstrap = broker.bootstrap
    asyncio.run(ensure_topics(bootstrap, 4))
    run = uuid.uuid4().hex[:8]  # the session's broker is shared: this run's keys are its own
    model = f"web-{run}"
    labels = segment(model)
    start = time.time() - 90 * WINDOW_S
    points = series(labels, start, 90, anomalous_from=70)
    first = incident(model, f"g1-{run}", start + 20 * WINDOW_S, event_id=f"e1-{run}")
    records = [(topics.SERIES, key_of(labels), p.model_dump_json().encode()) for p in points]
    records += [(topics.ANOMALIES, model, r.model_dump_json().encode()) for r in (first, incident_group(first))]
    asyncio.run(produce(bootstrap, records))

    deadline = time.monotonic() + WAIT_S
    while not held(web_url, first.group or "") and time.monotonic() < deadline:
        time.sleep(0.2)
    driver = chromium
    driver.get(web_url)
    wait = WebDriverWait(driver, WAIT_S)
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-key="g1-{run}"]'))
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "open")
    driver.execute_script("window.__sameDocument = true;")

    # a new incident arrives, its request content hostile
    second_group = f"g2-{run}"
    rows = evidence(start + 70 * WINDOW_S, request_id=f"req-{run}", excerpt=f"answer {IMG} then {SCRIPT}")
    second = incident(model, second_group, start + 70 * WINDOW_S, rows=rows, event_id=f"e2-{run}")
    grouped = incident_group(second, title=f"prefix_cache_ineffective on {model} {IMG}")
    asyncio.run(
        produce(bootstrap, [(topics.ANOMALIES, model, r.model_dump_json().encode()) for r in (second, grouped)])
    )
    row = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'tr[data-key="{second_group}"]'))[0]
    assert driver.execute_script("return window.__sameDocument === true"), "the row came with a reload"
    assert IMG in row.text and not driver.find_elements(By.CSS_SELECTOR, "#groups img")

    row.find_element(By.CSS_SELECTOR, "a.title").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "svg.signal-chart"))
    chart = driver.find_element(By.CSS_SELECTOR, "svg.signal-chart")
    assert chart.find_elements(By.CSS_SELECTOR, "polygon.band"), "no expected band"
    assert chart.find_elements(By.CSS_SELECTOR, "rect.anomaly-window"), "no shaded anomalous windows"
    assert driver.find_elements(By.CSS_SELECTOR, "svg.load-chart polyline.load-requests")
    evidence_text = driver.find_element(By.CSS_SELECTOR, "table.evidence").text
    assert f"req-{run}" in evidence_text and IMG in evidence_text and SCRIPT in evidence_text
    assert driver.execute_script("return window.__xss") is None, "a payload ran"
    assert (
        not driver.find_elements(By.CSS_SELECTOR, "main img") and len(driver.find_elements(By.TAG_NAME, "script")) == 1
    )

    driver.find_element(By.ID, "feedback-by").send_keys("ana")
    driver.find_element(By.ID, "feedback-comment").send_keys("caching was switched off by mistake")
    driver.find_element(By.CSS_SELECTOR, 'button[data-verdict="not_expected"]').click()
    wait.until(lambda d: "Recorded" in d.find_element(By.ID, "feedback-status").text)
    assert "not expected by ana" in driver.find_element(By.ID, "feedback-list").text

    def ours(raw: bytes) -> Feedback | None:
        given = Feedback.model_validate_json(raw)
        return given if given.group == second_group else None

    given = asyncio.run(first_matching(bootstrap, topics.FEEDBACK, ours, timeout_s=WAIT_S))
    assert (given.verdict, given.by, given.model) == ("not_expected", "ana", model) and given.signals == ["ttft"]
    assert abs(given.at - time.time()) < 60

    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    driver.execute_script("window.scrollTo(0, 0)")
    assert driver.save_screenshot(str(ARTIFACT)) and ARTIFACT.stat().st_size > 10_000


def test_the_changes_view_and_a_marker_on_the_incident_charts(
    broker: Broker, web_url: str, chromium: WebDriver
) -> None:
    """A marker and its report on ``servewatch.changes``: the changes view shows the report with its
    verdicts, a new report while it is open is announced, and the incident after it marks it."""
    bootstrap = broker.bootstrap
    asyncio.run(ensure_topics(bootstrap, 4))
    run = uuid.uuid4().hex[:8]
    model, change_id = f"chg-{run}", f"c-{run}"
    labels = segment(model)
    start = time.time() - 90 * WINDOW_S
    at = start + 66 * WINDOW_S
    description = f"enable prefix caching {IMG}"
    ref = ChangeRef(id=change_id, at=at, description=description, windows_after=4)
    event = incident(model, f"g-{run}", start + 70 * WINDOW_S, event_id=f"e-{run}", after_change=ref)
    records = [(topics.SERIES, key_of(labels), p.model_dump_json().encode())
               for p in series(labels, start, 90, anomalous_from=70)]  # fmt: skip
    records += [(topics.ANOMALIES, model, r.model_dump_json().encode()) for r in (event, incident_group(event))]
    records += [(topics.CHANGES, model, marker(model, at, change_id=change_id, description=description)
                 .model_dump_json().encode()),
                (topics.CHANGES, model, report(model, at, change_id=change_id, final=False, requests=900)
                 .model_dump_json().encode())]  # fmt: skip
    asyncio.run(produce(bootstrap, records))

    driver = chromium
    wait = WebDriverWait(driver, WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while not (held(web_url, event.group or "") and reported(web_url, model, change_id)):
        assert time.monotonic() < deadline, "the page did not read the records in time"
        time.sleep(0.2)
    driver.get(f"{web_url}changes?model={model}")
    section = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'section[data-change="{change_id}"]'))[0]
    assert description in section.find_element(By.TAG_NAME, "h2").text and not driver.find_elements(
        By.CSS_SELECTOR, "main img"
    )
    assert section.find_elements(By.CSS_SELECTOR, ".badge.report-interim")
    regressed = section.find_element(By.CSS_SELECTOR, 'tr[data-signal="ttft_p95"] td.outcome')
    improved = section.find_element(By.CSS_SELECTOR, 'tr[data-signal="tokens_per_s_p50"] td.outcome')
    assert regressed.text == "regressed" and improved.text == "improved"
    assert regressed.value_of_css_property("color") != improved.value_of_css_property("color")
    assert "HOLDS" in section.find_element(By.CSS_SELECTOR, "table.rollback tr.holds").text
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "open")
    notice = driver.find_element(By.ID, "changes-updated")
    assert not notice.is_displayed()
    final = report(model, at, change_id=change_id)
    asyncio.run(produce(bootstrap, [(topics.CHANGES, model, final.model_dump_json().encode())]))
    wait.until(lambda d: d.find_element(By.ID, "changes-updated").is_displayed())
    driver.find_element(By.CSS_SELECTOR, "#changes-updated a").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'section[data-change="{change_id}"] .badge.report-final'))

    driver.get(f"{web_url}anomalies/e-{run}")
    note = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "p.change-note"))[0]
    assert f"Started 4 windows after change {change_id}: '{description}'" in note.text
    assert "report (final)" in note.text
    chart = driver.find_element(By.CSS_SELECTOR, "svg.signal-chart")
    assert chart.find_elements(By.CSS_SELECTOR, "line.change-line")
    assert chart.find_element(By.CSS_SELECTOR, "text.change-label").text.startswith("enable prefix caching")
    assert driver.execute_script("return window.__xss") is None, "a payload ran"
