"""The lower tiers against someone who can read or write Redis or the tier directory (docs/hardening.md,
"Lower tiers"): forged and foreign blocks, malformed headers, oversized values, Redis refusing
writes, the disk tier's secret, modes, lock and marker, purges, and encryption at rest."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
import subprocess
import sys
import threading
import tracemalloc

import pytest
import torch

from prefixcache import PrefixCache
from prefixcache.cache.tiers import build_chain
from prefixcache.cache.tiers.codec import MAC_BYTES, PREFIX, BlockCodec, BlockMeta, CorruptBlock
from prefixcache.cache.tiers.disk import DiskTier
from prefixcache.cache.tiers.files import LOCK, MARKER, SECRET_FILE, TierDirectoryError
from prefixcache.cache.tiers.redis_tier import PREFIX as KEY_PREFIX
from prefixcache.cache.tiers.redis_tier import member
from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from tests.cache.store_helpers import NS, insert, kv_value, lease_values, make_store, scope
from tests.cache.tier_helpers import (
    OTHER_SECRET,
    SECRET,
    Monotonic,
    block_files,
    disk_chain,
    keys,
    prefix_files,
    redis_chain,
    shape,
)
from tests.conftest import build_tiny, untouched

SEQ = list(range(10, 34))  # 6 blocks of 4
HASH_SECRET = SECRET.decode()


def restore(store, tokens, tenant="a"):
    return store.acquire(scope(tenant), tokens, len(tokens), restore=True)


def prompt(seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 300, (1, 40), generator=torch.Generator().manual_seed(seed))


def sdk(model, **tiers) -> PrefixCache:
    cfg = CacheConfig(block_size=8, tier_write_policy="write-through", **tiers)
    return PrefixCache(model, None, cfg, start_sweeper=False, batching=False)


def forge(blob: bytes, key: bytes) -> bytes:
    """What someone who can write Redis but lacks the secret can do: zero the KV and recompute the trailer as
    the format does, without the key they lack (BLAKE2b-256 over the block key and the bytes, unkeyed)."""
    (size,) = struct.unpack_from("<I", blob, PREFIX.size)
    start = PREFIX.size + 4 + size
    body = blob[:start] + bytes(len(blob) - MAC_BYTES - start)
    return body + hashlib.blake2b(key + body, digest_size=MAC_BYTES).digest()


def payload_key(name: bytes) -> bytes:
    return bytes.fromhex(name.decode().rsplit(":", 1)[1])


def first_meta() -> BlockMeta:
    """The first block of ``SEQ`` for tenant a, as a reader expects it."""
    chain = keys().blocks(NS["a"], SEQ, 4, 1)
    return BlockMeta(chain[1], chain[0], keys().namespace_tag(NS["a"]), tuple(SEQ[:4]), None, keys().tenant_tag("a"))


def assert_refused_and_deleted(chain, tier: str, clock) -> None:
    """A fresh store restoring ``SEQ`` through ``chain`` gets nothing: the planted first block was counted
    corrupt once and deleted from the tier."""
    fresh = make_store(clock, blocks_budget=100)
    fresh.attach(chain)
    assert restore(fresh, SEQ).cached_tokens == 0
    assert chain.stats()[tier]["corrupt_entries"] == 1 and not chain.tiers[0].contains(first_meta())


def written(tier: str, tmp_path, request, clock):
    """Tenant a's ``SEQ`` stored and written through to a ``tier`` ("disk" or "redis"): (the tier chain, the
    Redis server or None)."""
    store = make_store(clock, blocks_budget=100)
    server = request.getfixturevalue("redis_server") if tier == "redis" else None
    chain = disk_chain(tmp_path, policy="write-through") if server is None else redis_chain(server.url)
    store.attach(chain)
    insert(store, "a", SEQ)
    chain.flush_writes(5)
    return chain, server


def test_a_forged_block_is_refused_and_the_answer_recomputed(redis_server):
    model = build_tiny("llama-gqa")
    ids = prompt()
    want = untouched(model).generate(ids, max_new_tokens=6, do_sample=False)
    cache = sdk(model, tier_redis=redis_server.url, hash_secret=HASH_SECRET)
    try:
        assert torch.equal(cache.generate(ids, max_new_tokens=6, do_sample=False), want)
        cache.tiers.flush_writes(10)
        client = redis_server.client()
        names = client.keys(KEY_PREFIX + "b:*")
        assert names
        for name in names:
            client.set(name, forge(client.get(name), payload_key(name)), keepttl=True)
        cache.flush(tiers=False)  # the next call must look below the device
        assert torch.equal(cache.generate(ids, max_new_tokens=6, do_sample=False), want)
        assert cache.last_call.cached_tokens == 0
        assert cache.stats()["tiers"]["redis"]["corrupt_entries"] >= 1
    finally:
        cache.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_block_sealed_under_another_secret_is_refused(tier, tmp_path, request, clock):
    """Another deployment's block, placed under this deployment's key name, is refused, deleted, counted."""
    chain, server = written(tier, tmp_path, request, clock)
    foreign = BlockCodec(keys(OTHER_SECRET), chain.codec.dtype, chain.codec.shape)  # only the secret differs
    forged = foreign.encode(first_meta(), torch.zeros(1, 2, 1, 4, 1))
    if tier == "disk":
        prefix_files(tmp_path, NS["a"], SEQ)[0].write_bytes(forged)
    else:
        server.client().set(f"{KEY_PREFIX}b:{member(first_meta())}", forged)
    assert_refused_and_deleted(chain, tier, clock)
    chain.close()


BAD_HEADERS = {"list": b"[1,2]", "string": b'"key"', "null": b"null", "number": b"7",
               "nested": json.dumps({"key": {"a": [[1]]}, "parent": "", "ns": "", "tokens": [[10]], "dtype": "",
                                     "shape": []}).encode(),
               "deep": b"[" * 40_000 + b"]" * 20_000, "too-long": b" " * (65 << 10), "not-utf8": b"\xff\xfe",
               "extra-field": b'{"key":"","parent":"","ns":"","tokens":[],"dtype":"","shape":[],"x":1}',
               "bool-token": b'{"key":"","parent":"","ns":"","tokens":[true],"dtype":"","shape":[]}'}


def sealed(codec: BlockCodec, key: bytes, header: bytes) -> bytes:
    """A block with the right secret around a malformed header (a buggy or compromised writer)."""
    return codec.seal(key, struct.pack("<I", len(header)) + header + bytes(codec.payload_bytes), None)


@pytest.mark.parametrize("name", list(BAD_HEADERS))
def test_a_header_that_is_not_a_flat_json_object_is_corrupt(name):
    codec = BlockCodec(keys(), torch.float32, shape().block())
    meta = first_meta()
    with pytest.raises(CorruptBlock):
        codec.decode(sealed(codec, meta.key, BAD_HEADERS[name]), meta)


@pytest.mark.parametrize("name", ["list", "nested"])
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_malformed_header_in_a_tier_is_deleted_and_the_tier_starts(tier, name, tmp_path, request, clock):
    chain, server = written(tier, tmp_path, request, clock)
    blob = sealed(chain.codec, first_meta().key, BAD_HEADERS[name])
    if server is None:
        chain.close()
        prefix_files(tmp_path, NS["a"], SEQ)[0].write_bytes(blob)
        chain = disk_chain(tmp_path)  # a restart indexes it without parsing it
    else:
        server.client().set(f"{KEY_PREFIX}b:{member(first_meta())}", blob)
    assert_refused_and_deleted(chain, tier, clock)
    if server is not None:
        assert server.client().zscore(KEY_PREFIX + "lru", member(first_meta())) is None
    chain.close()


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_an_oversized_value_is_refused_unread(tier, tmp_path, request, clock):
    chain, server = written(tier, tmp_path, request, clock)
    huge = 64 << 20
    if server is None:
        os.truncate(prefix_files(tmp_path, NS["a"], SEQ)[0], huge)  # sparse: costs no disk
    else:
        server.client().setrange(f"{KEY_PREFIX}b:{member(first_meta())}", huge, b"x")
    fresh = make_store(clock, blocks_budget=100)
    fresh.attach(chain)
    tracemalloc.start()
    try:
        assert restore(fresh, SEQ).cached_tokens == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < huge // 8, f"{peak} bytes allocated: the value was read"
    assert chain.stats()[tier]["corrupt_entries"] == 1 and not chain.tiers[0].contains(first_meta())
    chain.close()


@pytest.mark.parametrize("failure", ["oom", "readonly", "noperm"])
def test_redis_errors_degrade_with_backoff_and_stats_never_raise(failure, redis_server, clock):
    admin, mono, url = redis_server.client(), Monotonic(), redis_server.url
    if failure == "oom":
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
    elif failure == "readonly":
        admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # a master that never answers: writes are refused
    else:  # a user who may not read the index's counters
        admin.execute_command("ACL", "SETUSER", "tier", "on", ">pw", "~*", "+@all", "-zcard")
        url = f"redis://tier:pw@127.0.0.1:{redis_server.port}/0"
    store = make_store(clock, blocks_budget=100)
    chain = redis_chain(url, monotonic=mono)
    store.attach(chain)
    try:
        insert(store, "a", SEQ)
        chain.flush_writes(5)
        stats = chain.stats()["redis"]  # never raises
        if failure != "noperm":
            assert stats["failed_writes"] >= 1
        assert chain.stats()["redis"]["degraded"] == 1
        assert restore(make_store(clock, blocks_budget=100), SEQ).cached_tokens == 0  # a miss, no exception
    finally:
        admin.config_set("maxmemory", 0)
        admin.execute_command("REPLICAOF", "NO", "ONE")
        admin.execute_command("ACL", "SETUSER", "tier", "+@all")
    mono.now += 60  # the backoff passed; the server answers again
    insert(store, "a", [7] * 8)
    chain.flush_writes(5)
    assert chain.stats()["redis"]["degraded"] == 0
    chain.close()


def test_figures_survive_a_garbled_index(redis_server, clock):
    chain = redis_chain(redis_server.url)
    redis_server.client().set(KEY_PREFIX + "bytes", "not a number")
    assert chain.stats()["redis"]["bytes"] == 0  # the last figures known, no exception
    redis_server.client().delete(KEY_PREFIX + "lru")
    redis_server.client().set(KEY_PREFIX + "lru", "not a sorted set")
    assert chain.stats()["redis"]["degraded"] == 1
    chain.close()


def test_the_disk_secret_is_written_atomically_owner_only_and_checked(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    tier = DiskTier(root, 1 << 20, lambda: 0.0)

    def crash(fd):
        raise OSError("crash before the secret reached the disk")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fsync", crash)
        with pytest.raises(OSError, match="crash"):
            tier.own_secret()
    assert not (root / SECRET_FILE).exists()  # never a half-written secret
    secret = tier.own_secret()
    assert len(secret) == 32 and tier.own_secret() == secret
    assert stat.S_IMODE((root / SECRET_FILE).stat().st_mode) == 0o600
    for bad in (b"", b"abcd", b"zz" * 32):
        (root / SECRET_FILE).write_bytes(bad)
        with pytest.raises(TierDirectoryError, match="secret"):
            tier.own_secret()
    tier.close()
    with pytest.raises(ConfigError, match="secret"):  # and a clear error at start-up
        build_chain(CacheConfig(tier_disk=str(root)), shape())


def test_disk_files_are_owner_only_whatever_the_umask(tmp_path, clock):
    old = os.umask(0o002)
    try:
        store = make_store(clock, blocks_budget=100)
        chain = disk_chain(tmp_path / "kv", policy="write-through")
        store.attach(chain)
        insert(store, "a", SEQ)
        chain.flush_writes(5)
        chain.tiers[0].own_secret()
        chain.close()
    finally:
        os.umask(old)
    paths = [tmp_path / "kv", *(tmp_path / "kv").rglob("*")]
    assert len(block_files(tmp_path / "kv")) == 6
    for path in paths:
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path


def test_one_process_per_disk_directory(tmp_path):
    tier = DiskTier(tmp_path / "kv", 1 << 20, lambda: 0.0)
    with pytest.raises(TierDirectoryError, match="another process"):
        DiskTier(tmp_path / "kv", 1 << 20, lambda: 0.0)
    code = ("import sys; from prefixcache.cache.tiers.disk import DiskTier\n"
            "try: DiskTier(sys.argv[1], 1 << 20, lambda: 0.0)\n"
            "except Exception as exc: print(exc); sys.exit(3)")
    other = subprocess.run([sys.executable, "-c", code, str(tmp_path / "kv")], capture_output=True, text=True,
                           timeout=120)
    assert other.returncode == 3 and f"pid {os.getpid()}" in other.stdout
    tier.close()
    DiskTier(tmp_path / "kv", 1 << 20, lambda: 0.0).close()  # released on close


def test_a_directory_without_the_marker_is_left_untouched(tmp_path):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "precious").write_text("not ours")
    (tmp_path / "notes.txt").write_text("not ours either")
    before = stat.S_IMODE(tmp_path.stat().st_mode)
    with pytest.raises(TierDirectoryError, match=MARKER):
        DiskTier(tmp_path, 1 << 20, lambda: 0.0)
    assert (tmp_path / "tmp" / "precious").exists() and stat.S_IMODE(tmp_path.stat().st_mode) == before
    assert not (tmp_path / LOCK).exists() and not (tmp_path / MARKER).exists()


def test_flush_and_purge_then_restart_serves_nothing_flushed(tmp_path, redis_server):
    model = build_tiny("llama-gqa")
    tiers = {"tier_disk": str(tmp_path / "kv"), "tier_redis": redis_server.url, "hash_secret": HASH_SECRET}
    ids = {"a": prompt(1), "b": prompt(2)}
    cache = sdk(model, **tiers)
    for tenant, row in ids.items():
        cache.generate(row, max_new_tokens=2, do_sample=False, tenant=tenant)
    cache.tiers.flush_writes(10)
    cache.flush("a", tiers=False)
    assert cache.tiers.purge("a") == 2 * (42 // 8)  # tenant a's full blocks (prompt and answer) in both tiers
    cache.close()
    for tier_names in (("tier_disk", "hash_secret"), ("tier_redis", "hash_secret")):  # each tier on its own
        again = sdk(model, **{k: tiers[k] for k in tier_names})
        try:
            for tenant, row in ids.items():
                again.generate(row, max_new_tokens=2, do_sample=False, tenant=tenant)
                assert (again.last_call.cached_tokens > 0) == (tenant == "b"), (tier_names, tenant)
            again.flush()
            again.tiers.purge()
        finally:
            again.close()
    assert redis_server.client().keys("*") == [] and block_files(tmp_path / "kv") == []  # purged every tenant
    last = sdk(model, **tiers)
    try:
        last.generate(ids["b"], max_new_tokens=2, do_sample=False, tenant="b")
        assert last.last_call.cached_tokens == 0
    finally:
        last.close()


def test_purge_drops_queued_writes_of_the_tenant(tmp_path, clock):
    store = make_store(clock, blocks_budget=100)
    chain = disk_chain(tmp_path, policy="write-through")
    store.attach(chain)
    with chain._cv:  # hold the writer: the blocks wait in the queue
        insert(store, "a", SEQ)
        insert(store, "b", SEQ)
    chain.purge("a")
    chain.flush_writes(5)
    assert block_files(tmp_path) == sorted(prefix_files(tmp_path, NS["b"], SEQ))
    chain.close()


@pytest.mark.parametrize("encrypt", [False, True])
def test_encrypted_tiers_hold_no_tokens_or_kv_in_the_clear(encrypt, tmp_path, redis_server, clock):
    store = make_store(clock, blocks_budget=100)
    disk = disk_chain(tmp_path, policy="write-through", encrypt=encrypt)
    redis = redis_chain(redis_server.url, encrypt=encrypt)
    store.attach(disk)
    insert(store, "a", SEQ)
    disk.flush_writes(5)
    redis.stored(store.snapshots())
    redis.flush_writes(5)
    client = redis_server.client()
    values = [f.read_bytes() for f in block_files(tmp_path)] + [client.get(n) for n in client.keys(KEY_PREFIX + "b:*")]
    assert len(values) == 12
    tokens = json.dumps(SEQ[4:8], separators=(",", ":")).encode()
    kv = torch.tensor([kv_value(SEQ, i) for i in range(4, 8)], dtype=torch.float32).numpy().tobytes()
    clear = [v for v in values if tokens[1:-1] in v or kv in v]
    assert len(clear) == (0 if encrypt else 2)
    for chain in (disk, redis):  # and both still restore
        fresh = make_store(clock, blocks_budget=100)
        fresh.attach(chain)
        lease = restore(fresh, SEQ)
        assert lease.cached_tokens == 24 and lease_values(lease) == [kv_value(SEQ, i) for i in range(24)]
        fresh.release(lease)
        chain.close()


def test_secrets_and_redis_prefixes_are_checked():
    with pytest.raises(ConfigError, match="hash_secret"):
        CacheConfig(hash_secret="short secret")
    assert CacheConfig(hash_secret="x" * 32).hash_secret
    for bad in ("prefixcache:kv:", "{}:kv:", "{a b}:", ""):
        with pytest.raises(ConfigError, match="tier_redis_prefix"):
            CacheConfig(tier_redis_prefix=bad)
    assert CacheConfig(tier_redis_prefix="{team-a}:kv:").tier_redis_prefix == "{team-a}:kv:"


def test_a_cache_refused_its_tier_directory_leaves_no_thread_running(tmp_path):
    """The directory lock refuses a second cache on it; what that cache had started stops again."""
    model = build_tiny("llama-gqa")
    tiers = {"tier_disk": str(tmp_path / "kv"), "hash_secret": HASH_SECRET}
    first = PrefixCache(model, None, CacheConfig(block_size=8, **tiers), start_sweeper=False)
    try:
        before = sorted(t.name for t in threading.enumerate())
        with pytest.raises(TierDirectoryError):
            PrefixCache(model, None, CacheConfig(block_size=8, **tiers), start_sweeper=False)
        assert sorted(t.name for t in threading.enumerate()) == before
    finally:
        first.close()
