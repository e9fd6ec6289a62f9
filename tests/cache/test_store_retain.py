"""``retain`` keeps a stored path for a TTL (never shortening it); ``peek`` looks without touching."""
from __future__ import annotations

from tests.cache.store_helpers import insert, make_store, scope


def test_retain_keeps_the_path_for_its_ttl_and_never_shortens_one(clock):
    store = make_store(clock)
    tokens = list(range(100, 112))  # three blocks of 4
    insert(store, "a", tokens, ttl=60.0)
    assert store.retain(scope("a", 3600.0), tokens[:6]) == 6  # two blocks, the second used in part
    assert store.retain(scope("a", 300.0), tokens[:10]) == 10  # a shorter TTL leaves the first two at 1h
    assert store.retain(scope("b", 3600.0), tokens[:6]) == 0  # another tenant's namespace holds nothing
    store.check_integrity()  # a parent never expires before its child
    clock.advance(400)  # past 5 minutes: the third block (5m) is gone, the first two (1h) are not
    assert store.sweep() > 0
    assert store.peek(scope("a"), tokens, len(tokens)) == 8
    clock.advance(3600)
    store.sweep()
    assert store.peek(scope("a"), tokens, len(tokens)) == 0
    assert store.retain(scope("a", 3600.0), tokens) == 0  # nothing left to keep
    store.check_integrity()


def test_peek_pins_and_touches_nothing(clock):
    store = make_store(clock)
    tokens = list(range(200, 208))
    insert(store, "a", tokens, ttl=60.0)
    clock.advance(30)
    assert store.peek(scope("a"), tokens + [1, 2], 20) == 8
    assert store.peek(scope("a"), tokens, 5) == 5 and store.peek(scope("a"), tokens, 0) == 0
    with store._lock:
        nodes = list(store.trie.iter_nodes())
    assert all(n.refcount == 0 and n.last_access == 1000.0 for n in nodes)  # still the insert's time
    clock.advance(31)  # expired: a peek did not refresh it
    assert store.peek(scope("a"), tokens, 8) == 0
    store.check_integrity()
