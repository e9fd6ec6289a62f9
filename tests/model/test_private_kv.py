"""The private KV pool: slots, growth, repacking, loads and windows, exact bytes, decode writes."""
from __future__ import annotations

import torch

from prefixcache.model.private_kv import PrivatePool

CPU = torch.device("cpu")
L, H, D = 2, 2, 3  # layers, KV heads, head dim


def pool_of(chunk: int = 4, plan_ahead: bool = False, layers: int = L, heads: int = H, dim: int = D) -> PrivatePool:
    return PrivatePool(layers, heads, dim, torch.float32, CPU, chunk=chunk, plan_ahead=plan_ahead)


def exact_bytes(pool: PrivatePool) -> int:
    layers, two, slots, heads, capacity, dim = pool.slab.shape
    return layers * two * slots * heads * capacity * dim * 4


def snapshot(n: int, base: float) -> torch.Tensor:
    """A distinct [L, 2, H, n, D] block of KV."""
    return base + torch.arange(L * 2 * H * n * D, dtype=torch.float32).reshape(L, 2, H, n, D)


def test_private_pool_slots_grow_repack_and_free():
    pool = PrivatePool(2, 1, 2, torch.float32, CPU, chunk=4)
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    for kv, base in ((a, 1.0), (b, 2.0), (c, 3.0)):
        kv.reserve(6)
        for layer in range(2):
            kv.write(layer, 0, torch.full((1, 6, 2), base + layer), torch.full((1, 6, 2), -base))
        kv.length = 6
    assert pool.slab.shape == (2, 2, 3, 1, 8, 2) and pool.nbytes == 2 * 2 * 3 * 8 * 2 * 4
    b.release(trim=False)  # kept for reuse
    assert pool.slab.shape[2] == 3 and pool.acquire().slot == 1
    pool.owners[1].release()  # trimmed: live slots repacked, values intact
    a.release()
    assert pool.slab.shape == (2, 2, 1, 1, 8, 2) and c.slot == 0
    assert c.view(1, 6)[0].unique().tolist() == [4.0] and c.window(0, 6)[0, 1].unique().tolist() == [-3.0]
    c.release()
    assert pool.nbytes == 0 and pool.owners == []


def test_private_pool_planning_ahead_reallocates_once_per_burst():
    """Requests joining together get their slots in one reallocation, sized for the most any may hold."""
    pool = PrivatePool(2, 1, 2, torch.float32, CPU, chunk=4, plan_ahead=True)
    a, b, c = pool.acquire_all([5, 9, 3])
    slab = pool.slab
    assert slab.shape == (2, 2, 3, 1, 12, 2) and [kv.slot for kv in (a, b, c)] == [0, 1, 2]
    for kv in (a, b, c):
        kv.reserve(9)  # within the plan: no reallocation while they grow
        kv.write(0, 0, torch.full((1, 9, 2), float(kv.slot + 1)), torch.zeros(1, 9, 2))
        kv.length = 9 if kv is b else 3
    assert pool.slab is slab
    b.release()  # the rest need at most 5 tokens: trimmed to 8 (two chunks), values kept
    assert pool.slab.shape == (2, 2, 2, 1, 8, 2) and (a.slot, c.slot) == (0, 1)
    assert a.view(0, 3)[0].unique().tolist() == [1.0] and c.view(0, 3)[0].unique().tolist() == [3.0]
    d, = pool.acquire_all([16])  # one more slot and a bigger plan: again one reallocation
    assert pool.slab.shape == (2, 2, 3, 1, 16, 2) and d.slot == 2 and d.need == 16
    plain = PrivatePool(2, 1, 2, torch.float32, CPU, chunk=4)
    e, = plain.acquire_all([16])
    assert plain.capacity == 0 and e.need == 16  # not planning ahead: capacity follows lengths


