"""Facets of a window's sample, and the changes against the baseline worth a sentence."""

from __future__ import annotations

from typing import Any

from servewatch.models.explain.facets import compare, window_facets


def rows(n: int, **fields: Any) -> list[dict[str, Any]]:
    base = {"finish_reason": "stop", "prompt_tokens": 1000, "cached_tokens": 800, "completion_tokens": 200,
            "prefix_hash": "sys-v1", "instance": "a"}  # fmt: skip
    return [{**base, **fields} for _ in range(n)]


def test_facets_of_a_sample() -> None:
    sample = rows(8) + rows(2, finish_reason="LENGTH", instance="b", prefix_hash=None, cached_tokens=None)
    sample += [{**rows(1)[0], "prefix_hash": "unique", "prompt_tokens": 5000}]
    facets = window_facets(sample, 40.0)
    assert facets.requests_sampled == 11 and facets.window_start == 40.0
    assert facets.finish_reasons == {"stop": round(9 / 11, 4), "length": round(2 / 11, 4)}
    assert facets.cached_token_share == round(9 * 800 / (8 * 1000 + 5000), 4)  # of the prompts that reported it
    assert facets.shared_prefix_share == round(8 / 9, 4)  # 9 hashed, the unique one is not shared
    assert facets.prompt_tokens and facets.prompt_tokens.p50 == 1000 and facets.prompt_tokens.p99 > 4000
    assert facets.instances == {"a": round(9 / 11, 4), "b": round(2 / 11, 4)}


def test_an_empty_or_unlogged_sample_has_no_figures_to_compare() -> None:
    facets = window_facets([{"finish_reason": "stop"}], 0.0)
    assert facets.cached_token_share is None and facets.shared_prefix_share is None and facets.prompt_tokens is None
    assert compare(facets, facets) == []


def test_the_same_traffic_changes_nothing() -> None:
    assert compare(window_facets(rows(50), 10.0), window_facets(rows(50), 0.0)) == []


def test_truncated_answers_that_were_absent_are_news_even_in_a_small_sample() -> None:
    now = window_facets(rows(96) + rows(4, finish_reason="length"), 10.0)
    assert compare(now, window_facets(rows(90), 0.0)) == ["finish_reason=length in 4% of requests against 0%"]
    once = window_facets(rows(99) + rows(1, finish_reason="length"), 10.0)
    assert compare(once, window_facets(rows(90), 0.0)) == []  # one cut answer is not a pattern


def test_an_instance_mix_within_sampling_noise_is_not_said_but_a_real_move_is() -> None:
    before = window_facets(rows(25) + rows(20, instance="b"), 0.0)  # 56 % / 44 %
    noisy = window_facets(rows(15) + rows(30, instance="b"), 10.0)  # 33 % / 67 %: noise for 45 requests
    assert compare(noisy, before) == []
    moved = window_facets(rows(2) + rows(88, instance="b"), 10.0)  # b takes nearly everything
    assert compare(moved, before)[0] == "instance b served 98% of requests against 44%"


def test_changes_are_ranked_largest_first() -> None:
    before = window_facets(rows(60), 0.0)
    now = window_facets(rows(60, cached_tokens=0, prompt_tokens=4000), 10.0)
    assert compare(now, before) == [
        "cached share of prompt tokens 0% against 80%",
        "median prompt 4,000 tokens against 1,000",
    ]


def test_a_median_length_within_the_noise_of_a_small_sample_is_not_said() -> None:
    spread = [50, 80, 120, 180, 250, 300, 400, 500, 700, 900, 1200, 1500, 2000]  # widely spread answers
    before = window_facets([{**rows(1)[0], "completion_tokens": v} for v in spread], 0.0)
    now = window_facets([{**rows(1)[0], "completion_tokens": v * 0.6} for v in spread], 10.0)  # 0.6x, 13 each
    assert compare(now, before) == []
    many = window_facets([{**rows(1)[0], "completion_tokens": v * 0.6} for v in spread * 20], 10.0)
    wide = window_facets([{**rows(1)[0], "completion_tokens": v} for v in spread * 20], 0.0)
    assert compare(many, wide) == ["median output 240 tokens against 400"]
