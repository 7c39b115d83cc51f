"""The load generator, over real loopback HTTP against the dev OpenAI-compatible
server (``pipeline/dev/openai_server.py``, a child process, so the two event loops do not
share one thread):

* every request becomes a valid ``RequestLog`` line, failures included (500s, 401s, a server
  that is not there), and nothing raises;
* client-side TTFT tracks the server's own: never below it (the server's interval lies
  inside the client's), the median difference under 25 % of the median server TTFT, and a
  rank correlation of at least 0.8 (what the client adds is transport, not noise). These
  comparisons, and the cached prefixes' below, need a client that kept its schedule: on a
  machine so busy that its sends ran late (``RunSummary.late_p90_s``, same run) they are
  skipped, saying so;
* prefix-cached requests prefill faster, seen by the server and by the client;
* the profile of loadgen's own logs matches the profile it replayed, within these
  tolerances (about 200 requests; sampling error, not bias, sets them): prompt and output
  p50 within 15 %, p90 within 25 %; shared-prefix share within 0.1, each top prefix's share
  of them within 0.12 and its shared length within 25 % + one 16-token cache block; the
  ``length`` share among stops and lengths within 0.08; route shares within 0.1; the
  inter-arrival CV within 0.3 (timed by the client: skipped as above when its sends ran a
  quarter of the mean gap late);
* a concurrency ramp finds the knee at the server's slot count, throughput growing up to
  it and not beyond.

Nothing here asserts how long our own code takes: only comparisons between measurements.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from scipy.stats import spearmanr

from servewatch.models.workload import WorkloadProfiler, WorkloadSampler
from servewatch.models.workload.sample import RequestSpec
from servewatch.pipeline.cli.main import main
from servewatch.pipeline.dev.children import start_announcing, stop
from servewatch.pipeline.dev.openai_server import OpenAIServer, Served, ServerConfig, read_served
from servewatch.pipeline.loadgen import LoadGenerator, Outcome, RunSummary, Target
from servewatch.pipeline.loadgen.prompts import PromptBuilder
from servewatch.schemas.request_log import RequestLog
from servewatch.schemas.workload_profile import WorkloadProfile

DAY0 = 1_767_225_600.0
SHARED_TOKENS = {"sys-a": 256, "sys-b": 128, "sys-c": 64}


def source_logs(seed: int = 0, n: int = 3000, model: str = "m") -> list[dict[str, Any]]:
    """An hour of a model's requests: log-normal lengths (short answers, so a run is quick),
    60 % starting with one of three system prompts, some truncated, some failed."""
    rng = np.random.default_rng(seed)
    arrivals = DAY0 + np.cumsum(rng.exponential(1.2, n))
    prompt = np.clip(rng.lognormal(np.log(400), 0.5, n), 32, 3000).astype(int)
    output = np.clip(rng.lognormal(np.log(24), 0.6, n), 1, 200).astype(int)
    rows = []
    for i in range(n):
        roll = rng.random()
        prefix = str(rng.choice(list(SHARED_TOKENS), p=[0.5, 0.3, 0.2])) if roll < 0.6 else (
            f"u{i}" if roll < 0.8 else None)  # fmt: skip
        finish = "error" if rng.random() < 0.03 else "length" if rng.random() < 0.15 else "stop"
        cached = min(SHARED_TOKENS[prefix], int(prompt[i]) - 1) if prefix in SHARED_TOKENS else 0
        rows.append({
            "request_id": f"src-{i}", "model": model, "timestamp": float(arrivals[i]) + 0.8, "e2e_s": 0.8,
            "prompt_tokens": int(prompt[i]), "completion_tokens": 0 if finish == "error" else int(output[i]),
            "finish_reason": finish, "status_code": 500 if finish == "error" else 200, "prefix_hash": prefix,
            "cached_tokens": cached, "route": "chat" if rng.random() < 0.7 else "rag",
        })  # fmt: skip
    return rows


@pytest.fixture(scope="module")
def profile() -> WorkloadProfile:
    return WorkloadProfiler().learn_many(source_logs()).profile("m")


def narrow_profile() -> WorkloadProfile:
    """Every request alike (200-token prompt, 20-token answer): a ramp's latency moves only with load."""
    rows = [{"model": "m", "timestamp": DAY0 + i, "e2e_s": 0.5, "prompt_tokens": 200, "completion_tokens": 20,
             "finish_reason": "stop"} for i in range(100)]  # fmt: skip
    return WorkloadProfiler().learn_many(rows).profile("m")