def test_load_appends_stored_kv_and_window_reads_it_back():
    pool = pool_of()
    kv = pool.acquire()
    first, second = snapshot(3, 0.0), snapshot(2, 1000.0)
    kv.load(first)
    kv.load(second)
    assert kv.length == 5 and pool.capacity == 8  # rounded up to whole chunks
    torch.testing.assert_close(kv.window(0, 5), torch.cat([first, second], dim=3), rtol=0, atol=0)
    torch.testing.assert_close(kv.window(3, 5), second, rtol=0, atol=0)
    keys, values = kv.view(1, 5)  # one layer's [H, n, D], a view (no copy)
    torch.testing.assert_close(keys, torch.cat([first, second], dim=3)[1, 0], rtol=0, atol=0)
    assert keys.untyped_storage().data_ptr() == pool.slab.untyped_storage().data_ptr()
    assert torch.count_nonzero(pool.slab[:, :, kv.slot, :, 5:]) == 0  # the padding stays zero
    assert pool.nbytes == exact_bytes(pool) == L * 2 * 1 * H * 8 * D * 4


def test_growth_without_a_plan_is_at_least_an_eighth_capped_at_the_need():
    pool = pool_of(chunk=4)
    kv = pool.acquire(need=100)
    kv.reserve(64)
    assert pool.capacity == 64
    kv.load(snapshot(64, 0.0))
    kv.reserve(65)  # one token more: an eighth more (72), not one chunk (68)
    assert pool.capacity == 72
    torch.testing.assert_close(kv.window(0, 64), snapshot(64, 0.0), rtol=0, atol=0)  # kept across the copy
    kv.reserve(99)
    assert pool.capacity == 100  # an eighth would be 84 < 99; rounded 99 -> 100, the need caps nothing here
    capped = pool_of(chunk=4)
    other = capped.acquire(need=66)
    other.reserve(64)
    other.reserve(65)
    assert capped.capacity == 68  # an eighth (72) would exceed what it may ever hold (66 -> 68)
    no_need = pool_of(chunk=4)
    last = no_need.acquire()
    last.reserve(64)
    last.reserve(65)
    assert no_need.capacity == 68  # no need known: exactly the chunk that fits


def test_bytes_are_exact_through_acquire_grow_release_and_reuse():
    pool = pool_of(chunk=4)
    assert pool.nbytes == 0 and pool.slab.numel() == 0
    a, b = pool.acquire_all([0, 0])
    for kv, n in ((a, 5), (b, 2)):
        kv.load(snapshot(n, float(n)))
        assert pool.nbytes == exact_bytes(pool)
    assert pool.slab.shape == (L, 2, 2, H, 8, D)
    a.release()  # trimmed: one slot, capacity for b's 2 tokens
    assert pool.slab.shape == (L, 2, 1, H, 4, D) and pool.nbytes == exact_bytes(pool)
    torch.testing.assert_close(b.window(0, 2), snapshot(2, 2.0), rtol=0, atol=0)
    a.release()  # twice: a no-op
    assert pool.slab.shape == (L, 2, 1, H, 4, D)
    b.release()
    assert pool.nbytes == 0 and pool.owners == []


def test_decode_group_writes_each_member_s_new_key_at_its_length():
    """One indexed copy puts member i's key/value (packed row rows[i]) at position length_i of its slot."""
    pool = pool_of(chunk=4)
    a, b, c = pool.acquire_all([0, 0, 0])
    for kv, n in ((a, 2), (b, 5), (c, 1)):
        kv.load(snapshot(n, 10.0 * n))
    pool.reserve(6)
    before = pool.slab.clone()
    members, rows = [c, a], [2, 0]  # b does not decode this step; rows out of order
    group = pool.decode_group(members, rows)
    packed = 3  # query rows in the step
    keys = torch.randn(H, packed, D)
    values = torch.randn(H, packed, D)
    group.write(1, keys, values)
    for kv, row in zip(members, rows):
        k, v = kv.view(1, kv.length + 1)
        torch.testing.assert_close(k[:, kv.length], keys[:, row], rtol=0, atol=0)
        torch.testing.assert_close(v[:, kv.length], values[:, row], rtol=0, atol=0)
    changed = (pool.slab != before).nonzero()
    assert set(changed[:, 0].tolist()) == {1}  # only layer 1
    assert set(changed[:, 2].tolist()) <= {a.slot, c.slot}  # never b's slot
    batch = group.batch(1)
    assert group.end == 3 and batch.keys.shape[-2] == 3  # keys read per slot: the longest member's length + 1
    torch.testing.assert_close(batch.keys, pool.slab[1, 0, :, :, :3], rtol=0, atol=0)
