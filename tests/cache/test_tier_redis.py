"""The Redis tier against a real redis-server: sharing, secrets, corruption, budget, outage and recovery."""
from __future__ import annotations

import pytest

from prefixcache.cache.tiers.codec import BlockKeys
from prefixcache.cache.tiers.redis_tier import PREFIX
from tests.cache.store_helpers import NS, insert, kv_value, lease_values, make_store, scope
from tests.cache.tier_helpers import OTHER_SECRET, SECRET, Monotonic, redis_chain, shape

SEQ = list(range(10, 34))  # 6 blocks of 4


def restore(store, tokens, tenant="a"):
    return store.acquire(scope(tenant), tokens, len(tokens), restore=True)


@pytest.fixture
def writer(redis_server, clock):
    """Process A: stores SEQ, written through to Redis."""
    store = make_store(clock, blocks_budget=100)
    chain = redis_chain(redis_server.url)
    store.attach(chain)
    insert(store, "a", SEQ)
    assert chain.flush_writes(5)
    yield chain
    chain.close()


def test_another_process_with_the_same_secret_restores_it(writer, redis_server, clock):
    reader = make_store(clock, blocks_budget=100)
    chain = redis_chain(redis_server.url)
    reader.attach(chain)
    lease = restore(reader, SEQ + [1])
    assert lease.cached_tokens == 24 and lease_values(lease) == [kv_value(SEQ, i) for i in range(24)]
    reader.release(lease)
    reader.check_integrity()
    stats = chain.stats()["redis"]
    assert stats["hits"] == 1 and stats["restored_bytes"] == 24 * 8 and stats["entries"] == 6
    assert stats["degraded"] == 0
    chain.close()


def test_another_secret_or_tenant_never_hits(writer, redis_server, clock):
    reader = make_store(clock, blocks_budget=100)
    chain = redis_chain(redis_server.url, secret=OTHER_SECRET)
    reader.attach(chain)
    assert restore(reader, SEQ).cached_tokens == 0
    same = redis_chain(redis_server.url)
    reader.attach(same)
    assert restore(reader, SEQ, tenant="b").cached_tokens == 0
    assert chain.stats()["redis"]["misses"] == 1
    chain.close()
    same.close()


def test_keys_name_nothing_of_the_prompt_or_tenant(writer, redis_server):
    names = [k.decode() for k in redis_server.client().keys("*")]
    assert len([n for n in names if n.startswith(PREFIX + "b:")]) == 6
    assert not any("a" == part or "model" in n for n in names for part in n.split(":")[3:])


@pytest.mark.parametrize("damage", ["flip", "truncate", "payload-gone"])
def test_a_damaged_or_missing_payload_is_a_deleted_miss(writer, redis_server, clock, damage):
    client = redis_server.client()
    keys = BlockKeys(SECRET, shape().name)
    key = keys.blocks(NS["a"], SEQ, 4, 3)[3]
    name = f"{PREFIX}b:{keys.tenant_tag('a')}:{key.hex()}"
    blob = bytearray(client.get(name))
    if damage == "flip":
        blob[-30] ^= 0x10
        client.set(name, bytes(blob))
    elif damage == "truncate":
        client.set(name, bytes(blob[:-7]))
    else:  # expired, or evicted by the server's own maxmemory: the index entry is stale
        client.delete(name)
    reader = make_store(clock, blocks_budget=100)
    chain = redis_chain(redis_server.url)
    reader.attach(chain)
    lease = restore(reader, SEQ)
    assert lease.cached_tokens == 8 and lease_values(lease) == [kv_value(SEQ, i) for i in range(8)]
    assert chain.stats()["redis"]["corrupt_entries"] == (0 if damage == "payload-gone" else 1)
    assert client.zscore(PREFIX + "lru", name[len(PREFIX) + 2:]) is None and not client.exists(name)
    chain.close()