class ChildServer:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.log = tmp / "served.jsonl"
        argv = ["servewatch.pipeline.dev.openai_server", "--port", "0", "--log", str(self.log), *args]
        self.process, self.url = start_announcing(argv, "openai server ready: ")

    def served(self) -> dict[str, Served]:
        return {s.request_id: s for s in read_served(self.log)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChildServer]:
    """Slots enough that nothing queues: TTFT is prefill, 2 ms + 1 ms per uncached token (0.4 s
    for the median prompt). A loaded machine delays the client's event loop by tens of
    milliseconds (a median of 66 ms with two test workers and three busy loops on two cores):
    the prefill must dwarf that, or the comparisons below measure the machine."""
    child = ChildServer(tmp_path_factory.mktemp("server"), "--slots", "256", "--itl-s", "0.002",
                        "--prefill-s-per-token", "0.001")  # fmt: skip
    yield child
    stop(child.process)


def run_open_loop(
    target: Target, sampler: WorkloadSampler, rate: float, seconds: float, **kw: Any
) -> tuple[list[Outcome], RunSummary]:
    outcomes: list[Outcome] = []

    async def go() -> RunSummary:
        async with LoadGenerator(target, sampler, on_outcome=outcomes.append, **kw) as generator:
            summary = await generator.open_loop(rate, seconds)
            assert summary.shed == 0
            return summary

    return outcomes, asyncio.run(go())


@pytest.fixture(scope="module")
def replay(server: ChildServer, profile: WorkloadProfile) -> tuple[list[Outcome], RunSummary]:
    return run_open_loop(Target(server.url, "m"), WorkloadSampler(profile, seed=4), 40.0, 5.0, seed=4)


@pytest.fixture(scope="module")
def replayed(replay: tuple[list[Outcome], RunSummary]) -> list[Outcome]:
    return replay[0]


def skip_if_the_client_fell_behind(summary: RunSummary, typical_s: float, share: float = 0.05) -> None:
    """Timing comparisons need a client that kept its schedule: one whose sends ran ``share`` of
    the ``typical_s`` it measures late or more, one time in ten (``late_p90_s``, measured in
    the same run), was starved of CPU, and what it measured is the machine's load, not its own
    accuracy: its reads of the answers lag several times more than its sends (the worst
    lateness is no guide either: one hiccup of another process moves it)."""
    if summary.late_p90_s > share * typical_s:
        pytest.skip(f"the machine is too busy to compare timings: one send in ten ran "
                    f"{1000 * summary.late_p90_s:.1f} ms or more behind schedule, against a typical "
                    f"{1000 * typical_s:.0f} ms measured")  # fmt: skip


def test_every_request_is_a_valid_request_log(replayed: list[Outcome], server: ChildServer) -> None:
    assert len(replayed) > 150
    served = server.served()
    for outcome in replayed:
        log = RequestLog.model_validate_json(outcome.log.model_dump_json(exclude_none=True))
        assert log == outcome.log and log.tenant == "loadgen" and log.status_code == 200 and not log.is_error
        assert log.finish_reason in ("stop", "length") and log.ttft_s is not None and log.decode_s is not None
        mine = served[log.request_id]  # the server saw the same request
        assert (log.prompt_tokens, log.completion_tokens, log.cached_tokens) == (
            mine.prompt_tokens, mine.completion_tokens, mine.cached_tokens)  # fmt: skip
        assert log.finish_reason == mine.finish_reason
        assert len(outcome.gaps) == log.completion_tokens - 1


