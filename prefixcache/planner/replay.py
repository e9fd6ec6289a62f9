"""Replay a trace through the real trie, eviction policy and store, with byte sizes and no tensors.

Each trace block is one node of a ``KVStore`` whose block size is one id (``SizedRuns``
gives every node the bytes of ``block_tokens`` tokens). For every request, in time order,
at its own time on an injected clock:

1. ``acquire`` its chain up to ``match_blocks`` (the longest leading run of live full
   blocks, refreshed with the TTL), as the engine does;
2. with a second tier, ``acquire`` there too: blocks past the first tier's match are
   second-tier hits, reported apart;
3. ``insert`` the blocks it stores (budget, quota and TTL applied by the store; blocks
   evicted for room move to the second tier, expired ones are dropped);
4. ``release`` both leases.

The store's sweeper runs every ``sweep_interval_seconds`` of trace time, as in the server,
so bytes held fall when prefixes expire; a last sweep at the final request's time makes
the TTL eviction count "expired by the end of the trace".
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from prefixcache.cache.handles import EvictedSnapshot
from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.policy import REASONS
from prefixcache.cache.scope import Scope
from prefixcache.cache.sized import SizedRuns
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.planner.trace import Trace

#: Budget of an "unlimited" store: more than any trace can fill.
UNLIMITED = 1 << 62
#: Evictions that move a block to the second tier (an expired or flushed block is gone for good).
TIER_REASONS = ("lru", "quota")
_SWEEP = {f.name: f.default for f in fields(CacheConfig)}["sweep_interval_seconds"]


@dataclass(frozen=True, slots=True)
class Scenario:
    """One grid point and the what-if knobs; each maps to a ``CacheConfig`` field or an operator action."""

    budget_bytes: int | None  # max_bytes; None: unlimited
    ttl_seconds: float | None  # ttl_seconds; None: no TTL
    kv_bytes_per_token: int
    tenant_quota_bytes: int | None = None  # tenant_quota_bytes
    pins: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (tenant, leading block ids) pinned by the operator
    tier2_bytes: int | None = None  # a second tier of this budget; None: none
    tier2_ttl_seconds: float | None = None
    sweep_interval_seconds: float | None = _SWEEP  # the server's sweeper; None: none


@dataclass(slots=True)
class PointResult:
    budget_bytes: int | None
    ttl_seconds: float | None
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_requests: int = 0
    tier2_tokens: int = 0
    tier2_hit_requests: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    tier2_evictions: dict[str, int] = field(default_factory=dict)
    mean_bytes: float = 0.0
    peak_bytes: int = 0
    tier2_mean_bytes: float = 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def request_hit_rate(self) -> float:
        return self.hit_requests / self.requests if self.requests else 0.0

    @property
    def tier2_token_hit_rate(self) -> float:
        return self.tier2_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(token_hit_rate=self.token_hit_rate, request_hit_rate=self.request_hit_rate,
                   tier2_token_hit_rate=self.tier2_token_hit_rate)
        return out


class _Clock:
    __slots__ = ("now",)

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


class _Held:
    """Time-weighted mean of a store's bytes over the trace."""

    __slots__ = ("store", "start", "last", "area", "peak")

    def __init__(self, store: KVStore, start: float):
        self.store, self.start, self.last, self.area, self.peak = store, start, start, 0.0, 0

    def advance(self, t: float) -> None:
        self.area += self.store.bytes * (t - self.last)
        self.last = t

    def mark(self) -> None:
        self.peak = max(self.peak, self.store.bytes)

    def mean(self) -> float:
        span = self.last - self.start
        return self.area / span if span > 0 else float(self.store.bytes)


def _store(budget: int | None, ttl: float | None, quota: int | None, block_bytes: int, clock: _Clock,
           on_evict: Callable[[EvictedSnapshot], None] | None) -> tuple[KVStore, Callable]:
    cfg = CacheConfig(max_bytes=UNLIMITED if budget is None else budget, block_size=1, ttl_seconds=ttl,
                      tenant_quota_bytes=quota, pin_ttl_seconds=None, hash_seed=0)
    runs = SizedRuns()
    store = KVStore(cfg, BlockHasher(0), clock, on_evict=on_evict, kv_ops=runs)
    return store, lambda start, end: runs.run(end - start, block_bytes)


