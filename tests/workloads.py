"""Random prompt streams that share prefixes in every way the cache must handle."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prompt:
    tokens: list[int]
    kind: str  # fresh | exact | strict-prefix | shared-base | continuation
    #: Tokens certainly cached before this prompt runs (exact repeats and strict prefixes).
    expect_cached_at_least: int = 0


def prompt_stream(seed: int, vocab: tuple[int, int], count: int, max_len: int = 120):
    """Yield prompts; ``send`` each prompt's generated tokens back for continuations.

    Kinds: fresh random prompts, exact repeats, strict prefixes of earlier prompts,
    shared bases with tails that end anywhere inside a block, and multi-turn
    continuations (earlier prompt + its answer + a new question).
    """
    rng = random.Random(seed)
    lo, hi = vocab
    rand = lambda n: [rng.randrange(lo, hi) for _ in range(n)]  # noqa: E731
    bases = [rand(rng.randrange(20, max_len // 2)) for _ in range(3)]
    history: list[list[int]] = []  # full sequences (prompt + answer) that were served
    prompts: list[list[int]] = []
    for i in range(count):
        kind = "fresh" if i == 0 else rng.choice(["exact", "strict-prefix", "shared-base", "shared-base",
                                                  "continuation", "fresh"])
        expect = 0
        if kind == "fresh":
            tokens = rand(rng.randrange(2, max_len // 2))
        elif kind == "exact":
            tokens = list(rng.choice(prompts))
            expect = len(tokens) - 1
        elif kind == "strict-prefix":
            src = rng.choice(prompts)
            if len(src) < 3:
                tokens, kind = list(src), "exact"
            else:
                tokens = src[: rng.randrange(2, len(src))]
            expect = len(tokens) - 1
        elif kind == "shared-base":
            base = rng.choice(bases)
            tokens = base[: rng.randrange(1, len(base) + 1)] + rand(rng.randrange(0, 20))
        else:
            tokens = list(rng.choice(history)) + rand(rng.randrange(1, 12))
        tokens = tokens[:max_len]
        answer = yield Prompt(tokens, kind, expect)
        prompts.append(tokens)
        history.append(tokens + list(answer or []))