def test_client_ttft_tracks_the_servers(replay: tuple[list[Outcome], RunSummary], server: ChildServer) -> None:
    replayed, summary = replay
    served = server.served()
    client = np.array([o.log.ttft_s for o in replayed], dtype=float)
    own = np.array([served[o.log.request_id].ttft_s for o in replayed], dtype=float)
    difference = client - own
    assert np.all(difference > -1e-3)  # the server's interval lies inside the client's, busy or not
    skip_if_the_client_fell_behind(summary, float(np.median(own)))
    assert np.median(difference) < 0.25 * np.median(own)
    assert spearmanr(client, own).statistic > 0.8
    print(f"client - server TTFT: median {1000 * np.median(difference):.2f} ms on a median server TTFT of "
          f"{1000 * np.median(own):.1f} ms; Spearman {spearmanr(client, own).statistic:.3f}")  # fmt: skip


def test_cached_prefixes_prefill_faster(replay: tuple[list[Outcome], RunSummary], server: ChildServer) -> None:
    replayed, summary = replay
    served = server.served()
    hit = [o for o in replayed if (o.log.cached_tokens or 0) >= 64]
    miss = [o for o in replayed if o.log.cached_tokens == 0]
    assert len(hit) > 30 and len(miss) > 30
    assert all(o.log.prefix_hash for o in hit)
    skip_if_the_client_fell_behind(summary, float(np.median([served[o.log.request_id].ttft_s for o in miss])))
    for ttft in (lambda o: served[o.log.request_id].ttft_s, lambda o: o.log.ttft_s):  # server, then client
        per_token = {name: np.median([ttft(o) / o.log.prompt_tokens for o in group])
                     for name, group in (("hit", hit), ("miss", miss))}  # fmt: skip
        assert per_token["hit"] < 0.8 * per_token["miss"]


def test_a_profile_of_loadgens_logs_matches_the_profile_it_replayed(
    replay: tuple[list[Outcome], RunSummary], profile: WorkloadProfile
) -> None:
    replayed, summary = replay
    again = WorkloadProfiler().learn_many(o.log for o in replayed).profile("m")
    deviations = {}
    for name in ("prompt", "output"):
        before, after = getattr(profile.lengths, name), getattr(again.lengths, name)
        for level, tolerance in (("p50", 0.15), ("p90", 0.25)):
            deviations[f"{name} {level}"] = getattr(after, level) / getattr(before, level) - 1
            assert abs(deviations[f"{name} {level}"]) < tolerance, name
    a, b = profile.prefixes, again.prefixes
    deviations["shared share"] = b.shared_share - a.shared_share
    assert abs(deviations["shared share"]) < 0.1 and b.distinct_shared == 3
    popular = [sum(p.requests for p in sharing.top) for sharing in (a, b)]
    for i, (one, two) in enumerate(zip(a.top, b.top, strict=True)):  # the same prefixes, by popularity
        share = two.requests / popular[1] - one.requests / popular[0]
        deviations[f"prefix {i} share"] = share
        assert abs(share) < 0.12
        assert two.estimated_from == "cached_tokens" and abs(two.tokens - one.tokens) <= 0.25 * one.tokens + 16

    def length_share(reasons: dict[str, float]) -> float:
        return reasons.get("length", 0.0) / (reasons.get("length", 0.0) + reasons.get("stop", 0.0))

    deviations["length share"] = length_share(again.finish_reasons) - length_share(profile.finish_reasons)
    assert abs(deviations["length share"]) < 0.08
    assert set(again.routes) == {"chat", "rag"} and abs(again.routes["chat"] - profile.routes["chat"]) < 0.1
    assert again.arrivals.interarrival_cv is not None and profile.arrivals.interarrival_cv is not None
    deviations["inter-arrival CV"] = again.arrivals.interarrival_cv - profile.arrivals.interarrival_cv
    print("profile round trip:", {k: round(v, 3) for k, v in deviations.items()})
    # Arrivals are timed by the client's clock, against gaps of 25 ms on average (40/s): what a
    # client that fell behind by a fraction of that logs is the machine's load.
    skip_if_the_client_fell_behind(summary, 1.0 / 40.0, share=0.25)
    assert abs(deviations["inter-arrival CV"]) < 0.3


