"""The store's incremental indexes: eviction and expiry candidates and per-tenant running totals.

``KVStore`` calls ``sync`` after every change to a node (refcount, pins, children, access
time, deadline) and ``count`` when a node is added or freed, so picking a victim, expiring,
admission checks and stats never walk the trie. ``check`` compares everything with a
brute-force recomputation over all nodes (``KVStore.check_integrity``).
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from prefixcache.cache.keyed_heap import KeyedHeap
from prefixcache.cache.policy import evictable, ttl_freeable
from prefixcache.cache.trie import Node


class StoreIndex:
    def __init__(self) -> None:
        # Exactly the nodes ``evictable`` holds for, keyed by last access (all tenants, and per tenant).
        self.lru: KeyedHeap[Node] = KeyedHeap()
        self.lru_by_tenant: dict[str, KeyedHeap[Node]] = {}
        # Exactly the nodes ``ttl_freeable`` holds for that have a finite deadline, keyed by it.
        self.expiry: KeyedHeap[Node] = KeyedHeap()
        # Running totals per tenant.
        self.entries: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self._pinned: set[Node] = set()
        self.pinned_bytes: Counter[str] = Counter()
        self._leased: set[Node] = set()
        self.leased_entries: Counter[str] = Counter()
        self._protected: set[Node] = set()  # pinned or leased: not reclaimable now
        self.protected_bytes: Counter[str] = Counter()

    def count(self, node: Node, sign: int) -> None:
        """A node added (+1) or freed (-1)."""
        self.entries[node.tenant] += sign
        self.tokens[node.tenant] += sign * len(node.tokens)

    def sync(self, node: Node) -> None:
        """Bring the indexes and running totals in line with ``node``'s current state (O(log n))."""
        if node.is_root:
            return
        tenant = node.tenant
        own = self.lru_by_tenant.get(tenant)
        if evictable(node):
            if own is None:
                own = self.lru_by_tenant[tenant] = KeyedHeap()
            self.lru.set(node, node.last_access)
            own.set(node, node.last_access)
        else:
            self.lru.discard(node)
            if own is not None:
                own.discard(node)
                if not own:
                    del self.lru_by_tenant[tenant]
        if ttl_freeable(node) and math.isfinite(node.expires_at):
            self.expiry.set(node, node.expires_at)
        else:
            self.expiry.discard(node)
        _flag(self._pinned, self.pinned_bytes, node, node.alive and node.pins > 0, node.nbytes)
        _flag(self._leased, self.leased_entries, node, node.alive and node.refcount > 0, 1)
        _flag(self._protected, self.protected_bytes, node, node.alive and (node.pins > 0 or node.refcount > 0),
              node.nbytes)

    def check(self, nodes: list[Node]) -> None:
        """The incremental structures against the same facts recomputed from scratch over ``nodes``."""
        lru = {n: n.last_access for n in nodes if evictable(n)}
        assert dict(self.lru.items()) == lru, "LRU index differs from the evictable leaves"
        by_tenant: dict[str, dict[Node, float]] = {}
        for node, key in lru.items():
            by_tenant.setdefault(node.tenant, {})[node] = key
        assert {t: dict(h.items()) for t, h in self.lru_by_tenant.items()} == by_tenant, "tenant LRU index drift"
        expiring = {n: n.expires_at for n in nodes if ttl_freeable(n) and math.isfinite(n.expires_at)}
        assert dict(self.expiry.items()) == expiring, "expiry index differs from the TTL candidates"
        for flagged, counter, member, weight in (
                (self._pinned, self.pinned_bytes, lambda n: n.pins > 0, lambda n: n.nbytes),
                (self._leased, self.leased_entries, lambda n: n.refcount > 0, lambda n: 1),
                (self._protected, self.protected_bytes, lambda n: n.pins > 0 or n.refcount > 0, lambda n: n.nbytes)):
            assert flagged == {n for n in nodes if member(n)}, "pinned/leased set drift"
            assert +counter == +_tally(nodes, flagged.__contains__, weight), "pinned/leased totals drift"
        assert +self.entries == +_tally(nodes, lambda n: True, lambda n: 1), "entry count drift"
        assert +self.tokens == +_tally(nodes, lambda n: True, lambda n: len(n.tokens)), "token count drift"


def total(counts: Counter[str], tenant: str | None) -> int:
    """One tenant's figure, or (None) the sum over tenants."""
    return sum(counts.values()) if tenant is None else counts[tenant]


def _tally(nodes: list[Node], member: Callable[[Node], bool], weight: Callable[[Node], int]) -> Counter[str]:
    out: Counter[str] = Counter()
    for node in nodes:
        if member(node):
            out[node.tenant] += weight(node)
    return out


def _flag(members: set[Node], totals: Counter[str], node: Node, on: bool, weight: int) -> None:
    """Add ``node`` to (or drop it from) ``members``, keeping its tenant's total in step."""
    if on and node not in members:
        members.add(node)
        totals[node.tenant] += weight
    elif not on and node in members:
        members.discard(node)
        totals[node.tenant] -= weight
