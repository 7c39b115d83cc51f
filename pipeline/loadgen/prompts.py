"""Prompt text of a given length in tokens, starting with a shared prefix where the request has one.

A token is approximated by a word: the words below are common short English words, most of
them one token (with their leading space) in the Llama 3, Qwen and GPT-4 tokenizers, and a
BPE pre-tokenizer never merges across the spaces between them. So ``n`` words are about
``n`` prompt tokens, plus the chat template's few (the server's ``usage`` says exactly, and
loadgen logs that when given). The dev server (``pipeline/dev/openai_server.py``) counts
words, so there the count is exact.

A shared prefix is the same text every time (drawn from a generator seeded by the run's
seed and the prefix's number), so a real server's prefix cache hits on it; the rest of a
prompt is drawn fresh per request, so it hits nothing.
"""

from __future__ import annotations

import random

from servewatch.models.workload.sample import RequestSpec

_COMMON_WORDS = """time year people way day man thing woman life child world school state family student group
    country problem hand part place case week company system program question work government number
    night point home water room mother area money story fact month lot right study book eye job word
    business issue side kind head house service friend father power hour game line end member law car
    city community name president team minute idea kid body information back parent face level office
    door health person art war history party result change morning reason research girl guy moment air
    teacher force education green blue red small large old new good great high long little"""
WORDS = tuple(_COMMON_WORDS.split())


class PromptBuilder:
    """Prompts for ``RequestSpec`` s: the prefix's words, then fresh ones up to the length.

    >>> builder = PromptBuilder(seed=1)
    >>> a = builder.text(RequestSpec(40, 10, "stop", prefix=0, shared_tokens=32, route=None))
    >>> b = builder.text(RequestSpec(50, 10, "stop", prefix=0, shared_tokens=32, route=None))
    >>> len(a.split()), len(b.split()), a.split()[:32] == b.split()[:32], a.split()[32:] != b.split()[32:42]
    (40, 50, True, True)
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._random = random.Random(seed)
        self._prefixes: dict[int, list[str]] = {}

    def prefix_words(self, prefix: int, count: int) -> list[str]:
        """The first ``count`` words of prefix ``prefix``: a shorter cut of one prefix is a
        prefix of a longer one."""
        words = self._prefixes.setdefault(prefix, [])
        if len(words) < count:
            generator = random.Random(f"servewatch-loadgen-prefix:{self.seed}:{prefix}")
            words[:] = generator.choices(WORDS, k=max(count, 2 * len(words)))
        return words[:count]

    def text(self, spec: RequestSpec) -> str:
        shared = self.prefix_words(spec.prefix, spec.shared_tokens) if spec.prefix is not None else []
        rest = self._random.choices(WORDS, k=max(spec.prompt_tokens - len(shared), 1))
        return " ".join(shared + rest)
