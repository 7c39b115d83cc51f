"""The scraper: health, failures and restarts, against httpx.MockTransport and a real loopback server."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx
import orjson
import pytest

from servewatch.pipeline import topics
from servewatch.pipeline.cli.main import main
from servewatch.pipeline.durations import parse_duration
from servewatch.pipeline.ingest.scrape.scraper import (
    IntervalTracker,
    Scraper,
    check_targets,
    instance_of,
    run_scrapes,
)
from servewatch.pipeline.kafka import read_topic
from servewatch.schemas.engine_interval import EngineInterval
from tests.conftest import Broker
from tests.engine_sim import ExpositionHandler
from tests.test_exposition import counter, gauge, histogram, sglang, vllm_v1


def vllm(requests: int, hits: float = 0.0) -> str:
    """vLLM V1 text after ``requests`` requests of 1,000 prompt tokens each."""
    return vllm_v1([0.05] * requests, prompt=1000.0 * requests, hits=hits, queries=1000.0 * requests, stops=requests)


def test_urls_durations_and_instances() -> None:
    assert instance_of("http://10.0.0.7:8000/metrics") == "10.0.0.7:8000"
    assert instance_of("localhost:30000/metrics") == "localhost:30000"
    assert instance_of("https://gpu-3.internal/metrics") == "gpu-3.internal:443"
    assert [parse_duration(t) for t in ("10s", "500ms", "2m", "3")] == [10.0, 0.5, 120.0, 3.0]
    with pytest.raises(ValueError):
        parse_duration("soon")
    for bad in ([], ["10.0.0.7:8000/metrics"], ["http://[::1/metrics"]):
        with pytest.raises(ValueError):
            check_targets(bad)
    assert main(["scrape", "--target", "ftp://x/metrics", "--out", "-"]) == 2


def test_tracker_needs_two_scrapes_and_keeps_the_last_good_one() -> None:
    tracker = IntervalTracker()
    assert tracker.feed("a:1", 0.0, vllm(10)) == []
    with pytest.raises(ValueError):
        tracker.feed("a:1", 5.0, "<html>502 Bad Gateway</html>")
    [got] = tracker.feed("a:1", 10.0, vllm(30))
    assert got.start == 0.0 and got.prompt_tokens_per_s == pytest.approx(2000.0)
    assert tracker.feed("a:1", 10.0, vllm(40)) == []  # no time passed: nothing new


async def test_every_kind_of_failure_marks_the_target_down_and_the_next_good_scrape_covers_the_gap() -> None:
    refused, slow = httpx.ConnectError("refused"), httpx.ReadTimeout("slow")
    replies: list[object] = [vllm(10), refused, httpx.Response(503), "garbage line", slow, vllm(50)]

    def respond(request: httpx.Request) -> httpx.Response:
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply if isinstance(reply, httpx.Response) else httpx.Response(200, text=str(reply))

    clock = iter(float(t) for t in range(0, 100, 10))
    async with httpx.AsyncClient(transport=httpx.MockTransport(respond)) as client:
        scraper = Scraper(["http://10.0.0.7:8000/metrics"], client, timeout_s=1.0, clock=lambda: next(clock))
        health = scraper.health["http://10.0.0.7:8000/metrics"]
        errors = []
        for _ in range(5):
            await scraper.round()
            errors.append(None if health.up else health.last_error)
        assert errors[0] is None and health.failures == 4
        assert "ConnectError" in errors[1] and "503" in errors[2]  # type: ignore[operator]
        assert "not a Prometheus exposition" in errors[3] and "timed out" in errors[4]  # type: ignore[operator]
        scrapes, [got] = await scraper.round()
        assert health.up and health.failures == 0 and len(scrapes) == 1
        assert (got.start, got.end) == (0.0, 50.0) and got.prompt_tokens_per_s == pytest.approx(40_000 / 50)


class Metrics(ExpositionHandler):
    body = ""

    def text(self) -> str:
        return self.body


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def serve(port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer(("127.0.0.1", port), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


async def test_a_real_server_that_goes_down_and_comes_back_restarted() -> None:
    """Loopback HTTP: traffic, the server goes away (down), comes back with its counters reset."""
    httpd = serve(0)
    port = httpd.server_address[1]
    url = f"http://127.0.0.1:{port}/metrics"
    timeline = []
    async with httpx.AsyncClient() as client:
        scraper = Scraper([url], client, timeout_s=2.0)
        Metrics.body = vllm(10, hits=9_000)
        await scraper.round()
        Metrics.body = vllm(30, hits=27_000)
        _, first = await scraper.round()
        timeline.append(("up", first[0].prefix_cache_hit_rate, first[0].counter_reset))
        httpd.shutdown()
        httpd.server_close()
        await scraper.round()
        timeline.append(("down", scraper.health[url].up, scraper.health[url].failures))
        httpd = serve(port)  # the engine restarted: its counters start again
        try:
            Metrics.body = vllm(5, hits=0)
            _, back = await scraper.round()
        finally:
            httpd.shutdown()
            httpd.server_close()
        timeline.append(("back", back[0].prefix_cache_hit_rate, back[0].counter_reset))
    assert timeline == [("up", pytest.approx(0.9), False), ("down", False, 1), ("back", 0.0, True)]


def vllm_before_v1(n: int) -> str:
    """vLLM before the V1 renames (gpu_* cache names, time_per_output_token) after ``n`` steps."""
    labels = 'model_name="llama"'
    return "\n".join([
        histogram("vllm:time_per_output_token_seconds", labels, [0.02] * (4 * n), (0.01, 0.025, 0.05)),
        histogram("vllm:time_to_first_token_seconds", labels, [0.2] * (4 * n), (0.1, 0.25, 0.5)),
        counter("vllm:prompt_tokens", labels, 1000.0 * n),
        counter("vllm:generation_tokens", labels, 100.0 * n),
        counter("vllm:gpu_prefix_cache_queries", labels, 1000.0 * n),
        counter("vllm:gpu_prefix_cache_hits", labels, 800.0 * n),
        gauge("vllm:gpu_cache_usage_perc", labels, 0.5),
        gauge("vllm:num_requests_running", labels, 3.0),
        gauge("vllm:num_requests_waiting", labels, 1.0),
    ]) + "\n"  # fmt: skip


#: Per engine naming: the body after n steps, and what one step's interval must say (the
#: latency histograms that moved).
NAMINGS = {
    "vllm_v1": (lambda n: vllm(10 * n, hits=9_000.0 * n), "vllm", "llama", 0.9, {"ttft"}),
    "vllm_before_v1": (vllm_before_v1, "vllm", "llama", 0.8, {"ttft", "itl"}),
    # device + host cached tokens; its fixture's histograms do not move between scrapes
    "sglang": (lambda n: sglang(1_000.0 * n, 100.0 * n, 4), "sglang", "qwen", 0.15, set()),
}


@pytest.mark.parametrize("naming", sorted(NAMINGS))
async def test_each_engines_naming_is_scraped_over_loopback(naming: str, server: ThreadingHTTPServer) -> None:
    body, engine, model, hit_rate, timed = NAMINGS[naming]
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    async with httpx.AsyncClient() as client:
        scraper = Scraper([url], client, timeout_s=2.0)
        Metrics.body = body(1)
        assert (await scraper.round())[1] == []  # one scrape is no interval
        Metrics.body = body(2)
        _, [got] = await scraper.round()
    assert (got.engine, got.model, got.instance) == (engine, model, instance_of(url))
    assert got.prefix_cache_hit_rate == pytest.approx(hit_rate) and not got.counter_reset
    assert got.kv_cache_usage is not None and got.running is not None
    assert "ttft" in got.latency and {name for name, summary in got.latency.items() if summary.count > 0} == timed
    assert scraper.health[url].up


async def test_rounds_stop_when_asked(server: ThreadingHTTPServer) -> None:
    Metrics.body = sglang(1_000, 100, 4)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    stop = asyncio.Event()
    seen: list[int] = []

    def on_round(n: int, scrapes: object, intervals: object) -> None:
        seen.append(n)
        if n == 3:
            stop.set()

    async with httpx.AsyncClient() as client:
        done = await run_scrapes(Scraper([url], client), 0.05, on_round, rounds=None, stop=stop)
    assert done == 3 and seen == [1, 2, 3]


def test_scrape_command_writes_intervals_and_a_replayable_record(server: ThreadingHTTPServer, tmp_path: Path) -> None:
    Metrics.body = sglang(1_000, 100, 4)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    out, record = tmp_path / "intervals.jsonl", tmp_path / "scrapes.jsonl"
    code = main(["scrape", "--target", url, "--interval", "100ms", "--count", "3",
                 "--out", str(out), "--record", str(record)])  # fmt: skip
    assert code == 0
    intervals = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    recorded = [orjson.loads(line) for line in record.read_bytes().splitlines()]
    assert len(intervals) == 2 and {i["model"] for i in intervals} == {"qwen"}
    assert len(recorded) == 3 and {r["instance"] for r in recorded} == {f"127.0.0.1:{server.server_address[1]}"}
    tracker = IntervalTracker()  # the record replays into the same intervals
    replayed = [i for r in recorded for i in tracker.feed(r["instance"], r["timestamp"], r["body"])]
    assert [i.model_dump(mode="json") for i in replayed] == intervals


@pytest.mark.integration
def test_scrape_command_publishes_intervals_to_kafka(server: ThreadingHTTPServer, broker: Broker) -> None:
    Metrics.body = vllm(10, hits=5_000)
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    assert main(["scrape", "--target", url, "--interval", "100ms", "--count", "3", "--broker", broker.bootstrap]) == 0

    instance = f"127.0.0.1:{server.server_address[1]}"

    async def first_two() -> list[bytes]:  # of this server's: other tests share the topic
        values: list[bytes] = []
        async for value in read_topic(broker.bootstrap, topics.SCRAPES):
            if instance.encode() not in value:
                continue
            values.append(value)
            if len(values) == 2:
                return values
        return values

    values = asyncio.run(asyncio.wait_for(first_two(), timeout=30))
    intervals = [EngineInterval.model_validate_json(v) for v in values]
    assert {(i.model, i.engine, i.cache_config.get("enable_prefix_caching")) for i in intervals} == {
        ("llama", "vllm", "False")
    }
