"""What an insert costs and protects: blocks walked past cost no index update, and while it evicts
to make room, neither the path it walked nor the blocks it is adding can be chosen."""
from __future__ import annotations

import pytest

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.trie import PrefixTrie
from tests.cache.store_helpers import insert, make_store, scope

B = 4


def path(first: int, blocks: int) -> list[int]:
    return [first] + [7] * (blocks * B - 1)


@pytest.mark.parametrize("walked", [5, 40])
def test_blocks_walked_past_cost_no_index_update(clock, monkeypatch, walked):
    store = make_store(clock, block_size=B)
    insert(store, "a", path(1, walked))
    calls = []
    sync = store.index.sync
    monkeypatch.setattr(store.index, "sync", lambda node: (calls.append(node), sync(node)))
    clock.advance(1)
    assert insert(store, "a", path(1, walked)).complete  # all walked, nothing new
    assert len(calls) <= 2
    calls.clear()
    result = insert(store, "a", path(1, walked) + [9] * B)  # walked, then one new block
    assert result.complete and result.new_bytes > 0
    assert len(calls) <= 4, f"{len(calls)} index updates for one new block after {walked} walked"
    monkeypatch.undo()
    store.check_integrity()


def test_eviction_for_an_insert_spares_the_path_it_walked_even_if_least_recently_used(clock):
    store = make_store(clock, blocks_budget=10, block_size=B)
    old = path(1, 6)
    insert(store, "a", old)  # the least recently used path
    clock.advance(1)
    insert(store, "a", path(2, 4))  # the budget is full
    clock.advance(1)
    result = insert(store, "a", old + [9] * (3 * B))  # walks `old`, then evicts for 3 new blocks
    assert result.complete and result.stored_tokens == 9 * B
    assert store.snapshot_stats()["evictions"]["lru"] == 3  # from the other path, deepest first
    store.check_integrity()


def test_blocks_being_added_are_never_evicted_for_the_next_one(clock):
    store = make_store(clock, blocks_budget=6, block_size=B)
    insert(store, "a", path(1, 6))  # full
    clock.advance(1)
    result = insert(store, "a", path(2, 6))  # each new block evicts one of the old path
    assert result.complete and store.snapshot_stats()["evictions"]["lru"] == 6
    assert store.peek(scope("a"), path(2, 6), 6 * B) == 6 * B
    store.check_integrity()


@pytest.mark.parametrize("hash_fn", [None, lambda data, seed: 3], ids=["xxh3", "constant"])
def test_a_lone_child_is_held_directly_and_the_indexes_come_with_a_second(hash_fn):
    trie = PrefixTrie(2, BlockHasher(0) if hash_fn is None else BlockHasher(0, hash_fn))
    root = trie.root(("ns",), "t", create=True)
    a = trie.add_child(root, (1, 2))
    chain = trie.add_child(a, (3, 4))
    assert a.only is chain and a.by_key is None and a.by_first is None
    b = trie.add_child(a, (3, 5))
    c = trie.add_child(a, (6, 5))
    assert a.only is None and a.num_children == 3 and set(a.children()) == {chain, b, c}
    assert list(a.keyed(b.key)).count(b) == 1 and set(a.starting(3)) == {chain, b}
    trie.remove_leaf(chain)
    trie.remove_leaf(c)
    assert a.only is b and a.by_key is None and a.by_first is None and list(a.children()) == [b]
    assert list(a.keyed(b.key)) == [b] and list(a.starting(3)) == [b] and list(a.starting(6)) == []
    steps = trie.match(root, [1, 2, 3, 5], 4, lambda n: True)
    assert [s.node for s in steps] == [a, b]
    trie.remove_leaf(b)
    assert a.only is None and a.num_children == 0 and list(a.children()) == []
