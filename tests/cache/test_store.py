"""Memory policy rules, each with a test that fails if the rule breaks."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cache.store_helpers import BYTES_PER_TOKEN, insert, kv_value, lease_values, lookup, make_store, scope
from tests.conftest import FakeClock

B = 4  # block size used here
BLOCK = B * BYTES_PER_TOKEN


def seq(tag: int, n: int) -> list[int]:
    return [tag * 100 + i for i in range(n)]


def cached(store, tenant, tokens, ttl=300.0) -> int:
    lease = lookup(store, tenant, tokens, ttl)
    store.release(lease)
    return lease.cached_tokens


def test_match_returns_the_right_kv_token_granular(clock):
    store = make_store(clock)
    a = seq(1, 10)
    insert(store, "a", a)
    probe = a[:7] + [999, 998]
    lease = lookup(store, "a", probe)
    assert lease.cached_tokens == 7  # inside the second block
    assert lease_values(lease) == [kv_value(a, i) for i in range(7)]
    store.release(lease)
    store.check_integrity()


def test_lru_evicts_least_recently_used_leaf(clock):
    store = make_store(clock, blocks_budget=3)
    for tag in (1, 2, 3):
        insert(store, "a", seq(tag, B))
        clock.advance(1)
    assert cached(store, "a", seq(1, B)) == B  # touch 1: now 2 is the oldest
    clock.advance(1)
    insert(store, "a", seq(4, B))
    assert cached(store, "a", seq(2, B)) == 0
    assert cached(store, "a", seq(1, B)) == B and cached(store, "a", seq(3, B)) == B
    assert store.evictions["lru"] == 1
    store.check_integrity()


def test_shared_parent_outlives_its_children(clock):
    store = make_store(clock, blocks_budget=4)
    system = seq(1, B)
    insert(store, "a", system + seq(2, B))
    clock.advance(1)
    insert(store, "a", system + seq(3, B))
    clock.advance(1)
    insert(store, "a", seq(5, B))  # 4 blocks held: system, two children, this one
    clock.advance(1)
    insert(store, "a", seq(6, B))  # must evict: the oldest *leaf* (child 2), not the older parent
    assert cached(store, "a", system + seq(3, B)) == 2 * B
    assert cached(store, "a", system + seq(2, B)) == B
    store.check_integrity()


def test_in_use_prefix_is_never_freed(clock):
    store = make_store(clock, blocks_budget=2)
    held = seq(1, 2 * B)
    insert(store, "a", held)
    lease = lookup(store, "a", held)
    result = insert(store, "a", seq(2, B))  # no room, nothing evictable: stored uncached
    assert result.stored_tokens == 0 and not result.complete
    assert lease_values(lease) == [kv_value(held, i) for i in range(2 * B)]
    store.release(lease)
    assert insert(store, "a", seq(2, B)).complete  # once released, LRU may take it
    store.check_integrity()


def test_a_lease_released_twice_is_released_once(clock):
    store = make_store(clock)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens)
    first, second = lookup(store, "a", tokens), lookup(store, "a", tokens)
    store.release(first)
    store.release(first)  # e.g. an error path releasing again: a no-op
    assert [n.refcount for n in store.trie.iter_nodes()] == [1, 1]  # the other reader still holds them
    store.check_integrity()
    store.release(second)
    assert store.bytes == 2 * BLOCK
    store.check_integrity()


def test_ttl_is_checked_at_lookup_and_swept(clock):
    store = make_store(clock)
    tokens = seq(1, 3 * B)
    insert(store, "a", tokens, ttl=10)
    clock.advance(9)
    assert cached(store, "a", tokens, ttl=10) == 3 * B  # access refreshes the idle timer
    clock.advance(9.5)
    assert cached(store, "a", tokens, ttl=10) == 3 * B
    clock.advance(10.5)
    assert store.bytes > 0
    assert cached(store, "a", tokens, ttl=10) == 0  # lazily expired before any sweep
    assert store.sweep() == 3 * BLOCK and store.bytes == 0
    assert store.evictions["ttl"] == 3
    store.check_integrity()


def test_a_prefix_that_expired_while_read_is_freed_on_release(clock):
    store = make_store(clock)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens, ttl=5)
    lease = lookup(store, "a", tokens, ttl=5)
    clock.advance(10)
    store.release(lease)  # no sweep needed: the last reader frees it
    assert store.bytes == 0 and store.evictions["ttl"] == 2
    store.check_integrity()


def test_a_block_is_expired_from_its_deadline_on(clock):
    store = make_store(clock)
    insert(store, "a", seq(1, B), ttl=10)
    clock.advance(10)  # exactly the deadline: no longer matched, and swept
    assert store.peek(scope("a"), seq(1, B), B) == 0
    assert store.sweep() == BLOCK and store.bytes == 0


def test_expired_blocks_make_room_before_live_ones_less_recently_used(clock):
    store = make_store(clock, blocks_budget=2)
    insert(store, "a", seq(1, B), ttl=300)
    clock.advance(1)
    insert(store, "a", seq(2, B), ttl=5)
    clock.advance(10)  # the second expired; the first is older but live
    assert insert(store, "a", seq(3, B)).complete
    assert cached(store, "a", seq(1, B)) == B
    assert store.evictions["ttl"] == 1 and store.evictions["lru"] == 0
    store.check_integrity()


def test_per_request_ttl_override_never_shortens_a_longer_one(clock):
    store = make_store(clock)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens, ttl=100)
    insert(store, "a", tokens, ttl=5)
    clock.advance(50)
    assert cached(store, "a", tokens) == 2 * B


def test_pinned_prefix_survives_pressure_until_unpinned(clock):
    store = make_store(clock, blocks_budget=3)
    pinned = seq(1, 2 * B)
    insert(store, "a", pinned, ttl=None, pin=True)
    for tag in range(2, 6):
        clock.advance(1)
        insert(store, "a", seq(tag, B))
    assert cached(store, "a", pinned) == 2 * B
    assert store.snapshot_stats()["pinned_bytes"] == 2 * BLOCK
    assert store.unpin(scope("a"), pinned)
    for tag in range(6, 9):
        clock.advance(1)
        insert(store, "a", seq(tag, B))
    assert cached(store, "a", pinned) == 0
    store.check_integrity()


def test_pin_with_ttl_expires(clock):
    store = make_store(clock)
    pinned = seq(1, B)
    insert(store, "a", pinned, ttl=60, pin=True)
    clock.advance(61)
    assert cached(store, "a", pinned, ttl=60) == 0
    store.sweep()
    assert store.bytes == 0


def test_quota_isolation(clock):
    store = make_store(clock, blocks_budget=10, quota_blocks=3)
    for tag in (1, 2, 3):
        insert(store, "b", seq(tag, B))
    for tag in range(10, 20):  # tenant a churns far past its quota
        clock.advance(1)
        insert(store, "a", seq(tag, B))
    assert store.tenant_bytes["a"] <= 3 * BLOCK
    assert all(cached(store, "b", seq(tag, B)) == B for tag in (1, 2, 3))  # b untouched
    assert store.evictions["quota"] == 7 and store.evictions["lru"] == 0
    store.check_integrity()


def test_global_budget_may_evict_other_tenants_only_when_forced(clock):
    store = make_store(clock, blocks_budget=4, quota_blocks=3)
    for tag in (1, 2, 3):
        insert(store, "b", seq(tag, B))
        clock.advance(1)
    insert(store, "a", seq(10, B))
    clock.advance(1)
    insert(store, "a", seq(11, B))  # within a's quota, budget full: global LRU takes b's oldest
    assert cached(store, "b", seq(1, B)) == 0 and store.evictions["lru"] == 1


def test_per_tenant_figures_count_that_tenant_only(clock):
    store = make_store(clock, blocks_budget=3)
    insert(store, "a", seq(1, 2 * B))
    clock.advance(1)
    insert(store, "b", seq(2, B + 1))  # its second block (one token) evicts a's leaf
    store.flush("b")
    a, b, both = store.snapshot_stats("a"), store.snapshot_stats("b"), store.snapshot_stats()
    assert (a["entries"], a["cached_tokens_held"], b["entries"], b["cached_tokens_held"]) == (1, B, 0, 0)
    assert a["evictions"] == {"lru": 1, "ttl": 0, "quota": 0, "flush": 0}
    assert b["evictions"] == {"lru": 0, "ttl": 0, "quota": 0, "flush": 2}
    assert a["reclaimed_bytes"] == {"lru": BLOCK, "ttl": 0, "quota": 0, "flush": 0}
    assert b["reclaimed_bytes"] == {"lru": 0, "ttl": 0, "quota": 0, "flush": BLOCK + BYTES_PER_TOKEN}
    assert both["reclaimed_bytes"] == {"lru": BLOCK, "ttl": 0, "quota": 0, "flush": BLOCK + BYTES_PER_TOKEN}
    assert (both["entries"], both["cached_tokens_held"]) == (1, B)


def test_a_block_that_fills_the_budget_exactly_is_stored(clock):
    store = make_store(clock, blocks_budget=1)
    assert insert(store, "a", seq(1, B)).complete and store.bytes == BLOCK


def test_budget_smaller_than_one_snapshot(clock):
    store = make_store(clock, blocks_budget=0)
    result = insert(store, "a", seq(1, 3 * B))
    assert result.stored_tokens == 0 and store.bytes == 0
    assert cached(store, "a", seq(1, 3 * B)) == 0
    store.check_integrity()


def test_flush_frees_everything_and_in_use_on_release(clock):
    store = make_store(clock)
    insert(store, "a", seq(1, 3 * B))
    insert(store, "b", seq(2, 2 * B))
    lease = lookup(store, "a", seq(1, 3 * B))
    freed = store.flush("a")
    assert freed == 0 and store.tenant_bytes["b"] == 2 * BLOCK  # a's blocks are in use
    assert cached(store, "a", seq(1, 3 * B)) == 0  # but never matched again
    store.release(lease)
    assert store.tenant_bytes["a"] == 0 and store.evictions["flush"] == 3
    store.flush()
    assert store.bytes == 0
    store.check_integrity()


def test_a_prefix_stored_again_while_its_flushed_copy_is_read_is_served(clock):
    store = make_store(clock)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens)
    lease = lookup(store, "a", tokens)  # a reader holds the blocks across the flush
    store.flush("a")
    longer = tokens + seq(2, B)
    assert insert(store, "a", longer).complete  # stored beside the flushed copy, never below it
    assert cached(store, "a", longer) == len(longer)
    store.release(lease)
    assert store.evictions["flush"] == 2 and not any(n.doomed for n in store.trie.iter_nodes())
    assert store.bytes == 3 * BLOCK
    store.check_integrity()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=7), min_size=1, max_size=6))
def test_no_unread_partial_block_is_kept_beside_a_longer_copy_of_itself(seqs):
    """Copy-on-write replaces a shorter partial sibling nobody reads, however short the extension."""
    store = make_store(FakeClock(), block_size=3)
    for tokens in seqs:
        insert(store, "a", tokens)
    for parent in [*store.trie.roots(), *store.trie.iter_nodes()]:
        kids = [c.tokens for c in parent.children()]
        assert not any(len(a) < len(b) and b[: len(a)] == a for a in kids for b in kids), kids
    store.check_integrity()


def test_a_flush_drops_the_pins_of_blocks_still_read(clock):
    store = make_store(clock)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens, pin=True)
    lease = lookup(store, "a", tokens)
    store.flush("a")
    assert store.snapshot_stats("a")["pinned_bytes"] == 0  # flushed: they count against no pin quota
    store.release(lease)
    assert store.bytes == 0
    store.check_integrity()


def test_a_partial_block_replaced_by_its_longer_copy_is_no_eviction(clock):
    seen = []
    store = make_store(clock)
    store._on_evict = seen.append
    insert(store, "a", seq(1, B + 1))
    insert(store, "a", seq(1, B + 2))  # the one-token block is superseded, its tokens live on
    assert seen == [] and sum(store.evictions.values()) == 0
    assert [len(n.tokens) for n in store.trie.iter_nodes()] == [B, 2]
    store.check_integrity()


def test_every_trie_read_and_write_happens_under_the_store_s_lock(clock, monkeypatch):
    """The trie is not thread-safe: each store operation reaches it only while holding the store's lock."""
    store = make_store(clock)
    calls: list[tuple[str, bool]] = []
    for name in ("root", "match", "covering", "add_child", "remove_leaf", "drop_root_if_empty"):
        def guarded(*args, _real=getattr(store.trie, name), _name=name, **kwargs):
            calls.append((_name, store._lock._is_owned()))
            return _real(*args, **kwargs)
        monkeypatch.setattr(store.trie, name, guarded)
    tokens = seq(1, 2 * B)
    insert(store, "a", tokens, pin=True)
    store.release(lookup(store, "a", tokens))
    store.peek(scope("a"), tokens, len(tokens))
    store.retain(scope("a"), tokens)
    store.unpin(scope("a"), tokens)
    insert(store, "a", seq(2, B + 1))
    store.flush()
    assert {name for name, _ in calls} >= {"root", "match", "covering", "add_child", "remove_leaf"}
    assert [name for name, owned in calls if not owned] == []


