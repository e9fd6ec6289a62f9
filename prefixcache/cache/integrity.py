"""The store's invariants, checked from the outside (tests call ``KVStore.check_integrity``).

Both functions read the store through its public attributes; ``KVStore.audit`` and
``KVStore.check_integrity`` call them under the store's lock.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING

from prefixcache.cache.policy import tenant_pins

if TYPE_CHECKING:
    from prefixcache.cache.store import KVStore


def audit_store(store: KVStore) -> dict[str, int]:
    """Recount by walking every node (O(n)): bytes of live snapshot tensors and refcounts held,
    beside the accounted bytes."""
    nodes = list(store.trie.iter_nodes())
    return {"accounted_bytes": store.bytes,
            "live_tensor_bytes": sum(n.kv.numel() * n.kv.element_size() for n in nodes if n.kv is not None),
            "refcounts": sum(n.refcount for n in nodes) + sum(r.refcount for r in store.trie.roots())}


def check_store(store: KVStore) -> None:
    """Raise AssertionError if any invariant of the store is broken.

    Bytes held equal the bytes of live snapshot tensors (overall and per tenant);
    refcounts and pins are never negative; every node is reachable from its root
    and indexed under its parent; partial blocks are leaves; a parent never
    expires, or loses a pin, before its child; a pin's deadline is within
    ``pin_ttl_seconds`` of now or (the operator's) none; the budget holds. The eviction and expiry indexes
    and the running totals equal a brute-force recomputation over every node.
    """
    bs, total, per_tenant = store.config.block_size, 0, Counter()
    now, pin_ttl = store.now(), store.config.pin_ttl_seconds
    nodes = list(store.trie.iter_nodes())
    for root in store.trie.roots():
        assert root.alive and root.refcount >= 0 and root.namespace is not None
    for node in nodes:
        parent = node.parent
        assert node.alive and node.kv is not None, "freed node still reachable"
        assert node.refcount >= 0 and node.pins >= node.operator_pins >= 0
        assert parent is not None and parent.alive and node.start == parent.end
        assert node in parent.keyed(node.key) and node in parent.starting(node.tokens[0])
        assert (node.only is not None) == (node.num_children == 1) == (node.by_key is None and node.num_children > 0)
        assert (node.by_key is None) == (node.by_first is None)
        assert node.by_key is None or sum(map(len, node.by_key.values())) == node.num_children
        assert parent.is_root or len(parent.tokens) == bs, "partial block with children"
        assert 0 < len(node.tokens) <= bs and node.tenant == parent.tenant
        assert node.num_children == sum(1 for _ in node.children())
        assert parent.is_root or parent.expires_at >= node.expires_at or parent.doomed
        # A pin covers its path from the root, the operator's and the tenant's each, and a tenant's lapses there
        # no sooner than below (renewed root-first) and within pin_ttl_seconds of now; the operator's never.
        mine = tenant_pins(node)
        assert parent.is_root or (parent.operator_pins >= node.operator_pins and tenant_pins(parent) >= mine)
        assert not mine or parent.is_root or parent.pin_until >= node.pin_until
        assert not mine or node.pin_until <= now + (pin_ttl or math.inf)
        assert node.nbytes == store.payloads.nbytes(node.kv)
        assert store.payloads.tokens(node.kv) == len(node.tokens)
        total += node.nbytes
        per_tenant[node.tenant] += node.nbytes
    # Exact memory: every run tensor is covered by the live blocks viewing it.
    store.runs.check(nodes)
    assert total == store.bytes, f"accounted {store.bytes} != live {total}"
    assert all(per_tenant[t] == b for t, b in store.tenant_bytes.items()), "tenant bytes drift"
    assert store.bytes <= store.config.max_bytes, "over budget"
    store.index.check(nodes)
