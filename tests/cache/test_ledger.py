"""All KV memory under one total: the ledger's reservations and the store's snapshots together."""
from __future__ import annotations

import threading
import time

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.ledger import KINDS, KVLedger
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig
from prefixcache.errors import KVMemoryError, RequestCancelledError
from tests.cache.store_helpers import BYTES_PER_TOKEN, insert, lookup, scope, slicer

B = 4
BLOCK = B * BYTES_PER_TOKEN


def store_with_total(clock, total_blocks: int, budget_blocks: int = 100, wait: float = 0.2) -> KVStore:
    cfg = CacheConfig(max_bytes=budget_blocks * BLOCK, block_size=B, max_kv_bytes_total=total_blocks * BLOCK,
                      kv_wait_seconds=wait, tenant_pin_quota_bytes=budget_blocks * BLOCK)
    return KVStore(cfg, BlockHasher(1), clock)


def seq(tag: int, n: int) -> list[int]:
    return [tag * 100 + i for i in range(n)]


def test_default_total_leaves_room_for_requests_beside_a_full_store():
    assert CacheConfig(max_bytes=4 << 30).kv_total_bytes == 6 << 30
    assert CacheConfig(max_bytes=1000).kv_total_bytes == 1000 + (256 << 20)
    assert CacheConfig(max_bytes=1000, max_kv_bytes_total=1200).kv_total_bytes == 1200


def test_snapshots_are_stored_only_within_the_total_less_what_requests_reserve(clock):
    store = store_with_total(clock, total_blocks=10)
    held = store.ledger.reserve("serial", 6 * BLOCK)
    res = insert(store, "a", seq(1, 40))  # 10 blocks asked, 4 fit beside the reservation
    assert res.stored_tokens == 4 * B and store.bytes + store.ledger.reserved == 10 * BLOCK
    held.release()
    assert insert(store, "b", seq(2, 24)).stored_tokens == 6 * B
    store.check_integrity()


def test_an_insert_beside_a_reservation_evicts_older_snapshots_to_fit(clock):
    store = store_with_total(clock, total_blocks=10)
    insert(store, "a", seq(1, 6 * B))
    clock.advance(1)
    with store.ledger.reserve("serial", 4 * BLOCK):  # the total is full: 6 stored + 4 reserved
        assert insert(store, "b", seq(2, 3 * B)).complete  # a's least recently used blocks give way
        assert store.bytes == 6 * BLOCK and store.evictions["lru"] == 3
    store.check_integrity()


def test_an_insert_from_a_request_s_own_buffer_takes_its_reservation_over(clock):
    """Blocks a request stores from the buffer it reserved (freed right after) take that reservation over block by
    block: the request's own buffer does not squeeze them out, another request's still counts, and the total holds."""
    store = store_with_total(clock, total_blocks=10)
    insert(store, "a", seq(1, 4 * B))
    clock.advance(1)
    other = store.ledger.reserve("private", 2 * BLOCK)
    own = store.ledger.reserve("serial", 4 * BLOCK)  # the total is full: 4 stored + 6 reserved
    tokens = seq(2, 6 * B)
    assert store.insert(scope("b"), tokens, slicer(tokens), own=own).complete  # 2 of a's blocks give way
    assert own.nbytes == 0 and store.ledger.reserved == 2 * BLOCK == store.snapshot_stats("a")["bytes"]
    assert store.bytes + store.ledger.reserved == 10 * BLOCK and store.evictions["lru"] == 2
    own.release()  # nothing left to give back
    assert store.ledger.reserved == 2 * BLOCK
    other.release()
    store.check_integrity()


def test_a_reservation_evicts_unpinned_unread_snapshots_before_it_waits(clock):
    store = store_with_total(clock, total_blocks=10)
    insert(store, "a", seq(1, 16), pin=True)  # 4 pinned blocks
    insert(store, "b", seq(2, 24))  # 6 evictable blocks
    lease = lookup(store, "b", seq(2, 8))  # 2 of them read right now
    with store.ledger.reserve("private", 4 * BLOCK):
        assert store.bytes == 6 * BLOCK and store.evictions["lru"] == 4  # the 4 others gave way
        with pytest.raises(KVMemoryError):  # pinned and read snapshots stay: no room, after a bounded wait
            store.ledger.reserve("serial", BLOCK)
    store.release(lease)
    assert store.ledger.reserved == 0
    store.check_integrity()


def test_a_reservation_frees_expired_snapshots_before_live_ones_less_recently_used(clock):
    store = store_with_total(clock, total_blocks=4)
    insert(store, "a", seq(1, 2 * B), ttl=300)
    clock.advance(1)
    insert(store, "a", seq(2, 2 * B), ttl=5)
    clock.advance(10)  # the second prefix expired; the first is older but live
    with store.ledger.reserve("serial", 2 * BLOCK):
        assert store.evictions["ttl"] == 2 and store.evictions["lru"] == 0
        assert store.peek(scope("a"), seq(1, 2 * B), 2 * B) == 2 * B
    store.check_integrity()