def test_the_byte_budget_evicts_least_recently_used_blocks(redis_server, clock):
    store = make_store(clock, blocks_budget=100)
    probe = redis_chain(redis_server.url)
    store.attach(probe)
    insert(store, "a", SEQ[:4])
    probe.flush_writes(5)
    block = probe.stats()["redis"]["bytes"]
    probe.close()
    store = make_store(clock, blocks_budget=100)
    chain = redis_chain(redis_server.url, budget=3 * block)
    store.attach(chain)
    insert(store, "a", SEQ)
    chain.flush_writes(5)
    stats = chain.stats()["redis"]
    assert stats["entries"] == 3 and stats["bytes"] == 3 * block <= stats["budget_bytes"]
    assert len(redis_server.client().keys(PREFIX + "b:*")) == 3
    chain.close()


def test_redis_down_means_recompute_degraded_then_recovery(redis_server, clock):
    mono = Monotonic()
    store = make_store(clock, blocks_budget=8)
    chain = redis_chain(redis_server.url, monotonic=mono)
    store.attach(chain)
    insert(store, "a", SEQ)
    chain.flush_writes(5)
    redis_server.stop()
    fresh = make_store(clock, blocks_budget=8)
    fresh.attach(chain)
    assert restore(fresh, SEQ).cached_tokens == 0  # no exception: a miss, served by recompute
    assert chain.stats()["redis"]["degraded"] == 1
    insert(store, "a", [7] * 8)  # writes while down fail fast and are counted
    chain.flush_writes(5)
    assert chain.stats()["redis"]["failed_writes"] >= 1
    redis_server.start()  # same port, empty (no persistence)
    assert chain.stats()["redis"]["degraded"] == 1  # still backing off: no call made
    mono.now += 60
    new = list(range(40, 56))
    insert(store, "a", new)
    chain.flush_writes(5)
    stats = chain.stats()["redis"]
    assert stats["degraded"] == 0 and stats["entries"] >= 4  # the new blocks, and those they evicted
    other = make_store(clock, blocks_budget=100)
    other.attach(chain)
    assert restore(other, new).cached_tokens == 16
    chain.close()


def test_a_purge_reaches_blocks_whose_index_redis_dropped(writer, redis_server, clock):
    """Redis' own maxmemory eviction may drop any key, index keys too: a tenant's purge finds its blocks by
    name, deletes every one still there, and leaves other tenants' blocks alone."""
    store = make_store(clock, blocks_budget=100)
    store.attach(writer)
    insert(store, "b", SEQ)
    writer.flush_writes(5)
    client = redis_server.client()
    tags = {t: BlockKeys(SECRET, shape().name).tenant_tag(t) for t in "ab"}
    assert {t: len(client.keys(f"{PREFIX}b:{tag}:*")) for t, tag in tags.items()} == {"a": 6, "b": 6}
    lost = client.zrange(PREFIX + "lru", 0, -1)
    client.zrem(PREFIX + "lru", *[m for m in lost if m.decode().startswith(tags["a"])][:3])  # as eviction would
    client.delete(PREFIX + "size")
    assert writer.purge("a") == 6
    assert client.keys(f"{PREFIX}b:{tags['a']}:*") == [] and len(client.keys(f"{PREFIX}b:{tags['b']}:*")) == 6
    assert not [m for m in client.zrange(PREFIX + "lru", 0, -1) if m.decode().startswith(tags["a"])]
    fresh = make_store(clock, blocks_budget=100)
    fresh.attach(writer)
    assert restore(fresh, SEQ, "a").cached_tokens == 0 and restore(fresh, SEQ, "b").cached_tokens == 24
    with pytest.raises(ValueError, match="tenant tag"):
        writer.tiers[0].purge("*")


def test_a_purge_of_every_tenant_stays_under_its_own_prefix(writer, redis_server, clock):
    """A prefix holding glob characters is matched literally: purging it leaves another prefix's blocks."""
    odd = redis_chain(redis_server.url, prefix="{odd*[x]?}:kv:")
    store = make_store(clock, blocks_budget=100)
    store.attach(odd)
    insert(store, "a", SEQ)
    odd.flush_writes(5)
    client = redis_server.client()
    assert len(client.keys(r"{odd\*\[x\]\?}:kv:b:*")) == 6
    assert odd.purge() == 6
    assert client.keys(r"{odd\*\[x\]\?}:kv:*") == [] and len(client.keys(PREFIX + "b:*")) == 6
    odd.close()
