"""The tier chain under the store: write-back, write-through, restore, corruption, budgets, restarts.

Model-free: the harness's fake KV encodes the token prefix it belongs to, so a block
restored under the wrong prefix shows up as wrong values.
"""
from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.cache.scope import Scope
from prefixcache.cache.tiers import TierChain
from prefixcache.cache.tiers.codec import BlockKeys, BlockMeta
from prefixcache.cache.tiers.disk import _Entry as disk_entry
from prefixcache.cache.tiers.host import HostTier
from tests.cache.store_helpers import NS, insert, kv_value, lease_values, make_store, scope
from tests.cache.tier_helpers import OTHER_SECRET, SECRET, block_files, disk_chain, prefix_files, shape

SEQ = list(range(10, 34))  # 24 tokens: 6 blocks of 4


def restore(store, tenant, tokens):
    return store.acquire(scope(tenant), tokens, len(tokens), restore=True)


def evict_all(store):
    """Fill the store with other prefixes until nothing of ``SEQ`` is left on the device."""
    for i in range(3):
        filler = [200 + i] * 4 * 8
        store.release(store.acquire(scope("c"), filler, 0))
        insert(store, "c", filler)


@pytest.fixture
def tiered(tmp_path, clock):
    store = make_store(clock, blocks_budget=8)
    chain = disk_chain(tmp_path)
    store.attach(chain)
    yield store, chain
    chain.close()


def test_write_back_on_eviction_then_restore_gives_the_same_kv(tiered, tmp_path):
    store, chain = tiered
    insert(store, "a", SEQ)
    assert chain.flush_writes(5) and block_files(tmp_path) == []  # nothing written while on the device
    evict_all(store)
    assert chain.flush_writes(5)
    assert store.acquire(scope("a"), SEQ, len(SEQ)).cached_tokens == 0  # gone from the device
    lease = restore(store, "a", SEQ)
    assert lease.cached_tokens == 24
    assert lease_values(lease) == [kv_value(SEQ, i) for i in range(24)]
    stats = chain.stats()["disk"]
    assert stats["hits"] == 1 and stats["restores"] == 1 and stats["restored_bytes"] == 24 * 8
    assert stats["write_backs"] >= 6
    store.release(lease)
    store.check_integrity()


def test_a_restore_continues_after_the_device_match(tiered):
    store, chain = tiered
    insert(store, "a", SEQ)
    evict_all(store)
    chain.flush_writes(5)
    insert(store, "a", SEQ[:8])  # two blocks back on the device, the rest only on disk
    lease = restore(store, "a", SEQ + [99])
    assert lease.cached_tokens == 24 and lease_values(lease) == [kv_value(SEQ, i) for i in range(24)]
    store.release(lease)
    store.check_integrity()


class FlushDuringRead:
    """The chain, with a flush of the store landing while a restore reads the tiers (between read and insert)."""

    def __init__(self, store, chain, tenant):
        self.store, self.chain, self.tenant = store, chain, tenant
        self.write_through = chain.write_through

    def __getattr__(self, name):
        return getattr(self.chain, name)

    def restore(self, *args):
        found = self.chain.restore(*args)
        self.store.flush(self.tenant)
        return found


@pytest.mark.parametrize("tenant", ["a", None])
def test_a_flush_during_a_restore_keeps_the_restored_blocks_out(tiered, tenant):
    store, chain = tiered
    insert(store, "a", SEQ)
    evict_all(store)
    chain.flush_writes(5)
    store.attach(FlushDuringRead(store, chain, tenant))
    lease = restore(store, "a", SEQ)
    assert lease.cached_tokens == 0  # what was read before the flush is not stored after it
    store.release(lease)
    again = store.acquire(scope("a"), SEQ, len(SEQ))
    assert again.cached_tokens == 0
    store.release(again)
    store.attach(chain)  # no flush this time: the same blocks restore
    lease = restore(store, "a", SEQ)
    assert lease.cached_tokens == 24 and lease_values(lease) == [kv_value(SEQ, i) for i in range(24)]
    store.release(lease)
    store.check_integrity()


def test_other_tenant_and_other_secret_never_hit(tiered, tmp_path, clock):
    store, chain = tiered
    insert(store, "a", SEQ)
    evict_all(store)
    chain.flush_writes(5)
    assert restore(store, "b", SEQ).cached_tokens == 0
    chain.close()  # one process per directory
    other = make_store(clock, blocks_budget=8)
    other_chain = disk_chain(tmp_path, secret=OTHER_SECRET)
    other.attach(other_chain)
    assert restore(other, "a", SEQ).cached_tokens == 0
    other_chain.close()


