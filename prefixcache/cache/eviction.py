"""Enforcing the budget, the tenant quotas and the TTL on a store, and flushing it: which blocks go, and when.

These run inside ``KVStore`` operations (under its lock) and free blocks through
``KVStore.free``. Victims come from the store's incremental indexes, so each block freed
costs O(log n), whatever the store holds; ``policy`` states the same rules over whole tries.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.cache.store import KVStore


def room(store: KVStore, own_reserved: int = 0) -> int:
    """Bytes the snapshots may take now: the budget, less room for what running requests reserve but
    ``own_reserved``, the inserting call's own reservation: the buffer its blocks are copied from, whose bytes
    they take over (``KVStore.insert``).

    Read without the ledger's lock, a plan: the store checks each block it adds again under it."""
    return min(store.config.max_bytes, store.ledger.total - store.ledger.reserved + own_reserved)


def make_room(store: KVStore, need: int, tenant: str, own_reserved: int = 0) -> bool:
    """Evict until ``need`` more bytes fit the tenant quota, the budget and the KV total; whether they do.

    Expired blocks go first; a tenant over its quota then evicts only its own least recently
    used blocks; then the least recently used blocks of any tenant go.
    """
    quota = store.config.tenant_quota_bytes
    limit = room(store, own_reserved)
    if need > limit or (quota is not None and need > quota):
        return False
    expire(store, store.now())
    if quota is not None:
        own = store.index.lru_by_tenant.get(tenant)
        while store.tenant_bytes[tenant] + need > quota:
            top = None if own is None else own.peek()
            if top is None:
                return False
            store.free(top[0], "quota")
    return evict_to(store, limit - need)


def make_room_for_tail(store: KVStore, need: int, own_reserved: int = 0) -> int:
    """With no tenant quota: evict once for all of an insert's remaining blocks (``need`` bytes in all).

    Returns the room; the caller then stores blocks while they fit. The same blocks go, in the
    same order, as ``make_room`` block by block: blocks being added are in no index, so each
    call would take the next victims of the same LRU order; and nothing expires in between (a
    victim's parent, now a leaf, was refreshed with it and keeps the later deadline). When not
    all fits, everything evictable goes, as the block-by-block calls would before failing.
    """
    limit = room(store, own_reserved)
    expire(store, store.now())
    evict_to(store, limit - need)
    return limit


def evict_to(store: KVStore, limit: int) -> bool:
    """Evict least recently used leaves until at most ``limit`` bytes are held; whether it got there."""
    lru = store.index.lru
    while store.bytes > limit:
        top = lru.peek()
        if top is None:
            return False
        store.free(top[0], "lru")
    return True


def lapse_pins(store: KVStore, now: float) -> None:
    """Drop the tenants' pins whose deadline has passed: those blocks are ordinary entries again (their own TTL,
    evictable) unless the operator pinned them too. A child's pin never outlasts its parent's (both are renewed
    together, root-first)."""
    heap = store.index.pin_expiry
    for _ in range(len(heap)):  # each pass takes its node out of the heap (``reindex``): a bound, never a wait
        top = heap.peek()
        if top is None or top[1] > now:
            break
        top[0].pins = top[0].operator_pins
        store.reindex(top[0])


def expire(store: KVStore, now: float) -> int:
    """Drop lapsed pins, then free expired blocks nobody reads, deepest first (a freed leaf's expired parent
    follows); bytes freed."""
    lapse_pins(store, now)
    freed, heap = 0, store.index.expiry
    while (top := heap.peek()) is not None and top[1] <= now:
        freed += top[0].nbytes
        store.free(top[0], "ttl")
    return freed


def flush_all(store: KVStore, tenant: str | None) -> int:
    """Drop every prefix (of one tenant, or all), deepest first; those in use die on release. Bytes freed."""
    freed, trie = 0, store.trie
    roots = [r for r in trie.roots() if tenant is None or r.tenant == tenant]
    for node in sorted(trie.iter_nodes(roots), key=lambda n: n.start, reverse=True):
        node.doomed = True  # never matched again; freed here or on release
        node.pins = node.operator_pins = 0
        store.reindex(node)
        if node.refcount == 0 and node.num_children == 0:
            freed += node.nbytes
            store.free(node, "flush")
    for root in roots:
        trie.drop_root_if_empty(root)
    return freed
