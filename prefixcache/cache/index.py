"""The store's incremental indexes: eviction and expiry candidates and per-tenant running totals.

``KVStore`` calls ``sync`` after every change to a node (refcount, pins, children, and for
a leaf its access time or deadline) and ``count`` when a node is added or freed, so picking
a victim, expiring, admission checks and stats never walk the trie. ``check`` compares
everything with a brute-force recomputation over all nodes (``KVStore.check_integrity``).

Which indexes hold a node is recorded on the node itself (``Node.indexed``, bits below), so
a sync that changes nothing (the common case: a block walked past) costs a few compares.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from prefixcache.cache.keyed_heap import KeyedHeap
from prefixcache.cache.policy import REASONS, evictable, pin_lapses, ttl_freeable
from prefixcache.cache.trie import Node

#: ``Node.indexed`` bits: in the LRU heaps, in the expiry heap, counted as pinned, counted as leased, in the
#: pin deadline heap.
LRU, EXPIRY, PINNED, LEASED, PIN_DUE = 1, 2, 4, 8, 16
_INF = math.inf


class StoreIndex:
    def __init__(self, by_tenant: bool = True) -> None:
        # Exactly the nodes ``evictable`` holds for, keyed by last access: all tenants, and (with
        # ``by_tenant``: only quota eviction reads them) per tenant.
        self.lru: KeyedHeap[Node] = KeyedHeap()
        self.by_tenant = by_tenant
        self.lru_by_tenant: dict[str, KeyedHeap[Node]] = {}
        # Exactly the nodes ``ttl_freeable`` holds for that have a finite deadline, keyed by it.
        self.expiry: KeyedHeap[Node] = KeyedHeap()
        # Exactly the nodes ``pin_lapses`` holds for (leaves or not), keyed by their pin's deadline.
        self.pin_expiry: KeyedHeap[Node] = KeyedHeap()
        # Running totals per tenant.
        self.entries: Counter[str] = Counter()
        self.tokens: Counter[str] = Counter()
        self.pinned_bytes: Counter[str] = Counter()
        self.leased_entries: Counter[str] = Counter()
        self.protected_bytes: Counter[str] = Counter()  # pinned or leased: not reclaimable now
        # Blocks freed and their bytes, keyed by (tenant, reason); store-wide figures are sums.
        self.evictions: Counter[tuple[str, str]] = Counter()
        self.reclaimed: Counter[tuple[str, str]] = Counter()

    def count(self, node: Node, sign: int) -> None:
        """A node added (+1) or freed (-1)."""
        tenant = node.tenant
        self.entries[tenant] += sign
        self.tokens[tenant] += sign * len(node.tokens)

    def evicted(self, node: Node, reason: str) -> None:
        key = node.tenant, reason
        self.evictions[key] += 1
        self.reclaimed[key] += node.nbytes

    def figures(self, tenant: str | None) -> dict[str, Any]:
        """The running totals ``KVStore.snapshot_stats`` reports, for one tenant or (None) all."""
        return {"entries": total(self.entries, tenant), "cached_tokens_held": total(self.tokens, tenant),
                "pinned_bytes": total(self.pinned_bytes, tenant), "leased_entries": total(self.leased_entries, tenant),
                "evictions": self.by_reason(self.evictions, tenant),
                "reclaimed_bytes": self.by_reason(self.reclaimed, tenant)}

    @staticmethod
    def by_reason(counts: Counter[tuple[str, str]], tenant: str | None) -> dict[str, int]:
        """Sum (tenant, reason) counts per reason, for one tenant or (None) all."""
        return {r: sum(n for (t, why), n in counts.items() if why == r and tenant in (None, t)) for r in REASONS}

    def sync(self, node: Node) -> None:
        """Bring the indexes and running totals in line with ``node``'s current state (O(log n))."""
        if node.parent is None:
            return
        old = node.indexed
        if node.alive:
            pins, refs = node.pins, node.refcount
            state = (PINNED if pins else 0) | (LEASED if refs else 0)
            if pins > node.operator_pins and node.pin_until < _INF:  # ``pin_lapses``
                state |= PIN_DUE
            if not refs and not node.num_children:  # a leaf nobody reads: ``ttl_freeable``
                if not pins:  # ``evictable``
                    state |= LRU
                if -_INF < node.expires_at < _INF:
                    state |= EXPIRY
        else:
            state = 0
        if state & LRU:
            self.lru.set(node, node.last_access)
            if self.by_tenant:
                own = self.lru_by_tenant.get(node.tenant)
                if own is None:
                    own = self.lru_by_tenant[node.tenant] = KeyedHeap()
                own.set(node, node.last_access)
        elif old & LRU:
            self.lru.discard(node)
            if self.by_tenant:
                own = self.lru_by_tenant[node.tenant]
                own.discard(node)
                if not own:
                    del self.lru_by_tenant[node.tenant]
        if state & EXPIRY:
            self.expiry.set(node, node.expires_at)
        elif old & EXPIRY:
            self.expiry.discard(node)
        if state & PIN_DUE:
            self.pin_expiry.set(node, node.pin_until)
        elif old & PIN_DUE:
            self.pin_expiry.discard(node)
        if (old ^ state) & (PINNED | LEASED):
            self._totals(node, old, state)
        node.indexed = state

    def _totals(self, node: Node, old: int, new: int) -> None:
        tenant, nbytes = node.tenant, node.nbytes
        if (old ^ new) & PINNED:
            self.pinned_bytes[tenant] += nbytes if new & PINNED else -nbytes
        if (old ^ new) & LEASED:
            self.leased_entries[tenant] += 1 if new & LEASED else -1
        if bool(old & (PINNED | LEASED)) != bool(new & (PINNED | LEASED)):
            self.protected_bytes[tenant] += nbytes if new & (PINNED | LEASED) else -nbytes

    def check(self, nodes: list[Node]) -> None:
        """The incremental structures against the same facts recomputed from scratch over ``nodes``."""
        lru = {n: n.last_access for n in nodes if evictable(n)}
        assert dict(self.lru.items()) == lru, "LRU index differs from the evictable leaves"
        by_tenant: dict[str, dict[Node, float]] = {}
        for node, key in lru.items() if self.by_tenant else ():
            by_tenant.setdefault(node.tenant, {})[node] = key
        assert {t: dict(h.items()) for t, h in self.lru_by_tenant.items()} == by_tenant, "tenant LRU index drift"
        expiring = {n: n.expires_at for n in nodes if ttl_freeable(n) and math.isfinite(n.expires_at)}
        assert dict(self.expiry.items()) == expiring, "expiry index differs from the TTL candidates"
        lapsing = {n: n.pin_until for n in nodes if pin_lapses(n)}
        assert dict(self.pin_expiry.items()) == lapsing, "pin deadline index differs from the pins with a deadline"
        for node in nodes:
            assert bool(node.indexed & LRU) == (node in lru) and bool(node.indexed & EXPIRY) == (node in expiring)
            assert bool(node.indexed & PIN_DUE) == (node in lapsing)
        for bits, counter, member, weight in (
                (PINNED, self.pinned_bytes, lambda n: n.pins > 0, lambda n: n.nbytes),
                (LEASED, self.leased_entries, lambda n: n.refcount > 0, lambda n: 1),
                (PINNED | LEASED, self.protected_bytes, lambda n: n.pins > 0 or n.refcount > 0, lambda n: n.nbytes)):
            assert all(bool(n.indexed & bits) == member(n) for n in nodes), "pinned/leased flag drift"
            assert +counter == +_tally(nodes, member, weight), "pinned/leased totals drift"
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