def test_write_through_writes_at_once_and_expired_blocks_are_not_written(tmp_path, clock):
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path, policy="write-through")
    store.attach(chain)
    insert(store, "a", SEQ)
    chain.flush_writes(5)
    assert len(block_files(tmp_path)) == 6
    clock.advance(301)
    store.sweep()  # an expired block is gone for good: nothing more is written
    chain.flush_writes(5)
    assert chain.stats()["disk"]["write_backs"] == 6
    chain.close()


def test_write_back_takes_blocks_evicted_for_a_quota_never_expired_ones(tmp_path, clock):
    store = make_store(clock, blocks_budget=100, quota_blocks=1)
    chain = disk_chain(tmp_path)  # write-back: only what is evicted goes down
    store.attach(chain)
    insert(store, "a", SEQ[:4], ttl=5)
    clock.advance(10)
    store.sweep()  # expired: gone for good
    insert(store, "a", SEQ[4:8])
    clock.advance(1)
    insert(store, "a", SEQ[8:12])  # over a's quota: SEQ[4:8] is evicted, and kept below
    chain.flush_writes(5)
    assert store.evictions["ttl"] == 1 and store.evictions["quota"] == 1
    assert block_files(tmp_path) == prefix_files(tmp_path, NS["a"], SEQ[4:8])
    chain.close()


def test_the_writer_thread_calls_idle_each_time_before_it_waits(tmp_path, clock):
    """(The cache passes ``WorkerThreads.release``: the writer's CPU workers go back while it waits.)"""
    calls: list[str] = []
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path, policy="write-through", idle=lambda: calls.append(threading.current_thread().name))
    store.attach(chain)

    def idled(times: int) -> bool:
        deadline = time.monotonic() + 10
        while len(calls) < times and time.monotonic() < deadline:
            time.sleep(0.01)
        return len(calls) >= times

    assert idled(1)  # started with nothing to write
    insert(store, "a", SEQ)
    assert chain.flush_writes(5) and idled(2)  # written, then idle again
    assert set(calls) == {"prefixcache-tier-writer"}
    chain.close()


def test_pins_are_written_through_under_write_back(tmp_path, clock):
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path)
    store.attach(chain)
    insert(store, "a", SEQ[:8])
    insert(store, "a", SEQ, pin=True)
    chain.flush_writes(5)
    assert len(block_files(tmp_path)) == 6  # the whole pinned path, stored earlier or not
    chain.close()


def written_through(tmp_path, clock, ttl: float):
    """SEQ stored with ``ttl`` and written through to a disk tier on a wall clock the test moves: (wall, store,
    chain); ``wall[0] += s`` moves it."""
    wall = [1_000_000.0]
    store = make_store(clock, blocks_budget=8)
    chain = disk_chain(tmp_path, policy="write-through", clock=lambda: wall[0])
    store.attach(chain)
    insert(store, "a", SEQ, ttl=ttl)
    chain.flush_writes(5)
    return wall, store, chain


def test_tier_ttl_is_checked_at_read_and_swept(tmp_path, clock):
    wall, store, chain = written_through(tmp_path, clock, 50.0)
    evict_all(store)
    chain.flush_writes(5)
    wall[0] += 51  # the blocks' TTL travelled with them: expired on disk too
    assert restore(store, "a", SEQ).cached_tokens == 0
    files = prefix_files(tmp_path, NS["a"], SEQ)
    assert all(f.exists() for f in files)  # expired, but not swept yet
    chain.sweep()
    assert not any(f.exists() for f in files)
    chain.flush_writes(5)
    assert chain.stats()["disk"]["entries"] == len(block_files(tmp_path)) > 0  # the fillers' blocks live on
    chain.close()


def test_a_block_written_again_after_its_copy_expired_keeps_its_new_file(tmp_path, clock):
    """The expired copy's file is the new copy's name: dropping the old entry must not take the new file."""
    wall, store, chain = written_through(tmp_path, clock, 5.0)
    wall[0] += 10  # expired on disk, not swept
    store.flush()
    insert(store, "a", SEQ, ttl=300.0)  # written through again, to the same names
    chain.flush_writes(5)
    files = prefix_files(tmp_path, NS["a"], SEQ)
    assert all(f.exists() for f in files)
    assert chain.stats()["disk"]["entries"] == len(block_files(tmp_path)) == len(files)
    store.flush()
    lease = restore(store, "a", SEQ)
    assert lease.cached_tokens == 24 and lease_values(lease) == [kv_value(SEQ, i) for i in range(24)]
    store.release(lease)
    chain.close()


def test_a_later_expiry_writes_the_block_again(tmp_path, clock):
    """A copy below that would expire sooner than the block now does is replaced (eviction, pins, persist)."""
    wall, store, chain = written_through(tmp_path, clock, 10.0)
    store.flush()
    insert(store, "a", SEQ, ttl=3600.0)  # the device keeps it for an hour now: the disk copy follows
    chain.flush_writes(5)
    wall[0] += 60  # past the first copy's expiry
    fresh = make_store(clock, blocks_budget=8)
    fresh.attach(chain)
    assert restore(fresh, "a", SEQ).cached_tokens == 24
    chain.close()


