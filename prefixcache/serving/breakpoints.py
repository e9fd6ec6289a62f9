"""Cache breakpoints: explicit prefixes a caller asks to keep for a TTL, and usage as Anthropic counts it.

A breakpoint (``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` on a block)
closes the prefix that runs tools, then system, then messages up to the marked block.
Rules: at most ``MAX_BREAKPOINTS``; a longer TTL may not follow a shorter one; a prefix
shorter than ``CacheConfig.breakpoint_min_tokens`` is not kept (and nothing fails).

Automatic prefix reuse stays on: a request reads the longest cached prefix of its prompt,
and the engine stores its prompt and answer with the default TTL as for any request. After
the answer, each breakpoint long enough keeps its prefix's stored path for at least its TTL
(``KVStore.retain``; a later deadline stays), so it is refreshed whenever a request with the
same breakpoint is served. Like every entry, it may still be evicted under memory pressure:
then the next request recomputes it, never fails.

Usage (``account``): ``cache_read_input_tokens`` are the prompt tokens read from the cache;
``cache_creation_input_tokens`` the tokens after them up to the last breakpoint kept, split
by the TTL of the breakpoint whose segment holds them; ``input_tokens`` the rest.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.errors import InvalidRequestError

#: Breakpoint TTLs as Anthropic names them (``cache_control.ttl``), and as OpenAI does
#: (``prompt_cache_options.ttl``, ``prompt_cache_breakpoint.ttl``), in seconds.
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
OPENAI_TTLS = {"30m": 1800.0, "12h": 43200.0}
TTL_SECONDS = {**ANTHROPIC_TTLS, **OPENAI_TTLS}
DEFAULT_TTL = "5m"
MAX_BREAKPOINTS = 4
#: ``prompt_cache_retention`` values (OpenAI): None keeps the server's default TTL.
RETENTION_SECONDS: dict[str, float | None] = {"in_memory": None, "24h": 86400.0}
#: What ``Breakpoints.stats`` counts per TTL.
EVENTS = ("reads", "writes", "short", "dropped", "read_tokens", "write_tokens")


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """One breakpoint: where it was marked (for errors), its TTL and the prefix length it closes."""

    where: str
    ttl: str
    position: int = 0

    @property
    def ttl_seconds(self) -> float:
        return TTL_SECONDS[self.ttl]

    @property
    def control(self) -> str:
        """The path of its ``cache_control`` in the request (the top-level one is "cache_control")."""
        return self.where if self.where == "cache_control" else f"{self.where}.cache_control"


def check_breakpoints(marks: Sequence[Breakpoint]) -> None:
    """Anthropic's rules on the marked blocks, in prefix order. Raises ``InvalidRequestError``."""
    if len(marks) > MAX_BREAKPOINTS:
        raise InvalidRequestError(f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                                  f"Found {len(marks)}.", param=marks[MAX_BREAKPOINTS].where)
    shorter = None
    for mark in marks:
        if mark.ttl not in ANTHROPIC_TTLS:
            raise InvalidRequestError(f"{mark.control}.ttl must be one of {sorted(ANTHROPIC_TTLS)}",
                                      param=f"{mark.control}.ttl")
        if shorter is not None and mark.ttl_seconds > shorter.ttl_seconds:
            raise InvalidRequestError(
                f"a cache_control block with ttl='{mark.ttl}' ({mark.where}) must not come after one with a shorter "
                f"ttl='{shorter.ttl}' ({shorter.where}): longer TTLs go first (tools, then system, then messages)",
                param=f"{mark.control}.ttl")
        if shorter is None or mark.ttl_seconds < shorter.ttl_seconds:
            shorter = mark


@dataclass(frozen=True, slots=True)
class CacheUsage:
    """A request's input tokens as Anthropic counts them (the three parts sum to the prompt)."""

    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


