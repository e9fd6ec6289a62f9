"""A model-free store harness: fake KV whose values encode the token prefix they belong to."""
from __future__ import annotations

import torch
import xxhash

from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.scope import Scope
from prefixcache.cache.store import KVStore
from prefixcache.config import CacheConfig

NS = {t: (t, "model", "rev", "float32", "tpl") for t in ("a", "b", "c")}


def scope(tenant: str, ttl: float | None = 300.0) -> Scope:
    """The tenant's scope in this harness (its ``NS`` namespace)."""
    return Scope(NS[tenant], tenant, ttl)
BYTES_PER_TOKEN = 2 * 4  # [L=1, 2, H=1, n, D=1] float32


def kv_value(tokens, i: int) -> float:
    """The fake KV of position ``i`` depends on every token up to it, as real KV does."""
    return float(xxhash.xxh32_intdigest(bytes(str(tokens[: i + 1]), "ascii")) % 100_000)


def slicer(tokens):
    def slice_kv(start: int, end: int) -> torch.Tensor:
        vals = torch.tensor([kv_value(tokens, i) for i in range(start, end)], dtype=torch.float32)
        return torch.stack([vals, -vals]).reshape(1, 2, 1, end - start, 1).clone()

    return slice_kv


def lease_values(lease) -> list[float]:
    out: list[float] = []
    for step in lease.steps:
        out.extend(step.node.kv[0, 0, 0, : step.used, 0].tolist())
    return out


def make_store(clock, *, blocks_budget: int = 1000, block_size: int = 4, quota_blocks: int | None = None,
               hash_fn=None, pin_quota_blocks: int | None = None, pin_ttl: float | None = 3600.0,
               total_blocks: int | None = None) -> KVStore:
    """A store of ``blocks_budget`` blocks; pins are limited only by the budget unless ``pin_quota_blocks``; all KV
    (stored and reserved) by ``total_blocks`` if given."""
    block = block_size * BYTES_PER_TOKEN
    cfg = CacheConfig(max_bytes=blocks_budget * block, block_size=block_size,
                      tenant_quota_bytes=None if quota_blocks is None else quota_blocks * block,
                      tenant_pin_quota_bytes=(blocks_budget if pin_quota_blocks is None else pin_quota_blocks) * block,
                      pin_ttl_seconds=pin_ttl, max_kv_bytes_total=None if total_blocks is None else total_blocks * block)
    hasher = BlockHasher(1234) if hash_fn is None else BlockHasher(1234, hash_fn)
    return KVStore(cfg, hasher, clock)


def insert(store, tenant: str, tokens, ttl=300.0, pin=False, privileged=False, own=None):
    return store.insert(scope(tenant, ttl), tokens, slicer(tokens), pin=pin, privileged=privileged, own=own)


def lookup(store, tenant: str, tokens, ttl=300.0):
    return store.acquire(scope(tenant, ttl), tokens, len(tokens))