def test_copy_on_write_extension_of_a_partial_block(clock):
    store = make_store(clock)
    short = seq(1, B + 2)  # one full block + a partial one
    insert(store, "a", short)
    partial = [n for n in store.trie.iter_nodes() if len(n.tokens) == 2][0]
    snapshot = partial.kv.clone()
    lease = lookup(store, "a", short)  # a reader holds the partial block
    longer = short + [7, 7, 7, 7]
    insert(store, "a", longer)
    assert partial.alive and (partial.kv == snapshot).all()  # never written, kept for its reader
    store.release(lease)
    assert cached(store, "a", longer) == len(longer)
    insert(store, "a", longer + [8])
    assert not partial.alive or partial.refcount == 0
    store.check_integrity()


def test_can_admit(clock):
    store = make_store(clock, blocks_budget=2)
    assert store.can_admit(2 * BLOCK, "a") and not store.can_admit(3 * BLOCK, "a")
    insert(store, "a", seq(1, 2 * B), ttl=None, pin=True)
    assert not store.can_admit(BLOCK, "a")


@pytest.mark.parametrize("hash_fn", [None, lambda data, seed: 0])
def test_collisions_never_return_wrong_kv(clock, hash_fn):
    store = make_store(clock, hash_fn=hash_fn)
    seqs = [seq(t, 3 * B) for t in range(1, 6)] + [seq(1, B) + seq(9, 2 * B)]
    for s in seqs:
        insert(store, "a", s)
    for s in seqs:
        lease = lookup(store, "a", s)
        assert lease.cached_tokens == len(s)
        assert lease_values(lease) == [kv_value(s, i) for i in range(len(s))]
        store.release(lease)