def replay(trace: Trace, sc: Scenario, progress: Callable[[int], None] | None = None) -> PointResult:
    """Replay ``trace`` under ``sc``; ``progress(n)`` is called every few thousand requests."""
    block_bytes = trace.block_tokens * sc.kv_bytes_per_token
    bt = trace.block_tokens
    clock = _Clock(trace.ts[0])
    tier2 = slice2 = None
    if sc.tier2_bytes is not None:
        tier2, slice2 = _store(sc.tier2_bytes, sc.tier2_ttl_seconds, None, block_bytes, clock, None)

    def offload(snap: EvictedSnapshot) -> None:
        if tier2 is not None and snap.reason in TIER_REASONS:
            tier2.insert(Scope(snap.namespace, snap.tenant, sc.tier2_ttl_seconds), snap.tokens, slice2)

    store, slice1 = _store(sc.budget_bytes, sc.ttl_seconds, sc.tenant_quota_bytes, block_bytes, clock,
                           offload if tier2 is not None else None)
    res = PointResult(sc.budget_bytes, sc.ttl_seconds)
    for tenant, ids in sc.pins:
        store.insert(Scope((tenant,), tenant), ids, slice1, pin=True, privileged=True)
    held = _Held(store, clock.now)
    held2 = _Held(tier2, clock.now) if tier2 is not None else None
    every, origin = sc.sweep_interval_seconds, clock.now
    next_sweep = origin + every if every else math.inf
    ts, tenants, names, match, offsets, ids = (trace.ts, trace.tenant, trace.tenants, trace.match_blocks,
                                               trace.offsets, trace.ids)
    cached_blocks = tier2_blocks = 0
    scopes: dict[str, tuple[Scope, Scope]] = {}  # per tenant: in the store, in the second tier
    for i in range(len(trace)):
        t = ts[i]
        while next_sweep <= t:  # the sweeper's ticks up to now; ticks with nothing due are skipped
            _sweep(store, tier2, held, held2, clock, next_sweep)
            due = min(_due(store), _due(tier2), t)
            next_sweep = max(next_sweep + every, origin + math.ceil((due - origin) / every) * every)
        held.advance(t)
        if held2 is not None:
            held2.advance(t)
        clock.now = t
        tenant = names[tenants[i]]
        scope, scope2 = scopes.get(tenant) or scopes.setdefault(tenant, (
            Scope((tenant,), tenant, sc.ttl_seconds), Scope((tenant,), tenant, sc.tier2_ttl_seconds)))
        chain = tuple(ids[offsets[i] : offsets[i + 1]])
        lease2 = None
        if tier2 is not None:
            lease2 = tier2.acquire(scope2, chain, match[i])
        # One insert does what the engine's acquire + insert + release do at one instant: it walks the
        # live leading blocks (the match), refreshes them with the TTL and stores the rest.
        walked = 0
        if chain:
            done = store.insert(scope, chain, slice1)
            walked = done.stored_tokens - done.new_bytes // block_bytes
        hit = min(walked, match[i])
        cached_blocks += hit
        res.hit_requests += hit > 0
        if lease2 is not None:
            extra = max(0, lease2.cached_tokens - hit)
            tier2_blocks += extra
            res.tier2_hit_requests += extra > 0
            tier2.release(lease2)
        held.mark()
        if progress is not None and (i + 1) % 4096 == 0:
            progress(4096)
    if progress is not None:
        progress(len(trace) % 4096)
    _sweep(store, tier2, held, held2, clock, ts[len(trace) - 1])
    res.requests = len(trace)
    res.prompt_tokens = sum(trace.prompt_tokens)
    res.cached_tokens, res.tier2_tokens = cached_blocks * bt, tier2_blocks * bt
    res.evictions = dict(store.evictions)
    res.mean_bytes, res.peak_bytes = held.mean(), held.peak
    if tier2 is not None:
        res.tier2_evictions = dict(tier2.evictions)
        res.tier2_mean_bytes = held2.mean()
    else:
        res.tier2_evictions = dict.fromkeys(REASONS, 0)
    return res


def _sweep(store: KVStore, tier2: KVStore | None, held: _Held, held2: _Held | None, clock: _Clock,
           t: float) -> None:
    held.advance(t)
    if held2 is not None:
        held2.advance(t)
    clock.now = t
    store.sweep()
    if tier2 is not None:
        tier2.sweep()


def _due(store: KVStore | None) -> float:
    """The earliest deadline a sweep could act on (inf: none)."""
    top = None if store is None else store.index.expiry.peek()
    return math.inf if top is None else top[1]


def logged_hit_rate(trace: Trace) -> float | None:
    """The token hit rate the server itself reported in a request log (None: the trace does not say)."""
    if len(trace) == 0 or trace.logged_cached[0] < 0:
        return None
    return sum(trace.logged_cached) / sum(trace.prompt_tokens)

