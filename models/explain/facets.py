"""Facets: how a window's requests looked, and how the anomalous window differs from the normal one.

A person handed an anomaly asks first "what changed in the traffic?": more answers cut
short, less of the prompt cached, longer prompts, one instance taking the load. Facets
answer that from the sample read back when the event fired (``models.explain.evidence_sample``):
the same few figures for the anomalous window and the segment's latest normal window, and
the differences worth saying in words (``compare``), largest first.

>>> normal = [{"finish_reason": "stop", "prompt_tokens": 1000, "cached_tokens": 900, "completion_tokens": 50,
...            "prefix_hash": "sys", "instance": "a"}] * 20
>>> now = [{**row, "cached_tokens": 0} for row in normal]
>>> compare(window_facets(now, 10.0), window_facets(normal, 0.0))
['cached share of prompt tokens 0% against 90%']
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from servewatch.models.windows.batch import normalise_reason
from servewatch.models.windows.rows import field_getter
from servewatch.schemas.anomaly import Quantiles, WindowFacets

#: Instances named in a window's mix; the rest are left out of it.
TOP_INSTANCES = 5
#: Smallest move of a share (finish reason, cached tokens, shared prefixes, an instance's
#: part of the traffic) that ``compare`` puts in words.
SHARE_STEP = 0.1
#: Smallest move of a finish reason's share when it was (nearly) absent: a few truncated
#: answers in a hundred is the news, not a tenth of them.
RARE_STEP = 0.01
#: Smallest ratio of a length quantile that ``compare`` puts in words.
LENGTH_RATIO = 1.5
#: Requests of a finish reason in the anomalous sample for a rare one to count as recurring.
RECURRING = 3
#: A share's move must also stand out of the sampling noise of two samples of a few dozen
#: requests by this many standard errors (two-proportion z): 33% against 57% of 45 is noise.
MIN_Z = 3.0


def _strength(a: float, b: float) -> float:
    """How large a move of a share is, on the scale of a length ratio's log (for ranking):
    0% against 80% outranks 4,000 tokens against 1,000."""
    return abs(math.log((a + 0.05) / (b + 0.05)))


def _median_log_se(q: Quantiles, n: int) -> float:
    """Standard error of a sample median's log, lengths taken as log-normal: 1.2533 sd / sqrt(n),
    the log sd read off the p50-p90 gap (1.2816 sd). Twenty answers of widely spread lengths
    put their median anywhere within ~1.5x."""
    sd = math.log((q.p90 + 1.0) / (q.p50 + 1.0)) / 1.2816
    return 1.2533 * max(sd, 0.05) / math.sqrt(max(n, 1))


def _significant(a: float, b: float, n_a: int, n_b: int) -> bool:
    """Whether shares ``a`` of ``n_a`` and ``b`` of ``n_b`` requests differ beyond sampling noise."""
    if not n_a or not n_b:
        return False
    pooled = (a * n_a + b * n_b) / (n_a + n_b)
    noise = math.sqrt(max(pooled * (1 - pooled), 1e-12) * (1 / n_a + 1 / n_b))
    return abs(a - b) >= MIN_Z * noise


def window_facets(rows: Sequence[Any], window_start: float) -> WindowFacets:
    """The facets of one window's sampled requests (mappings or objects)."""
    n = len(rows)
    gets = [field_getter(row) for row in rows]
    reasons = Counter(normalise_reason(str(get("finish_reason"))) for get in gets)
    reported = [(get("prompt_tokens") or 0, get("cached_tokens")) for get in gets if get("cached_tokens") is not None]
    prompt_total = sum(prompt for prompt, _ in reported)
    hashes = [h for get in gets if (h := get("prefix_hash")) is not None]
    repeated = Counter(hashes)
    instances = Counter(str(get("instance")) for get in gets if get("instance") is not None)
    return WindowFacets(
        window_start=window_start,
        requests_sampled=n,
        finish_reasons={reason: round(count / n, 4) for reason, count in reasons.most_common()},
        cached_token_share=round(sum(c for _, c in reported) / prompt_total, 4) if prompt_total else None,
        shared_prefix_share=round(sum(1 for h in hashes if repeated[h] > 1) / len(hashes), 4) if hashes else None,
        prompt_tokens=_quantiles([get("prompt_tokens") for get in gets]),
        completion_tokens=_quantiles([get("completion_tokens") for get in gets]),
        instances={name: round(count / n, 4) for name, count in instances.most_common(TOP_INSTANCES)},
    )


