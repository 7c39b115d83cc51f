"""One conformance test over every registered model: the contract a detector model must keep."""

from __future__ import annotations

import json
import math
import pickle
import random
from typing import Any

import pytest

from servewatch.models import REGISTRY


def latency_stream(seed: int, n: int) -> list[tuple[dict[str, Any], float]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        traffic = 1.0 + 0.5 * math.sin(i / 20)
        x = {"requests_per_s": 10 * traffic * rng.uniform(0.9, 1.1), "prompt_tokens_per_s": 1e4 * traffic}
        out.append((x, 0.5 * traffic**0.8 * math.exp(rng.gauss(0, 0.1))))
    return out


def rate_stream(seed: int, n: int) -> list[tuple[dict[str, Any], float]]:
    """Bad requests out of each window's requests, at a rate that moves a little."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        trials = rng.randint(50, 500)
        rate = 0.01 * (1 + 0.5 * math.sin(i / 30))
        out.append(({"trials": trials}, sum(rng.random() < rate for _ in range(trials))))
    return out


def share_stream(seed: int, n: int) -> list[tuple[dict[str, Any], float]]:
    rng = random.Random(seed)
    return [({"trials": rng.randint(20, 200)}, min(max(rng.gauss(0.85, 0.03), 0.0), 1.0)) for _ in range(n)]


def cache_stream(seed: int, n: int) -> list[tuple[dict[str, Any], float]]:
    """Hit rates, and misses among the requests that reuse a prefix seen before."""
    rng = random.Random(seed)
    out: list[tuple[dict[str, Any], float]] = []
    for _ in range(n):
        trials = rng.randint(20, 200)
        reused = rng.randint(0, trials)
        missed = sum(rng.random() < 0.03 for _ in range(reused))
        out.append(({"trials": trials, "reused": reused, "reused_missed": missed}, rng.uniform(0.3, 0.5)))
    return out


def traffic_stream(seed: int, n: int) -> list[tuple[dict[str, Any], float]]:
    """Requests per window of a model, by hour of the day."""
    rng = random.Random(seed)
    return [({"hour": (i // 360) % 24}, float(rng.randint(30, 70))) for i in range(n)]


def series_stream(seed: int, n: int) -> list[tuple[dict[str, Any], float]]:
    """An exported series without load columns: latency around 0.5 s whose level wanders."""
    rng = random.Random(seed)
    return [({}, 0.5 * (1 + 0.3 * math.sin(i / 40)) * math.exp(rng.gauss(0, 0.1))) for i in range(n)]


#: How each registered model is fed: a new model must say what its windows look like.
STREAMS = {
    "load_conditioned_latency": latency_stream,
    "beta_binomial_rate": rate_stream,
    "share_level": share_stream,
    "cache_hit_rate": cache_stream,
    "traffic": traffic_stream,
    "series_level": series_stream,
}


def test_every_registered_model_has_a_stream() -> None:
    assert set(STREAMS) == set(REGISTRY)


@pytest.fixture(params=sorted(REGISTRY))
def model_name(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def model_cls(model_name: str) -> type:
    return REGISTRY[model_name]


@pytest.fixture
def stream(model_name: str) -> Any:
    return STREAMS[model_name]


def scores(model: Any, data: list[tuple[dict[str, Any], float]]) -> list[float]:
    out = []
    for x, y in data:
        out.append(model.score_one(x, y))
        model.learn_one(x, y)
    return out


def test_deterministic(model_cls: type, stream: Any) -> None:
    data = stream(1, 200)
    assert scores(model_cls(), data) == scores(model_cls(), data)


def test_quiet_during_grace_and_finite_after(model_cls: type, stream: Any) -> None:
    result = scores(model_cls(), stream(2, 200))
    assert result[0] == 0.0
    assert all(math.isfinite(s) and s >= 0 for s in result)


def test_no_look_ahead(model_cls: type, stream: Any) -> None:
    """A window's score depends only on what came before it."""
    data = stream(3, 120)
    full = scores(model_cls(), data)
    prefix = scores(model_cls(), data[:60])
    assert full[:60] == prefix


def test_state_round_trips_compactly(model_cls: type, stream: Any) -> None:
    model = model_cls()
    data = stream(4, 150)
    scores(model, data[:100])
    state = model.state()
    encoded = json.dumps(state)  # plain JSON: no pickled river objects in the state
    clone = model_cls()
    clone.load_state(json.loads(encoded))
    assert scores(clone, data[100:]) == scores(model, data[100:])
    assert len(encoded) < 2048


def test_pickles(model_cls: type, stream: Any) -> None:
    model = model_cls()
    data = stream(5, 80)
    scores(model, data[:40])
    assert scores(pickle.loads(pickle.dumps(model)), data[40:]) == scores(model, data[40:])


def test_memory_is_bounded(model_cls: type, stream: Any) -> None:
    """O(1) per segment: the state after 2,000 windows holds as many numbers as after 20 (a
    value learned later may replace a null: a demand band not seen yet)."""
    small, large = model_cls(), model_cls()
    scores(small, stream(6, 20))
    scores(large, stream(6, 2000))

    def numbers(state: Any) -> int:
        if isinstance(state, dict):
            return sum(numbers(value) for value in state.values())
        if isinstance(state, list):
            return sum(numbers(value) for value in state)
        return 1

    assert numbers(large.state()) == numbers(small.state())
    assert len(json.dumps(large.state())) <= len(json.dumps(small.state())) + 64 + 20 * 8


def test_clone_keeps_config(model_cls: type, stream: Any) -> None:
    """river's contract: constructor arguments are the config, clone() gives a fresh model."""
    model = model_cls()
    scores(model, stream(7, 30))
    fresh = model.clone()
    assert fresh._get_params() == model._get_params()
    assert scores(fresh, stream(7, 10))[0] == 0.0


def test_a_view_in_a_shared_buffer_learns_like_the_model_alone(model_cls: type, stream: Any) -> None:
    """Segments keep every model's numbers in one buffer (``models.stats.compact``): a view there
    must score exactly as the model alone, and write only its own numbers."""
    from array import array

    alone, template = model_cls(), model_cls()
    buffer = array("d", [1.5, -2.5])  # someone else's numbers before it...
    at = template.append_to(buffer)
    buffer.extend([3.5])  # ...and after it
    data = stream(8, 120)
    assert scores(template.view(buffer, at), data) == scores(alone, data)
    assert buffer[:2].tolist() == [1.5, -2.5] and buffer[-1] == 3.5
    assert template.view(buffer, at).state() == alone.state()
    assert template.n_learned == 0  # the template itself learned nothing