def test_offload_hook_sees_every_dropped_snapshot(clock):
    seen = []
    store = make_store(clock, blocks_budget=2)
    store._on_evict = seen.append
    first = seq(1, 2 * B)
    insert(store, "a", first)
    clock.advance(1)
    insert(store, "a", seq(2, B))  # evicts first's leaf block
    assert [(e.reason, e.start, e.tokens) for e in seen] == [("lru", B, tuple(first))]
    assert seen[0].kv[0, 0, 0, :, 0].tolist() == [kv_value(first, i) for i in range(B, 2 * B)]
    assert seen[0].namespace[0] == "a"
    store._on_evict = lambda snap: 1 / 0  # a broken tier never breaks eviction
    clock.advance(1)
    insert(store, "a", seq(3, 2 * B))
    store.check_integrity()


def storage_bytes(store) -> int:
    """Bytes of the distinct tensors the store's snapshots live in (what it really holds)."""
    held = {n.kv.untyped_storage().data_ptr(): n.kv.untyped_storage().nbytes() for n in store.trie.iter_nodes()}
    return sum(held.values())


def test_blocks_of_one_insert_share_one_run_and_read_as_one_view(clock):
    from prefixcache.cache.runs import coalesce

    store = make_store(clock)
    tokens = seq(1, 3 * B + 2)
    insert(store, "a", tokens)
    lease = lookup(store, "a", tokens)
    assert len(lease.steps) == 4 and len({s.node.kv.untyped_storage().data_ptr() for s in lease.steps}) == 1
    merged = coalesce([(s.node.kv, s.used) for s in lease.steps])
    assert len(merged) == 1 and merged[0][1] == len(tokens)
    assert merged[0][0][0, 0, 0, :, 0].tolist() == [kv_value(tokens, i) for i in range(len(tokens))]
    store.release(lease)
    # A second insert extends the path with its own run: two views, in order, values intact.
    longer = tokens[: 3 * B] + seq(2, 2 * B)
    insert(store, "a", longer)
    lease = lookup(store, "a", longer)
    merged = coalesce([(s.node.kv, s.used) for s in lease.steps])
    assert [used for _, used in merged] == [3 * B, 2 * B]
    assert [v for kv, used in merged for v in kv[0, 0, 0, :used, 0].tolist()] == \
        [kv_value(longer, i) for i in range(len(longer))]
    store.release(lease)
    assert storage_bytes(store) == store.bytes
    store.check_integrity()


