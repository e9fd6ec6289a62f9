"""Pins are a privilege with a budget; store work does not grow with what is stored."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.errors import CapacityError, PinQuotaExceededError
from tests.cache.store_helpers import BYTES_PER_TOKEN, insert, lookup, make_store, scope
from tests.conftest import FakeClock

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


def test_a_pin_lapses_after_pin_ttl_seconds_whatever_ttl_the_block_had(clock):
    """A prefix stored with a huge TTL, then pinned by its tenant: the pin has a deadline of its own
    (pin_ttl_seconds, 3600 here, from the pin or its last read), so it lapses; the block then stays an
    ordinary entry under its own TTL, which least recently used eviction may take. The operator's pin has none."""
    store = make_store(clock, blocks_budget=4, block_size=B)
    tokens, other = seq(1, 2 * B), seq(2, 2 * B)
    insert(store, "a", tokens, ttl=1e9)
    insert(store, "a", tokens, ttl=3600, pin=True)
    insert(store, "b", other, ttl=1e9, pin=True, privileged=True)
    clock.advance(3000)
    store.release(lookup(store, "a", tokens, ttl=60))  # a read renews the pin: 3600 s from now
    clock.advance(3599)
    assert store.snapshot_stats("a")["pinned_bytes"] == 2 * BLOCK
    clock.advance(1)
    assert store.snapshot_stats("a")["pinned_bytes"] == 0 and store.unpin(scope("a"), tokens) == 0
    assert store.peek(scope("a"), tokens, len(tokens)) == 2 * B  # still stored, under its own TTL
    store.check_integrity()
    insert(store, "c", seq(3, 2 * B))  # the budget is full: the lapsed blocks go, the operator's pin stays
    assert store.snapshot_stats("a")["bytes"] == 0 and store.snapshot_stats()["evictions"]["lru"] == 2
    assert store.snapshot_stats("b")["pinned_bytes"] == 2 * BLOCK
    store.check_integrity()


def test_a_tenant_s_pin_of_an_operator_pinned_path_leaves_the_operator_s_pin_without_a_deadline(clock):
    store = make_store(clock, blocks_budget=2, block_size=B, pin_ttl=100)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens, ttl=None, pin=True, privileged=True)
    insert(store, "a", tokens, ttl=None, pin=True)
    clock.advance(1000)
    assert store.snapshot_stats("a")["pinned_bytes"] == 2 * B * BYTES_PER_TOKEN
    assert not insert(store, "b", seq(2, B)).complete  # no room: the pinned path never gives way
    store.check_integrity()


def test_the_operator_s_pins_and_a_tenant_s_pins_are_counted_and_undone_apart(clock):
    """Each caller undoes its own pins only: a tenant's unpin never takes the operator's pin, nor the reverse."""
    store = make_store(clock, blocks_budget=10, block_size=B, pin_ttl=100)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens, ttl=None, pin=True)
    insert(store, "a", tokens, ttl=None, pin=True, privileged=True)
    assert store.unpin(scope("a"), tokens) == len(tokens)
    assert store.unpin(scope("a"), tokens) == 0  # the operator's pin is not the tenant's to undo
    assert store.snapshot_stats("a")["pinned_bytes"] == 2 * BLOCK
    insert(store, "a", tokens, ttl=None, pin=True)
    assert store.unpin(scope("a"), tokens, privileged=True) == len(tokens)
    assert store.unpin(scope("a"), tokens, privileged=True) == 0  # nor the tenant's the operator's
    assert store.snapshot_stats("a")["pinned_bytes"] == 2 * BLOCK
    assert store.unpin(scope("a"), tokens) == len(tokens) and store.snapshot_stats("a")["pinned_bytes"] == 0
    store.check_integrity()


@pytest.mark.parametrize("operator_first", [True, False])
def test_a_tenant_s_pin_keeps_its_own_deadline_beside_the_operator_s_pin(clock, operator_first):
    """The operator's pin (no deadline) neither lifts nor ends a tenant's pin of the same prefix: the tenant's
    lapses pin_ttl_seconds (100 here) after its last use (the second pin walks the path, a use as a read is), the
    operator's stays until the operator unpins it."""
    store = make_store(clock, blocks_budget=10, block_size=B, pin_ttl=100)
    tokens = seq(1, 2 * B)
    pins = [dict(privileged=True), dict(privileged=False)]
    insert(store, "a", tokens, ttl=None, pin=True, **pins[not operator_first])
    clock.advance(50)
    insert(store, "a", tokens, ttl=None, pin=True, **pins[operator_first])
    last_use = clock()
    clock.now = last_use + 99
    store.check_integrity()
    assert store.unpin(scope("a"), tokens, privileged=True) == len(tokens)
    assert store.snapshot_stats("a")["pinned_bytes"] == 2 * BLOCK  # the tenant's pin, for one more second
    clock.now = last_use + 100
    assert store.snapshot_stats("a")["pinned_bytes"] == 0 and store.unpin(scope("a"), tokens) == 0
    store.check_integrity()
    insert(store, "a", tokens, ttl=None, pin=True, privileged=True)
    insert(store, "a", tokens, ttl=None, pin=True)
    clock.advance(10_000)  # the tenant's pin lapses; the operator's stays, and is still the operator's to undo
    assert store.snapshot_stats("a")["pinned_bytes"] == 2 * BLOCK and store.unpin(scope("a"), tokens) == 0
    assert store.unpin(scope("a"), tokens, privileged=True) == len(tokens)
    assert store.snapshot_stats("a")["pinned_bytes"] == 0
    store.check_integrity()