def account(prompt_tokens: int, read: int, breakpoints: Sequence[Breakpoint], kept: Sequence[bool],
            held: int | None = None) -> tuple[CacheUsage, list[tuple[str, str, int]]]:
    """Usage of a prompt of which ``read`` tokens came from the cache, and the events to count.

    ``kept[i]``: breakpoint i's prefix is stored for its TTL (False: too short, or not stored).
    ``held``: leading tokens the store held before the request (None: ``read``). The last prompt token
    is always recomputed (its logits start the answer), so a breakpoint closing the whole prompt is a
    read when the store held all of it, its last token counted as input, not as written again.
    Events are ``(ttl, event, amount)`` with ``event`` in ``EVENTS``.
    """
    held = read if held is None else max(held, read)
    covered, previous = max(read, min(held, prompt_tokens)), 0
    created = Counter()
    events: list[tuple[str, str, int]] = []
    for bp, keep in zip(breakpoints, kept):
        read_here = max(0, min(read, bp.position) - previous)
        previous = max(previous, bp.position)
        if read_here:
            events.append((bp.ttl, "read_tokens", read_here))
        if bp.position > 0 and (read >= bp.position or (held >= bp.position == prompt_tokens and read == bp.position - 1)):
            events.append((bp.ttl, "reads", 1))
        elif keep:
            new = max(0, bp.position - covered)
            created[bp.ttl] += new
            events += [(bp.ttl, "writes", 1), (bp.ttl, "write_tokens", new)]
        covered = max(covered, bp.position) if keep else covered
    creation = sum(created.values())
    usage = CacheUsage(prompt_tokens - read - creation, read, creation, created["5m"], created["1h"])
    return usage, events


class Breakpoints:
    """Keeps breakpoint prefixes in a ``KVStore`` and counts reads and writes per tenant and TTL."""

    def __init__(self, store: KVStore, min_tokens: int):
        self.store, self.min_tokens = store, min_tokens
        self._lock = threading.Lock()
        self._counts: dict[str, Counter[tuple[str, str]]] = {}

    def predict(self, scope: Scope, tokens: Sequence[int], breakpoints: Sequence[Breakpoint]) -> CacheUsage:
        """The usage a request reports before it is served (nothing pinned, touched or counted): the tokens it
        would read now, and no cache write. A breakpoint is written only once the answer is stored, and memory
        pressure may drop it then (``settle``), so the tokens it would write count as input until settled."""
        read = self.store.peek(scope, tokens, len(tokens) - 1)
        return account(len(tokens), read, breakpoints, [False] * len(breakpoints), self.held(scope, tokens))[0]

    def held(self, scope: Scope, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` the store holds now (nothing pinned, touched or counted)."""
        return self.store.peek(scope, tokens, len(tokens))

    def settle(self, scope: Scope, tokens: Sequence[int], breakpoints: Sequence[Breakpoint],
               read: int, held: int | None = None) -> CacheUsage:
        """After a request was served (``read`` tokens from the cache; ``held``: tokens the store held before
        it, ``held`` above): keep each breakpoint's prefix for its TTL, count what was read and written, and
        return the request's usage."""
        kept = []
        for bp in breakpoints:
            long_enough = bp.position >= self.min_tokens
            ok = long_enough and self.store.retain(scope.with_ttl(bp.ttl_seconds),
                                                   tokens[: bp.position]) >= bp.position
            kept.append(ok)
        usage, events = account(len(tokens), read, breakpoints, kept, held)
        for bp, ok in zip(breakpoints, kept):
            if not ok and read < bp.position:
                events.append((bp.ttl, "short" if bp.position < self.min_tokens else "dropped", 1))
        with self._lock:
            counts = self._counts.setdefault(scope.tenant, Counter())
            for ttl, event, amount in events:
                counts[ttl, event] += amount
        return usage

    def stats(self, tenant: str | None = None) -> dict[str, dict[str, int]]:
        """Per TTL: breakpoints read (their whole prefix came from the cache), written (kept now), too
        short, dropped (not stored: memory pressure), and tokens read and written; one tenant or all."""
        with self._lock:
            tables = self._counts.values() if tenant is None else [self._counts.get(tenant, Counter())]
            return {ttl: {event: sum(c[ttl, event] for c in tables) for event in EVENTS} for ttl in TTL_SECONDS}
