"""Tier chains over the model-free store harness (``store_helpers``): KV [1, 2, 1, n, 1] float32."""
from __future__ import annotations

import torch

from prefixcache.cache.tiers import KVShape, TierChain
from prefixcache.cache.tiers.codec import BlockKeys
from prefixcache.cache.tiers.disk import DiskTier

SECRET = b"test-secret-of-at-least-32-bytes"
OTHER_SECRET = b"another-deployment-s-32-b-secret"


def shape(block_size: int = 4) -> KVShape:
    return KVShape(1, 1, 1, block_size, torch.float32, torch.device("cpu"))


def keys(secret: bytes = SECRET, block_size: int = 4) -> BlockKeys:
    return BlockKeys(secret, shape(block_size).name)


def disk_chain(path, block_size: int = 4, budget: int = 1 << 20, clock=None, policy: str = "write-back",
               secret: bytes = SECRET, queue_bytes: int = 1 << 20, encrypt: bool = False,
               idle=lambda: None) -> TierChain:
    wall = clock if clock is not None else (lambda: 1_000_000.0)
    tier = DiskTier(path, budget, wall)
    return TierChain([tier], keys(secret, block_size), shape(block_size), write_policy=policy,
                     queue_bytes=queue_bytes, clock=wall, encrypt=encrypt, idle=idle)


def block_files(path) -> list:
    return sorted((path / "blocks").glob("*/*/*.kv"))


def prefix_files(path, namespace, tokens, block_size: int = 4, secret: bytes = SECRET, tenant=None) -> list:
    """Where a disk tier under ``path`` keeps the full blocks of ``tokens`` (whether they exist or not); the
    tenant is the namespace's first part unless given."""
    k = keys(secret, block_size)
    chain = k.blocks(namespace, tokens, block_size, len(tokens) // block_size)
    tag = k.tenant_tag(namespace[0] if tenant is None else tenant)
    return [path / "blocks" / tag / c.hex()[:2] / f"{c.hex()}.kv" for c in chain[1:]]


class Monotonic:
    """A settable monotonic clock: backoffs pass when a test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def redis_chain(url, secret: bytes = SECRET, budget: int = 1 << 20, monotonic=None, policy: str = "write-through",
                encrypt: bool = False, prefix: str | None = None) -> TierChain:
    from prefixcache.cache.tiers.redis_tier import PREFIX, RedisTier

    wall = lambda: 1_000_000.0  # noqa: E731
    tier = RedisTier(url, budget, wall, monotonic or Monotonic(), prefix=PREFIX if prefix is None else prefix)
    return TierChain([tier], keys(secret), shape(), write_policy=policy, clock=wall, encrypt=encrypt)