def test_a_lapsed_pin_counts_against_no_pin_quota(clock):
    store = make_store(clock, blocks_budget=10, block_size=B, pin_quota_blocks=2, pin_ttl=100)
    insert(store, "a", seq(1, 2 * B), pin=True)
    clock.advance(100)  # that pin lapses: the quota is free again
    assert insert(store, "a", seq(2, 2 * B), pin=True).complete
    assert store.snapshot_stats("a")["pinned_bytes"] == 2 * B * BYTES_PER_TOKEN
    store.check_integrity()


def test_admission_counts_no_lapsed_pin(clock):
    store = make_store(clock, blocks_budget=2, block_size=B, pin_ttl=100)
    insert(store, "a", seq(1, 2 * B), ttl=1e9, pin=True)
    assert not store.can_admit(B * BYTES_PER_TOKEN, "a")  # both blocks pinned: nothing can give way
    clock.advance(100)  # the pin lapses (its own deadline), the blocks may now be evicted
    assert store.can_admit(2 * B * BYTES_PER_TOKEN, "a")


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from([None, 10.0, 60.0, 200.0, 1e9]), st.booleans(), st.booleans()),
    st.tuples(st.just("read"), st.sampled_from([None, 10.0, 60.0, 200.0, 1e9])),
    st.tuples(st.just("unpin"), st.booleans()),
    st.tuples(st.just("wait"), st.sampled_from([1.0, 50.0, 99.0, 100.0, 150.0, 1000.0]))), max_size=14))
def test_a_tenant_s_pin_never_outlives_pin_ttl_seconds_from_its_last_use(steps):
    """The pin rules against a model: a block's TTL is its own (pins aside, a deadline is never shortened); the
    operator's pins and the tenant's are counted apart, and each unpin undoes one of its caller's own; a tenant's
    pins lapse pin_ttl_seconds (100 here) after the last pin or access of the prefix, whatever TTLs were asked;
    only the operator's pins have no deadline."""
    clock = FakeClock()
    store = make_store(clock, blocks_budget=100, block_size=B, pin_ttl=100.0)
    tokens = seq(1, 2 * B)
    deadline, operator, tenant, tenant_until = -math.inf, 0, 0, -math.inf
    for step in steps:
        now, alive = clock(), deadline > clock()
        if not alive:  # the blocks are gone (or will be, before anything matches them), their pins with them
            operator = tenant = 0
        if step[0] == "store":
            _, ttl, pin, privileged = step
            insert(store, "a", tokens, ttl=ttl, pin=pin, privileged=privileged)
            until = math.inf if ttl is None else now + ttl
            deadline = max(deadline, until) if alive else until
            tenant_until = now + 100.0
            if pin and privileged:
                operator += 1
            elif pin:
                tenant += 1
        elif step[0] == "read":
            store.release(lookup(store, "a", tokens, ttl=step[1]))
            if alive:
                deadline = max(deadline, math.inf if step[1] is None else now + step[1])
                tenant_until = now + 100.0
        elif step[0] == "unpin":
            done = store.unpin(scope("a"), tokens, privileged=step[1])
            if alive:
                mine = operator if step[1] else tenant
                assert done == (len(tokens) if mine else 0), "an unpin undid another caller's pin, or none of its own"
                operator, tenant = (operator - bool(done), tenant) if step[1] else (operator, tenant - bool(done))
        else:
            clock.advance(step[1])
        alive = deadline > clock()
        if clock() >= tenant_until:
            tenant = 0
        assert store.peek(scope("a"), tokens, len(tokens)) == (len(tokens) if alive else 0)
        pinned = store.snapshot_stats("a")["pinned_bytes"]
        if clock() >= tenant_until:
            assert all(n.pins == n.operator_pins for n in store.trie.iter_nodes()), "a tenant's pin outlived its use"
        if alive:
            assert pinned == (2 * BLOCK if operator or tenant else 0)
        store.check_integrity()
