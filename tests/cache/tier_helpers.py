"""Tier chains over the model-free store harness (``store_helpers``): KV [1, 2, 1, n, 1] float32."""
from __future__ import annotations

import torch

from prefixcache.cache.tiers import KVShape, TierChain
from prefixcache.cache.tiers.codec import BlockKeys
from prefixcache.cache.tiers.disk import DiskTier

SECRET = b"test-secret"


def shape(block_size: int = 4) -> KVShape:
    return KVShape(1, 1, 1, block_size, torch.float32, torch.device("cpu"))


def disk_chain(path, block_size: int = 4, budget: int = 1 << 20, clock=None, policy: str = "write-back",
               secret: bytes = SECRET, queue_bytes: int = 1 << 20) -> TierChain:
    wall = clock if clock is not None else (lambda: 1_000_000.0)
    tier = DiskTier(path, budget, wall)
    return TierChain([tier], BlockKeys(secret, shape(block_size).name), shape(block_size), write_policy=policy,
                     queue_bytes=queue_bytes, clock=wall)


def block_files(path) -> list:
    return sorted((path / "blocks").glob("*/*.kv"))


def prefix_files(path, namespace, tokens, block_size: int = 4, secret: bytes = SECRET) -> list:
    """Where a disk tier under ``path`` keeps the full blocks of ``tokens`` (whether they exist or not)."""
    keys = BlockKeys(secret, shape(block_size).name).blocks(namespace, tokens, block_size, len(tokens) // block_size)
    return [path / "blocks" / k.hex()[:2] / f"{k.hex()}.kv" for k in keys[1:]]
