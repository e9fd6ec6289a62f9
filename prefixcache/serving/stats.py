"""Hit counters, fed with every finished call, and what ``PrefixCache.report`` returns, typed."""
from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefixcache.serving.request import CallStats


@dataclass(frozen=True, slots=True)
class HitCounts:
    """Calls served and tokens, of one tenant or all: hits took every reusable token from the cache,
    partial hits some, misses none; bypassed calls ran uncached (``CallStats.bypass_reason``)."""

    queries: int
    hits: int
    partial_hits: int
    misses: int
    bypassed: int

    @property
    def hit_rate(self) -> float:
        """Share of calls that read any prompt token from the cache (a template's opening is enough)."""
        return (self.hits + self.partial_hits) / self.queries if self.queries else 0.0

    @property
    def whole_hit_rate(self) -> float:
        """Share of calls that read every reusable prompt token from the cache (hits)."""
        return self.hits / self.queries if self.queries else 0.0

    #: Tokens of those calls: their prompts, the prompt tokens read from the cache, and those generated.
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    #: Marked chunks: calls that blended, their chunk tokens reused and recomputed, calls that could not.
    blended: int
    chunk_reused_tokens: int
    chunk_recomputed_tokens: int
    blend_fallbacks: int


class HitCounters:
    """Per-tenant counters of finished calls; the dispatcher, which serves every call, feeds them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_tenant: dict[str, Counter[str]] = {}

    def record(self, tenant: str, stats: CallStats, cached: int | None = None) -> None:
        """Count one finished call in the tenant's counters; ``cached``: the cached tokens counted for it
        (None: those it read)."""
        if cached is not None:
            stats = dataclasses.replace(stats, cached_tokens=cached)
        with self._lock:
            c = self._by_tenant.setdefault(tenant, Counter())
            c["queries"] += 1
            c["prompt_tokens"] += stats.prompt_tokens
            c["cached_tokens"] += stats.cached_tokens
            c["completion_tokens"] += stats.completion_tokens
            c["chunk_reused_tokens"] += stats.chunk_reused_tokens
            c["chunk_recomputed_tokens"] += stats.chunk_recomputed_tokens
            c["blended"] += 1 if stats.chunk_reused_tokens or stats.chunk_recomputed_tokens else 0
            c["blend_fallbacks"] += 1 if stats.blend_reason else 0
            c["bypassed" if stats.bypass_reason else stats.outcome] += 1

    def totals(self, tenant: str | None) -> Counter[str]:
        """Every counter of one tenant, or (None) summed over all."""
        with self._lock:
            if tenant is not None:
                return Counter(self._by_tenant.get(tenant, Counter()))
            total: Counter[str] = Counter()
            for c in self._by_tenant.values():
                total.update(c)
            return total

    def counts(self, tenant: str | None) -> HitCounts:
        """The reported counts of one tenant, or (None) of all."""
        c = self.totals(tenant)
        return HitCounts(queries=c["queries"], hits=c["hit"], partial_hits=c["partial"], misses=c["miss"],
                         bypassed=c["bypassed"], prompt_tokens=c["prompt_tokens"], cached_tokens=c["cached_tokens"],
                         completion_tokens=c["completion_tokens"], blended=c["blended"],
                         chunk_reused_tokens=c["chunk_reused_tokens"],
                         chunk_recomputed_tokens=c["chunk_recomputed_tokens"], blend_fallbacks=c["blend_fallbacks"])


@dataclass(frozen=True, slots=True)
class ServerFigures:
    """Figures of the whole server, not of a tenant (``report(None)`` only)."""

    kv_bytes: dict[str, int]  # all KV memory: stored, and reserved per kind of request buffer
    kv_total_bytes: int
    batching_enabled: bool
    batching_disabled_reason: str | None
    tiers: dict[str, dict[str, Any]] | None  # per lower tier (``TierChain.stats``); None: no tiers


@dataclass(frozen=True, slots=True)
class CacheReport:
    """Hit counters and memory figures of one tenant, or (``server`` set) of all.

    Memory (``KVStore.snapshot_stats``): ``bytes`` held, ``budget_bytes``, the quotas,
    ``tenant_bytes`` per tenant, ``entries`` (blocks), ``cached_tokens_held``, ``pinned_bytes``,
    ``leased_entries``, ``evictions`` and ``reclaimed_bytes`` by reason. ``breakpoints``: per
    TTL, cache breakpoint events and tokens (``Breakpoints.stats``).
    """

    counts: HitCounts
    bytes: int
    budget_bytes: int
    tenant_quota_bytes: int | None
    pin_quota_bytes: int | None
    tenant_bytes: dict[str, int]
    entries: int
    cached_tokens_held: int
    pinned_bytes: int
    leased_entries: int
    evictions: dict[str, int]
    reclaimed_bytes: dict[str, int]
    breakpoints: dict[str, dict[str, int]]
    server: ServerFigures | None = None

    @classmethod
    def of(cls, counts: HitCounts, memory: Mapping[str, Any], breakpoints: dict[str, dict[str, int]],
           server: ServerFigures | None) -> CacheReport:
        """From the store's ``snapshot_stats`` (its keys are this class's memory fields)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"counts", "breakpoints", "server"}
        return cls(counts, **{k: memory[k] for k in names}, breakpoints=breakpoints, server=server)

    def to_dict(self) -> dict[str, Any]:
        """The flat mapping ``PrefixCache.stats`` returns (server figures only when reported, tiers only
        when configured)."""
        c = self.counts
        out: dict[str, Any] = {**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)},
                               "hit_rate": c.hit_rate, "token_hit_rate": c.token_hit_rate}
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                    if f.name not in ("counts", "server")})
        if self.server is not None:
            server = {f.name: getattr(self.server, f.name) for f in dataclasses.fields(self.server)}
            if server["tiers"] is None:
                del server["tiers"]
            out.update(server)
        return out