def _quantiles(values: list[Any]) -> Quantiles | None:
    known = np.array([v for v in values if v is not None], dtype=float)
    if not len(known):
        return None
    p50, p90, p99 = np.quantile(known, [0.5, 0.9, 0.99]).tolist()
    return Quantiles(p50=round(p50, 1), p90=round(p90, 1), p99=round(p99, 1))


def compare(now: WindowFacets, before: WindowFacets) -> list[str]:
    """The differences between two windows' facets worth a sentence each, largest first."""
    said: list[tuple[float, str]] = []
    n_now, n_before = now.requests_sampled, before.requests_sampled
    for reason in sorted(set(now.finish_reasons) | set(before.finish_reasons)):
        now_share, usual = now.finish_reasons.get(reason, 0.0), before.finish_reasons.get(reason, 0.0)
        step = RARE_STEP if min(now_share, usual) < RARE_STEP else SHARE_STEP
        # A failure mode (length, error, ...) that was all but absent and now recurs is news even
        # in samples too small for a z-test: a few cut answers in a hundred where none were.
        rare_and_back = now_share >= 2 * usual and now_share * n_now >= RECURRING
        moved = abs(now_share - usual) >= step and (rare_and_back or _significant(now_share, usual, n_now, n_before))
        if moved and reason != "stop":  # stop is what is left of the others
            text = f"finish_reason={reason} in {now_share:.0%} of requests against {usual:.0%}"
            said.append((_strength(now_share, usual), text))
    for name, a, b in (
        ("cached share of prompt tokens", now.cached_token_share, before.cached_token_share),
        ("requests sharing a prompt prefix", now.shared_prefix_share, before.shared_prefix_share),
    ):
        if (
            a is not None
            and b is not None
            and abs(a - b) >= SHARE_STEP
            and (
                name.startswith("cached") or _significant(a, b, n_now, n_before)  # a share of tokens, not requests
            )
        ):
            said.append((_strength(a, b), f"{name} {a:.0%} against {b:.0%}"))
    for name, a_q, b_q in (
        ("prompt", now.prompt_tokens, before.prompt_tokens),
        ("output", now.completion_tokens, before.completion_tokens),
    ):
        if a_q is None or b_q is None:
            continue
        ratio = (a_q.p50 + 1.0) / (b_q.p50 + 1.0)
        noise = math.hypot(_median_log_se(a_q, n_now), _median_log_se(b_q, n_before))
        if (ratio >= LENGTH_RATIO or ratio <= 1 / LENGTH_RATIO) and abs(math.log(ratio)) >= MIN_Z * noise:
            said.append((abs(math.log(ratio)), f"median {name} {a_q.p50:,.0f} tokens against {b_q.p50:,.0f}"))
    for instance in sorted(set(now.instances) | set(before.instances)):
        now_share, usual = now.instances.get(instance, 0.0), before.instances.get(instance, 0.0)
        # The instances that gained: where the traffic went (the others lost it, said once).
        if now_share - usual >= 2 * SHARE_STEP and _significant(now_share, usual, n_now, n_before):
            text = f"instance {instance} served {now_share:.0%} of requests against {usual:.0%}"
            said.append((_strength(now_share, usual), text))
    said.sort(key=lambda item: item[0], reverse=True)
    return [text for _, text in said]