def test_the_disk_index_is_rebuilt_at_start_up_in_lru_order(tmp_path, clock):
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path, policy="write-through")
    store.attach(chain)
    insert(store, "a", SEQ)
    chain.flush_writes(5)
    chain.close()
    again = disk_chain(tmp_path)
    assert again.tiers[0].rebuilt_entries == 6 and again.stats()["disk"]["entries"] == 6
    fresh = make_store(clock, blocks_budget=100)
    fresh.attach(again)
    lease = restore(fresh, "a", SEQ)
    assert lease.cached_tokens == 24 and lease_values(lease) == [kv_value(SEQ, i) for i in range(24)]
    fresh.release(lease)
    again.close()
    files = block_files(tmp_path)
    size = files[0].stat().st_size
    for i, path in enumerate(files):  # the oldest modification time goes first
        os.utime(path, (1000 + i, 1000 + i))
    third = disk_chain(tmp_path, budget=size * 6)
    tier = third.tiers[0]
    # Over budget by one block: the least recently modified file goes.
    tier._set(b"\x00" * 16, disk_entry(tmp_path / "x.kv", size, None))
    assert not files[0].exists() and all(f.exists() for f in files[1:])
    third.close()


def corrupt(files, how: str, other_dir=None):
    path = files[2]
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":
        data[len(data) - 40] ^= 0x01
        path.write_bytes(data)
    elif how == "swap":  # two blocks' payloads exchanged (same sizes, headers kept)
        other = bytearray(files[3].read_bytes())
        cut = len(data) - 32 - 32  # the MAC, then the 32 bytes of KV before it
        path.write_bytes(data[:cut] + other[cut:-32] + data[-32:])
    elif how == "other-model":  # a block of another model's namespace placed under this key
        os.replace(other_dir, path)


@pytest.mark.parametrize("how", ["truncate", "flip", "swap", "other-model"])
def test_a_corrupt_block_is_a_counted_deleted_miss(tmp_path, clock, how):
    store = make_store(clock, blocks_budget=8)
    chain = disk_chain(tmp_path / "t", policy="write-through")
    store.attach(chain)
    insert(store, "a", SEQ)
    chain.flush_writes(5)
    files = prefix_files(tmp_path / "t", NS["a"], SEQ)
    foreign = None
    if how == "other-model":  # the same tokens under another model's namespace, written by a real chain
        foreign_store = make_store(clock, blocks_budget=100)
        foreign_chain = disk_chain(tmp_path / "f", policy="write-through")
        foreign_store.attach(foreign_chain)
        ns = ("a", "other-model", "rev", "float32", "tpl")
        foreign_store.insert(Scope(ns, "a", 300.0), SEQ, lambda s, e: torch.zeros(1, 2, 1, e - s, 1))
        foreign_chain.flush_writes(5)
        foreign = prefix_files(tmp_path / "f", ns, SEQ)[2]
        foreign_chain.close()
    evict_all(store)
    chain.flush_writes(5)
    corrupt(files, how, foreign)
    lease = restore(store, "a", SEQ)
    assert lease.cached_tokens == 8  # the two blocks before the bad one, never the bad one
    assert lease_values(lease) == [kv_value(SEQ, i) for i in range(8)]
    store.release(lease)
    assert chain.stats()["disk"]["corrupt_entries"] == 1 and not files[2].exists()
    chain.close()


def test_a_full_queue_drops_and_counts_without_blocking(tmp_path, clock):
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path, policy="write-through", queue_bytes=4 * 8)  # room for one block at a time
    store.attach(chain)
    with chain._cv:  # hold the writer: everything after the first block finds the queue full
        insert(store, "a", SEQ)
    chain.flush_writes(5)
    stats = chain.stats()["disk"]
    assert stats["write_backs"] + stats["failed_writes"] == 6 and stats["failed_writes"] >= 5
    chain.close()


def test_queued_bytes_is_the_writers_backlog_until_written(tmp_path, clock):
    """``queued_bytes``: blocks queued and not yet written (a replica sharing the tier cannot read them yet)."""
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path, policy="write-through")
    store.attach(chain)
    assert chain.flush_writes(5) and chain.stats()["disk"]["queued_bytes"] == 0
    with chain._cv:  # hold the writer: the six blocks wait in its queue
        insert(store, "a", SEQ)
        queued = chain.stats()["disk"]["queued_bytes"]
    assert queued > 0 and queued % 6 == 0  # six blocks of one size
    assert chain.flush_writes(5) and chain.stats()["disk"]["queued_bytes"] == 0
    assert chain.stats()["disk"]["write_backs"] == 6
    chain.close()


