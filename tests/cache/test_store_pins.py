"""Pins are a privilege with a budget; store work does not grow with what is stored."""
from __future__ import annotations

import pytest

from prefixcache.errors import CapacityError, PinQuotaExceededError
from tests.cache.store_helpers import BYTES_PER_TOKEN, insert, lookup, make_store, scope

B = 4
BLOCK = B * BYTES_PER_TOKEN


def seq(first: int, n: int) -> list[int]:
    return [first] + [7] * (n - 1)


def test_a_pin_over_the_tenant_pin_quota_is_refused_and_evicts_nothing(clock):
    store = make_store(clock, blocks_budget=8, block_size=B, pin_quota_blocks=2)
    insert(store, "b", seq(1, 6 * B))  # b fills most of the budget
    before = store.snapshot_stats()
    with pytest.raises(PinQuotaExceededError) as info:
        insert(store, "a", seq(2, 3 * B), pin=True)
    assert isinstance(info.value, CapacityError)
    assert (info.value.need_bytes, info.value.quota_bytes, info.value.pinned_bytes) == (3 * BLOCK, 2 * BLOCK, 0)
    after = store.snapshot_stats()
    assert after["tenant_bytes"] == before["tenant_bytes"] and after["evictions"] == before["evictions"]
    store.check_integrity()


def test_pin_quota_counts_what_a_tenant_has_pinned_and_unpin_gives_it_back(clock):
    store = make_store(clock, blocks_budget=16, block_size=B, pin_quota_blocks=3)
    insert(store, "a", seq(1, 2 * B), pin=True)
    insert(store, "a", seq(1, 2 * B), pin=True)  # pinning it again pins no new bytes
    with pytest.raises(PinQuotaExceededError):
        insert(store, "a", seq(2, 2 * B), pin=True)
    insert(store, "b", seq(2, 3 * B), pin=True)  # another tenant has its own quota
    insert(store, "a", seq(1, 3 * B), pin=True)  # extends the pinned path by one block: fits
    assert store.snapshot_stats("a")["pinned_bytes"] == 3 * BLOCK
    for _ in range(2):
        assert store.unpin(scope("a"), seq(1, 2 * B))
    assert store.unpin(scope("a"), seq(1, 3 * B))
    assert store.snapshot_stats("a")["pinned_bytes"] == 0
    insert(store, "a", seq(2, 2 * B), pin=True)
    store.check_integrity()


def test_privileged_pins_are_not_limited_by_the_pin_quota(clock):
    store = make_store(clock, blocks_budget=16, block_size=B, pin_quota_blocks=1)
    assert insert(store, "a", seq(1, 4 * B), pin=True, privileged=True).complete
    assert store.snapshot_stats("a")["pinned_bytes"] == 4 * BLOCK
    with pytest.raises(PinQuotaExceededError):  # and they count against the tenant's own pins
        insert(store, "a", seq(2, 1), pin=True)
    store.check_integrity()


def test_default_pin_quota_is_an_eighth_of_the_budget():
    from prefixcache.config import CacheConfig

    assert CacheConfig(max_bytes=800).pin_quota_bytes == 100
    assert CacheConfig(max_bytes=800, tenant_pin_quota_bytes=300).pin_quota_bytes == 300


def test_insert_lookup_stats_and_admission_never_walk_the_trie(clock, monkeypatch):
    """Under pressure, TTL expiry included, the store works from its indexes and running totals."""
    store = make_store(clock, blocks_budget=40, block_size=B, quota_blocks=30)
    for i in range(10):
        insert(store, "a" if i % 2 else "b", seq(i, 4 * B), ttl=10.0 if i < 5 else 300.0)
    clock.advance(20)  # the first five expire

    def walk(*_args, **_kwargs):
        raise AssertionError("a full walk of the trie")

    monkeypatch.setattr(store.trie, "iter_nodes", walk)
    for i in range(10, 30):
        insert(store, "a", seq(i, 3 * B))  # each insert evicts (quota and budget)
        store.release(lookup(store, "a", seq(i, 3 * B)))
        store.snapshot_stats("a")
        store.snapshot_stats()
        store.can_admit(BLOCK, "b")
        store.sweep()
        clock.advance(1)
    assert store.snapshot_stats()["evictions"]["ttl"] > 0 and store.snapshot_stats()["evictions"]["quota"] > 0
    monkeypatch.undo()
    store.check_integrity()


def test_unpinning_a_shorter_path_than_was_pinned_is_refused(clock):
    """A pin of 10 tokens also counts in the blocks of its first 6: undoing a pin of 6 tokens there would strand
    the pin on its last block, which no unpin could then reach."""
    store = make_store(clock, blocks_budget=100)
    tokens = list(range(10))
    insert(store, "a", tokens, pin=True)
    pinned = store.snapshot_stats("a")["pinned_bytes"]
    assert store.unpin(scope("a"), tokens[:6]) == 0 and store.snapshot_stats("a")["pinned_bytes"] == pinned
    assert store.unpin(scope("a"), tokens) == 10 and store.snapshot_stats("a")["pinned_bytes"] == 0
    insert(store, "a", tokens[:8], pin=True)  # a pin that ends at a block boundary, under a longer one
    insert(store, "a", tokens, pin=True)
    assert store.unpin(scope("a"), tokens[:8]) == 8 and store.unpin(scope("a"), tokens) == 10
    assert store.snapshot_stats("a")["pinned_bytes"] == 0
    store.check_integrity()
