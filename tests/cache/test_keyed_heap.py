"""KeyedHeap against a plain dict: the smallest key (ties: first set) after any sequence of operations."""
from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixcache.cache.keyed_heap import KeyedHeap

OPS = st.lists(st.tuples(st.sampled_from(["set", "discard", "pop"]), st.integers(0, 6), st.integers(0, 4)),
               max_size=300)


@settings(max_examples=300, deadline=None)
@given(OPS)
@example([("set", 0, 1), ("set", 1, 1), ("set", 0, 1), ("pop", 0, 0)])  # an unchanged key keeps its place
@example([("set", 0, 1), ("set", 0, 2), ("set", 0, 1), ("set", 1, 1), ("pop", 0, 0), ("set", 0, 1), ("pop", 0, 0)])
def test_matches_a_dict_model(ops):
    heap: KeyedHeap[int] = KeyedHeap()
    model: dict[int, tuple[float, int]] = {}  # item -> (key, when it got that key)
    for t, (op, item, key) in enumerate(ops):
        if op == "set":
            heap.set(item, key)
            if model.get(item, (None,))[0] != key:
                model[item] = (key, t)
        elif op == "discard":
            heap.discard(item)
            model.pop(item, None)
        else:
            want = min(model.items(), key=lambda kv: kv[1]) if model else None
            got = heap.pop()
            assert got == (None if want is None else (want[0], want[1][0]))
            if want is not None:
                del model[want[0]]
        assert len(heap) == len(model)
        assert dict(heap.items()) == {i: k for i, (k, _) in model.items()}
        # Stale entries never make the heap much larger than what it holds.
        assert len(heap._heap) <= 2 * len(model) + 33


def test_rekeying_many_times_keeps_the_heap_small():
    heap: KeyedHeap[str] = KeyedHeap()
    for i in range(10_000):
        heap.set("a", float(i))
    assert len(heap._heap) <= 35 and heap.peek() == ("a", 9999.0)


def test_after_a_rebuild_the_smallest_key_still_comes_first():
    heap: KeyedHeap[int] = KeyedHeap()
    for item in range(10):
        heap.set(item, 100.0 - item)  # the live items, largest key first
    for rekey in range(43):  # stale entries of item 0 pile up until the heap is rebuilt from the live items
        heap.set(0, 101.0 + rekey)
    assert len(heap._heap) == 10  # just rebuilt
    assert [heap.pop()[0] for _ in range(10)] == [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert heap.pop() is None