def test_a_full_disk_stops_writes_and_reads_go_on(tmp_path, clock, monkeypatch):
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path, policy="write-through")
    store.attach(chain)
    insert(store, "a", SEQ[:8])
    chain.flush_writes(5)
    real_replace = os.replace

    def no_space(src, dst):  # what a full filesystem answers
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    insert(store, "a", SEQ)
    chain.flush_writes(5)
    monkeypatch.setattr(os, "replace", real_replace)
    stats = chain.stats()["disk"]
    # One write meets the full disk; the other three are refused untried during the backoff: all four counted.
    assert stats["degraded"] == 1 and stats["failed_writes"] == 4 and stats["write_backs"] == 2
    assert len(block_files(tmp_path)) == 2 and list((tmp_path / "tmp").iterdir()) == []
    fresh = make_store(clock, blocks_budget=100)
    fresh.attach(chain)
    assert restore(fresh, "a", SEQ).cached_tokens == 8  # reads go on
    chain.close()


def host_chain(clock, blocks: int):
    """A store of 8 blocks over a host tier of ``blocks`` blocks, after SEQ went through it."""
    wall = lambda: 1_000_000.0  # noqa: E731
    host = HostTier(4 * 8 * blocks, "cpu", wall)
    chain = TierChain([host], BlockKeys(SECRET, shape().name), shape(), clock=wall)
    store = make_store(clock, blocks_budget=8)
    store.attach(chain)
    insert(store, "a", SEQ)
    insert(store, "c", [200] * 32)  # fills the store: the 6 blocks of SEQ leave, deepest first
    chain.flush_writes(5)
    return store, chain, host


def test_host_tier_logic_on_a_device_argument(clock):
    """The host tier runs for accelerators only; its logic is device-agnostic and checked on the CPU."""
    store, chain, host = host_chain(clock, 3)
    assert chain.stats()["host"]["entries"] == 3 and chain.stats()["host"]["bytes"] == 3 * 32
    lease = restore(store, "a", SEQ)  # the LRU kept the 3 blocks evicted last: the first 3 of the prefix
    assert lease.cached_tokens == 12 and lease_values(lease) == [kv_value(SEQ, i) for i in range(12)]
    store.release(lease)
    chain.close()


def test_host_tier_refuses_a_block_of_another_namespace(clock):
    store, chain, host = host_chain(clock, 6)
    key = BlockKeys(SECRET, shape().name).blocks(NS["a"], SEQ, 4, 1)[1]
    entry = host._index[key]
    host._index[key] = type(entry)(BlockMeta(key, entry.meta.parent, "other", entry.meta.tokens, None), entry.kv,
                                   entry.nbytes)
    assert restore(store, "a", SEQ).cached_tokens == 0 and chain.stats()["host"]["corrupt_entries"] == 1
    assert key not in host._index
    chain.close()


def test_a_purge_empties_the_host_tier_of_one_tenant(clock):
    store, chain, host = host_chain(clock, 20)
    insert(store, "b", [300] * 8)
    insert(store, "c", [201] * 32)  # pushes b's blocks down too
    chain.flush_writes(5)
    before = chain.stats()["host"]["entries"]
    assert chain.purge("a") == 6 and chain.stats()["host"]["entries"] == before - 6
    assert restore(store, "a", SEQ).cached_tokens == 0
    assert chain.purge() == before - 6 and chain.stats()["host"]["entries"] == 0
    chain.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seqs=st.lists(st.lists(st.integers(2, 5), min_size=1, max_size=20), min_size=1, max_size=8),
       budget=st.integers(2, 6), disk_blocks=st.integers(1, 12))
def test_whatever_is_evicted_and_restored_the_kv_is_the_prefix_s(tmp_path_factory, seqs, budget, disk_blocks):
    """Random inserts into a tiny store over a tiny disk tier: every lease holds the KV of its own prefix."""
    from tests.conftest import FakeClock

    clock = FakeClock()
    store = make_store(clock, blocks_budget=budget)
    chain = disk_chain(tmp_path_factory.mktemp("d"), budget=disk_blocks * (4 * 8 + 400))
    store.attach(chain)
    try:
        for seq in seqs:
            insert(store, "a", seq)
        chain.flush_writes(5)
        for seq in seqs:
            lease = restore(store, "a", seq)
            assert lease_values(lease) == [kv_value(seq, i) for i in range(lease.cached_tokens)]
            store.release(lease)
            store.check_integrity()
        chain.flush_writes(5)
        disk = chain.stats()["disk"]
        assert disk["bytes"] <= disk["budget_bytes"] and disk["corrupt_entries"] == 0
        assert disk["entries"] == len(block_files(chain.tiers[0].root))
    finally:
        chain.close()
