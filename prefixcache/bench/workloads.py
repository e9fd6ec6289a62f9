"""Workloads: seeded random token streams, in shuffled order, that share prefixes in known ways.

A ``Request`` names the conversation (``session``) it extends and the tokens it appends;
the runner keeps each system's own history, so a multi-turn round carries that
system's real answers. ``group`` names the prefix a hand-written reuse could know about
in advance (a system prompt); ``Workload.prefixes`` holds its tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from prefixcache.bench.options import BenchOptions, MultiTurnSpec, NoReuseSpec, SharedPrefixSpec


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Token ids prompts are drawn from: ``[0, vocab)`` minus special tokens."""

    vocab: int
    excluded: frozenset[int] = frozenset()

    def sample(self, rng: random.Random, n: int) -> tuple[int, ...]:
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(self.vocab)
            if t not in self.excluded:
                out.append(t)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class Request:
    index: int  # position in the run order
    session: str  # requests of one session extend one conversation history
    new_tokens: tuple[int, ...]  # appended to the session's history to form the prompt
    group: str | None  # known shared prefix this prompt starts with (None: nothing to reuse)
    round: int = 0  # turn number within the session
    last_in_session: bool = True


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: tuple[Request, ...]
    prefixes: dict[str, tuple[int, ...]]  # group -> its shared prefix tokens
    #: The closed-form ideal token hit rate where one exists (shared-prefix).
    formula_hit_rate: float | None = None

    def rounds(self) -> list[list[Request]]:
        """Requests grouped by round, run order kept: what a batch call can take at once."""
        out: dict[int, list[Request]] = {}
        for r in self.requests:
            out.setdefault(r.round, []).append(r)
        return [out[k] for k in sorted(out)]


def build(name: str, opts: BenchOptions, space: TokenSpace) -> Workload:
    builders = {"shared-prefix": shared_prefix, "multi-turn": multi_turn, "no-reuse": no_reuse}
    # One stream per workload name, so adding a workload never changes another's tokens.
    return builders[name](opts.spec(name), space, random.Random(f"{opts.seed}:{name}"))


def shared_prefix(spec: SharedPrefixSpec, space: TokenSpace, rng: random.Random) -> Workload:
    """G groups × P prompts: group system prompt (S tokens) + a fresh question (Q tokens)."""
    prefixes = {f"g{g}": space.sample(rng, spec.system_tokens) for g in range(spec.groups)}
    items = [(g, p) for g in range(spec.groups) for p in range(spec.prompts)]
    rng.shuffle(items)
    requests = tuple(
        Request(i, f"g{g}p{p}", prefixes[f"g{g}"] + space.sample(rng, spec.question_tokens), f"g{g}")
        for i, (g, p) in enumerate(items))
    return Workload("shared-prefix", requests, prefixes, spec.ideal_hit_rate)


def multi_turn(spec: MultiTurnSpec, space: TokenSpace, rng: random.Random) -> Workload:
    """U users × R rounds: each round appends the model's answer and a new question to the history."""
    system = space.sample(rng, spec.system_tokens)
    order = [u for u in range(spec.users) for _ in range(spec.rounds)]
    rng.shuffle(order)  # a user's k-th appearance is its round k, so dependencies hold
    seen: dict[int, int] = {}
    requests = []
    for i, u in enumerate(order):
        k = seen.get(u, 0)
        seen[u] = k + 1
        question = space.sample(rng, spec.question_tokens)
        requests.append(Request(i, f"u{u}", (system + question) if k == 0 else question, "system", k,
                                last_in_session=k == spec.rounds - 1))
    return Workload("multi-turn", tuple(requests), {"system": system})


def no_reuse(spec: NoReuseSpec, space: TokenSpace, rng: random.Random) -> Workload:
    """Every prompt unique: what the cache costs when it cannot help."""
    requests = tuple(Request(i, f"n{i}", space.sample(rng, spec.prompt_tokens), None) for i in range(spec.prompts))
    return Workload("no-reuse", requests, {}, 0.0)


def ideal_cached(prompt: list[int], earlier: list[list[int]]) -> int:
    """Most tokens of ``prompt`` any token-granular cache could reuse: the longest common
    prefix with an earlier sequence (prompt + answer), leaving the last token to compute."""
    best = 0
    for seq in earlier:
        n = min(len(seq), len(prompt) - 1)
        k = 0
        while k < n and seq[k] == prompt[k]:
            k += 1
        best = max(best, k)
    return best