def test_partly_evicted_run_is_compacted_to_exact_bytes(clock):
    store = make_store(clock, blocks_budget=4)
    system, tail = seq(1, 2 * B), seq(2, 2 * B)
    insert(store, "a", system + tail)  # one run of 4 blocks
    lease = lookup(store, "a", system)  # a reader holding the first two blocks
    before = lease_values(lease)
    old_view = lease.steps[0].node.kv
    clock.advance(1)
    insert(store, "a", seq(3, 2 * B))  # evicts the run's two tail blocks, not the leased ones
    assert store.evictions["lru"] == 2
    assert storage_bytes(store) == store.bytes == 4 * BLOCK  # the run's freed half is really gone
    assert lease_values(lease) == before  # repointed to a copy with the same values
    assert old_view[0, 0, 0, :, 0].tolist() == before[:B]  # and the reader's old view still reads right
    store.release(lease)
    assert cached(store, "a", system + tail) == 2 * B
    store.check_integrity()


def test_insert_cut_short_by_the_budget_keeps_only_the_stored_bytes(clock):
    store = make_store(clock, blocks_budget=2)
    tokens = seq(1, 4 * B)
    res = insert(store, "a", tokens)
    assert not res.complete and res.stored_tokens == 2 * B
    assert storage_bytes(store) == store.bytes == 2 * BLOCK
    assert lease_values(lookup(store, "a", tokens)) == [kv_value(tokens, i) for i in range(2 * B)]
    store.check_integrity()