def test_a_reservation_larger_than_the_total_is_refused_at_once(clock):
    store = store_with_total(clock, total_blocks=10, wait=30)
    start = time.monotonic()
    with pytest.raises(KVMemoryError):
        store.ledger.reserve("prewarm", 11 * BLOCK)
    assert time.monotonic() - start < 1


def test_a_reservation_released_twice_gives_its_bytes_back_once(clock):
    store = store_with_total(clock, total_blocks=10)
    first, second = store.ledger.reserve("serial", 2 * BLOCK), store.ledger.reserve("serial", 3 * BLOCK)
    first.release()
    with first:  # leaving the block releases it again: a no-op
        first.release()
    assert store.ledger.held()["serial"] == 3 * BLOCK  # the other reservation's bytes stay reserved
    second.release()
    assert store.ledger.reserved == 0


def test_a_waiting_reservation_gets_the_room_another_gives_back_or_stops_when_cancelled(clock):
    store = store_with_total(clock, total_blocks=10, wait=10)
    first = store.ledger.reserve("serial", 8 * BLOCK)
    threading.Timer(0.2, first.release).start()
    with store.ledger.reserve("serial", 8 * BLOCK):  # waits for it
        assert store.ledger.held()["serial"] == 8 * BLOCK
        cancel = threading.Event()
        threading.Timer(0.1, cancel.set).start()
        with pytest.raises(RequestCancelledError):
            store.ledger.reserve("prewarm", 4 * BLOCK, cancel)
    assert store.ledger.held() == {"stored": 0, "private": 0, "serial": 0, "prewarm": 0}


def test_a_reservation_landing_mid_eviction_never_takes_the_total_over(clock):
    """The store plans an insert's room from what is reserved, then evicts, then adds: a reservation that fits
    while the store evicts (here: from another thread, let in by the store's offload hook between two victims)
    must not let the insert's block take stored + reserved over the total."""
    half = BLOCK // 2
    reserved_meanwhile, done, errors = threading.Event(), threading.Event(), []
    victims: list[str] = []

    def reserve_now() -> None:
        reserved_meanwhile.wait()
        try:
            store.ledger.reserve("serial", 3 * half)  # fits: stored is 3.5 blocks of the 5 now
        except BaseException as exc:  # reported to the test below
            errors.append(exc)
        finally:
            done.set()

    def on_evict(snapshot) -> None:
        victims.append(snapshot.reason)
        if len(victims) == 2:  # between the insert's room check and its new block
            reserved_meanwhile.set()
            assert done.wait(10), "the reservation did not finish"

    cfg = CacheConfig(max_bytes=4 * BLOCK, block_size=B, max_kv_bytes_total=5 * BLOCK,
                      tenant_pin_quota_bytes=4 * BLOCK)
    store = KVStore(cfg, BlockHasher(1), clock, on_evict=on_evict)
    for tag in range(1, 9):  # 8 half blocks: the budget, full
        insert(store, "b", seq(tag, B // 2))
    thread = threading.Thread(target=reserve_now, name="prefixcache-test-reserve")
    thread.start()
    try:
        insert(store, "a", seq(20, B))  # one block: two half blocks make room for it
    finally:
        reserved_meanwhile.set()
        thread.join()
    assert not errors and victims == ["lru", "lru"] and store.ledger.reserved == 3 * half
    assert store.bytes + store.ledger.reserved <= store.ledger.total
    store.check_integrity()


class _FakeStore:
    """``bytes`` of snapshots, of which ``pinned`` can never be reclaimed."""

    def __init__(self, nbytes: int, pinned: int):
        self.bytes, self.pinned = nbytes, pinned

    def reclaim(self, limit: int) -> bool:
        self.bytes = max(min(self.bytes, limit), self.pinned)
        return self.bytes <= limit


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 100), stored=st.integers(0, 60), pinned=st.integers(0, 60),
       ops=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 120), st.booleans()), max_size=12))
@example(total=40, stored=20, pinned=0, ops=[("serial", 40, True)])  # all of the total: every snapshot goes
@example(total=10, stored=20, pinned=20, ops=[("serial", 0, False)])  # over the total already: no growth fits
def test_the_total_holds_after_every_reservation_that_succeeds(total, stored, pinned, ops):
    store = _FakeStore(max(stored, pinned), pinned)
    ledger = KVLedger(total, 0.0)
    ledger.attach(store)
    start_over = store.bytes > total
    for kind, nbytes, grow in ops:
        before = ledger.held()[kind]
        if grow:
            try:
                ledger.reserve(kind, nbytes)
            except KVMemoryError:
                assert ledger.held()[kind] == before
                assert nbytes > total or store.pinned + ledger.reserved + nbytes > total or start_over
                continue
        elif not ledger.try_set(kind, nbytes):
            assert nbytes > before and ledger.held()[kind] == before
            continue
        assert store.bytes + ledger.reserved <= total or (start_over and ledger.reserved == 0)
        assert ledger.reserved == sum(v for k, v in ledger.held().items() if k != "stored")
