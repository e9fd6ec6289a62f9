"""Eviction and expiry rules, as pure functions over trie nodes.

``evictable`` and ``ttl_freeable`` say which nodes may go; the store keeps exactly
those nodes in incrementally maintained heaps (``keyed_heap``) and its
``check_integrity`` recomputes them with these predicates. Not ``cachetools.LRUCache``: only
refcount-0, unpinned *leaves* may go, and a parent becomes a candidate only once its
last child is gone, which a flat key-value LRU cannot express. ``cachetools`` would
also evict by key count or size without knowing that a node is in use.
"""
from __future__ import annotations

import math

from prefixcache.cache.trie import Node

#: Eviction reasons, as reported in stats and metrics.
REASONS = ("lru", "ttl", "quota", "flush")
#: Reasons that send a block down to the lower tiers (an expired or flushed block is gone for good).
OFFLOAD_REASONS = ("lru", "quota")


def expiry(now: float, ttl_seconds: float | None) -> float:
    return math.inf if ttl_seconds is None else now + ttl_seconds


def tenant_pins(node: Node) -> int:
    """The node's pins made by its tenant (not the operator): those have a deadline, ``pin_until``."""
    return node.pins - node.operator_pins


def pin_lapses(node: Node) -> bool:
    """A node its tenant pinned with a deadline: once it passes those pins lapse, and the node is an ordinary
    entry again (under its own TTL, ``expires_at``, evictable) unless the operator pinned it too."""
    return node.alive and tenant_pins(node) > 0 and node.pin_until < math.inf


def evictable(node: Node) -> bool:
    """A leaf nobody reads and nobody pinned."""
    return node.alive and not node.is_root and node.num_children == 0 and node.refcount == 0 and node.pins == 0


def ttl_freeable(node: Node) -> bool:
    """A leaf nobody reads: freed once its deadline passes, pinned or not (the prefix's TTL ends a pin too)."""
    return node.alive and not node.is_root and node.num_children == 0 and node.refcount == 0