def test_offload_hook_gets_a_snapshot_of_its_own_size(clock):
    seen = []
    store = make_store(clock, blocks_budget=3)
    store._on_evict = seen.append
    insert(store, "a", seq(1, 3 * B))
    clock.advance(1)
    insert(store, "a", seq(2, B))
    assert len(seen) == 1 and seen[0].kv.untyped_storage().nbytes() == BLOCK
    store.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.booleans()), min_size=1, max_size=12))
def test_coalesce_reads_the_same_tokens_with_one_view_per_adjacent_run(pieces):
    """Segments: views of three runs, taken in order within a run unless ``jump``, some used in part."""
    import torch

    from prefixcache.cache.runs import coalesce

    runs = [torch.arange(r * 1000, r * 1000 + 2 * 3 * 64 * 2, dtype=torch.float32).view(1, 2, 3, 64, 2)
            for r in range(3)]
    at, segments = [0, 0, 0], []
    for run, size, jump in pieces:
        at[run] += 2 if jump else 0
        if at[run] + size > 64:
            continue
        used = size - 1 if size > 1 and jump else size
        segments.append((runs[run][:, :, :, at[run] : at[run] + size], used))
        at[run] += size
    if not segments:
        return
    merged = coalesce(segments)
    flat = [kv[:, :, :, :used] for kv, used in segments]
    assert torch.equal(torch.cat([kv[:, :, :, :used] for kv, used in merged], dim=3), torch.cat(flat, dim=3))
    # Adjacent whole segments of one run join; anything else starts a new view.
    joins = sum(1 for (a, ua), (b, _) in zip(segments, segments[1:]) if ua == a.shape[3] and
                a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and
                b.storage_offset() == a.storage_offset() + a.shape[3] * a.stride(3))
    assert len(merged) == len(segments) - joins
