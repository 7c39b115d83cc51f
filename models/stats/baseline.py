"""A segment's usual figures: what its normal windows looked like, for hints and evidence.

Hints say how a window differs from the segment's normal (``models.explain.hints``): the hit rate,
uncached and total tokens per request, requests/s, the time requests queue and prefill
takes per token. The figures are exponentially weighted over normal windows only (a window
that pages teaches nothing), kept as doubles in the segment's buffer (``models.stats.compact``).
"""

from __future__ import annotations

import math

from servewatch.models.stats.compact import CompactState, count, number


class Baseline(CompactState):
    """Exponentially weighted figures of a segment's normal windows (cheap, O(1)).

    Nine doubles, alone or in the segment's buffer (``models.stats.compact``); ``halflife`` is
    its only constructor argument. ``last_window_start`` is where the latest normal window
    began: a firing event's baseline sample is read from there (``pipeline.worker.evidence``).

    >>> usual = Baseline()
    >>> usual.learn({"requests_per_s": 2.0, "uncached_prompt_tokens_per_s": 500.0, "cache_hit_rate": 0.8,
    ...              "prompt_tokens_per_s": 2500.0, "output_tokens_per_s": 400.0}, window_start=60.0)
    >>> usual.requests_per_s, usual.uncached_tokens_per_request, usual.prompt_tokens_per_request, usual.windows
    (2.0, 250.0, 1250.0, 1)
    >>> usual.last_window_start
    60.0
    """

    __slots__ = ()
    STATE_SIZE = 9
    FIGURES = (
        "cache_hit_rate", "uncached_tokens_per_request", "requests_per_s",
        "prompt_tokens_per_request", "output_tokens_per_request", "last_window_start",
        "queue_s", "prefill_s_per_1k_tokens",
    )  # fmt: skip
    cache_hit_rate = number(0)
    uncached_tokens_per_request = number(1)
    requests_per_s = number(2)
    windows = count(3)
    prompt_tokens_per_request = number(4)
    output_tokens_per_request = number(5)
    last_window_start = number(6)  # not averaged: the latest
    queue_s = number(7)  # geometric mean of the queue time, where requests log it
    prefill_s_per_1k_tokens = number(8)  # prefill seconds per 1,000 uncached prompt tokens

    def __init__(
        self,
        halflife: float = 30.0,
        cache_hit_rate: float = math.nan,
        uncached_tokens_per_request: float = math.nan,
        requests_per_s: float = math.nan,
        windows: int = 0,
        prompt_tokens_per_request: float = math.nan,
        output_tokens_per_request: float = math.nan,
        last_window_start: float = math.nan,
        queue_s: float = math.nan,
        prefill_s_per_1k_tokens: float = math.nan,
    ) -> None:
        self._params = float(halflife)
        self._own(
            [
                cache_hit_rate, uncached_tokens_per_request, requests_per_s, float(windows),
                prompt_tokens_per_request, output_tokens_per_request, last_window_start, queue_s,
                prefill_s_per_1k_tokens,
            ]
        )  # fmt: skip

    @property
    def halflife(self) -> float:
        return float(self._params)

    def state(self) -> dict[str, float | None]:
        """Strict JSON: NaN (not seen yet) as null."""
        figures = {name: getattr(self, name) for name in self.FIGURES}
        return {
            "halflife": self.halflife,
            **{name: None if math.isnan(value) else value for name, value in figures.items()},
            "windows": self.windows,
        }

    def load_state(self, state: dict[str, float | None]) -> None:
        """Figures a state lacks (stored before they existed) start unknown."""
        figures = {name: math.nan if (value := state.get(name)) is None else float(value) for name in self.FIGURES}
        self._set_numbers(0, [figures[name] for name in self.FIGURES[:3]])
        self._set_numbers(3, [float(int(state.get("windows") or 0))])
        self._set_numbers(4, [figures[name] for name in self.FIGURES[3:]])

    @staticmethod
    def prefill_per_1k(load: dict[str, float]) -> float:
        """Prefill seconds per 1,000 uncached prompt tokens in a window's ``load`` (NaN: not logged)."""
        speed = load.get("prefill_tokens_per_s_per_request", math.nan)
        return 1000.0 / speed if speed > 0 else math.nan

    def learn(self, load: dict[str, float], window_start: float = math.nan) -> None:
        alpha = max(1.0 - 0.5 ** (1.0 / self.halflife), 1.0 / (self.windows + 1))
        rate = load["requests_per_s"]

        def per_request(name: str) -> float:
            return load.get(name, math.nan) / rate if rate > 0 else math.nan

        figures = {
            "cache_hit_rate": load.get("cache_hit_rate", math.nan),
            "uncached_tokens_per_request": per_request("uncached_prompt_tokens_per_s"),
            "requests_per_s": rate,
            "prompt_tokens_per_request": per_request("prompt_tokens_per_s"),
            "output_tokens_per_request": per_request("output_tokens_per_s"),
            "queue_s": load.get("queue_s", math.nan),
            "prefill_s_per_1k_tokens": self.prefill_per_1k(load),
        }
        for name, value in figures.items():
            if math.isnan(value):
                continue
            old = getattr(self, name)
            setattr(self, name, value if math.isnan(old) else old + alpha * (value - old))
        self.windows += 1
        if not math.isnan(window_start):
            self.last_window_start = window_start