def test_a_ramp_finds_the_knee_at_the_servers_slots(tmp_path: Path) -> None:
    # 20 ms a token and 0.2 s of prefill: a starved client's few milliseconds a chunk cannot
    # double a step's TTFT or inter-token latency the way the slots running out do.
    child = ChildServer(tmp_path, "--slots", "4", "--itl-s", "0.02", "--itl-growth", "0.02",
                        "--prefill-s-per-token", "0.001")  # fmt: skip
    try:

        async def go() -> Any:
            target = Target(child.url, "m")
            async with LoadGenerator(target, WorkloadSampler(narrow_profile(), seed=1), seed=1) as generator:
                return await generator.ramp([1, 2, 4, 8, 16], step_s=2.5)

        report = asyncio.run(go())
    finally:
        stop(child.process)
    steps = {s.concurrency: s for s in report.steps}
    print("ramp:", [(s.concurrency, round(s.output_tokens_per_s), round(1000 * (s.ttft_p95 or 0), 1))
                    for s in report.steps], "knee", report.knee)  # fmt: skip
    assert report.knee == 4
    assert all(s.errors == 0 and s.requests > 0 for s in report.steps)
    assert steps[4].output_tokens_per_s > 1.5 * steps[1].output_tokens_per_s  # up to the slots: throughput
    assert steps[16].ttft_p95 is not None and steps[4].ttft_p95 is not None
    throughput_gain = steps[16].output_tokens_per_s / steps[4].output_tokens_per_s
    assert steps[16].ttft_p95 / steps[4].ttft_p95 > 3 * throughput_gain  # past them: queueing, not throughput


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_failures_are_logged_not_raised(profile: WorkloadProfile) -> None:
    sampler = WorkloadSampler(profile, seed=9)

    async def go() -> tuple[list[Outcome], list[Served], list[Outcome], list[Outcome]]:
        async with OpenAIServer(ServerConfig(slots=32, error_rate=0.3, seed=2, api_key="k")) as server:
            keyed, unkeyed = [], []
            async with LoadGenerator(Target(server.url, "m", api_key="k"), sampler, on_outcome=keyed.append) as lg:
                await lg.open_loop(25.0, 1.5)
            async with LoadGenerator(Target(server.url, "m"), sampler, on_outcome=unkeyed.append) as lg:
                await lg.open_loop(10.0, 0.5)
        down = []
        target = Target(f"http://127.0.0.1:{free_port()}/v1", "m", api="completions")
        async with LoadGenerator(target, sampler, on_outcome=down.append) as lg:
            await lg.open_loop(10.0, 0.5)
        return keyed, server.served, unkeyed, down

    keyed, served, unkeyed, down = asyncio.run(go())
    failed = [o.log for o in keyed if o.log.finish_reason == "error"]
    assert len(failed) == sum(s.status == 500 for s in served) > 0
    assert all(log.status_code == 500 and log.error and "injected failure" in log.error for log in failed)
    assert all(log.completion_tokens == 0 and log.ttft_s is None for log in failed)
    assert len(failed) < len(keyed)  # the others went through
    assert unkeyed and all(o.log.status_code == 401 and o.log.is_error for o in unkeyed)
    assert down and all(o.log.status_code is None and o.log.finish_reason == "error" for o in down)
    assert all("Connect" in (o.log.error or "") for o in down)
    for outcome in [*keyed, *unkeyed, *down]:  # every one a valid line
        RequestLog.model_validate_json(outcome.log.model_dump_json())


def test_prompts_share_exactly_their_prefix() -> None:
    builder = PromptBuilder(seed=3)
    specs = [RequestSpec(300, 5, "stop", 0, 200, None), RequestSpec(250, 5, "stop", 0, 200, None),
             RequestSpec(300, 5, "stop", 1, 200, None), RequestSpec(300, 5, "stop", None, 0, None)]  # fmt: skip
    texts = [builder.text(spec).split() for spec in specs]
    assert [len(t) for t in texts] == [300, 250, 300, 300]
    assert texts[0][:200] == texts[1][:200] and texts[0][200:216] != texts[1][200:216]
    assert texts[0][:16] != texts[2][:16] != texts[3][:16]  # another prefix, or none, shares no block
    assert PromptBuilder(seed=3).text(specs[0]).split()[:200] == texts[0][:200]  # same seed, same prefix


# -- the command line --------------------------------------------------------------------------


def test_profile_and_loadgen_commands(
    server: ChildServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    logs, profile_path, out = tmp_path / "logs.jsonl", tmp_path / "profile.json", tmp_path / "requests.jsonl"
    logs.write_text("".join(json.dumps(r) + "\n" for r in source_logs(n=500)) + "not json\n")
    assert main(["profile", "--in", str(logs), "--out", str(profile_path)]) == 0
    err = capsys.readouterr().err
    assert "1 lines rejected" in err and "model m: 500 requests" in err and "shared prefix:" in err
    written = WorkloadProfile.model_validate_json(profile_path.read_text())
    assert written.requests == 500

    args = ["loadgen", "--profile", str(profile_path), "--target", server.url, "--seed", "2"]
    assert main([*args, "--rate", "20", "--duration", "1500ms", "--out", str(out), "--model", "renamed"]) == 0
    err = capsys.readouterr().err
    lines = [RequestLog.model_validate_json(line) for line in out.read_text().splitlines()]
    assert lines and all(log.model == "renamed" and log.tenant == "loadgen" for log in lines)
    assert f"loadgen: {len(lines)} requests (0 failed)" in err

    assert main([*args, "--ramp", "1,2", "--step-duration", "0.5s", "--out", str(tmp_path / "ramp.jsonl")]) == 0
    err = capsys.readouterr().err
    assert "concurrency" in err and "knee:" in err and len(err.strip().splitlines()) == 4  # head, 2 steps, knee

    down = [*args[:4], f"http://127.0.0.1:{free_port()}/v1", "--rate", "10", "--duration", "0.3s", "--out", "-"]
    assert main(down) == 1  # every request failed
    capsys.readouterr()


def test_loadgen_refuses_what_it_cannot_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    two = tmp_path / "two.jsonl"
    rows = source_logs(n=200) + source_logs(n=200, model="other")
    logs = tmp_path / "logs.jsonl"
    logs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["profile", "--in", str(logs), "--out", str(two)]) == 0
    assert len(two.read_text().splitlines()) == 2  # one profile a line
    capsys.readouterr()
    base = ["loadgen", "--profile", str(two), "--target", "http://127.0.0.1:9/v1"]
    cases = [
        ([*base, "--rate", "5"], "holds several models (m, other): pick one with --model"),
        ([*base, "--model", "m"], "give --rate (open loop) or --ramp"),
        ([*base, "--model", "m", "--rate", "5", "--ramp"], "give --rate (open loop) or --ramp"),
        ([*base, "--model", "m", "--ramp", "1,x"], "--ramp '1,x'"),
        ([*base, "--model", "m", "--rate", "5", "--duration", "soon"], "--duration 'soon'"),
        (["loadgen", "--profile", str(logs), "--target", "http://h/v1", "--rate", "1"], "--profile"),
        (["loadgen", "--profile", str(two), "--target", "h:8000", "--rate", "1"], "needs http://"),
        (["profile", "--in", str(logs), "--model", "absent"], "no valid request logs of model 'absent'"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_the_dev_server_runs_as_a_module(tmp_path: Path) -> None:
    """``python -m servewatch.pipeline.dev.openai_server`` serves the models list."""
    import httpx

    child = ChildServer(tmp_path, "--model", "dev-model")
    try:
        assert httpx.get(child.url + "/models").json()["data"][0]["id"] == "dev-model"
        answer = httpx.post(child.url + "/completions", json={"model": "x", "prompt": "a b c", "max_tokens": 3})
        body = answer.json()
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["prompt_tokens"] == 3
    finally:
        stop(child.process)
    assert child.process.returncode in (0, -15) and isinstance(child.process, subprocess.Popen)
