"""Host-memory tier: blocks evicted from an accelerator kept in (pinned) CPU memory.

Only useful when the model is not on the CPU (there the device store *is* host memory,
and the chain leaves this tier out). Copies to the device are non-blocking from pinned
memory. Entries hold their header fields, so a restore compares token ids, parent key
and namespace exactly as the disk and Redis tiers do; the bytes never leave the process,
so no checksum is needed.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.cache.tiers.base import BlockIndex, IndexedTier, TierStats
from prefixcache.cache.tiers.codec import BlockCodec, BlockMeta


@dataclass(frozen=True, slots=True)
class _Entry:
    meta: BlockMeta
    kv: torch.Tensor  # [L, 2, H, n, D] on the CPU
    nbytes: int

    @property
    def expires_at(self) -> float | None:
        return self.meta.expires_at

    @property
    def tenant(self) -> str:
        return self.meta.tenant


class HostTier(IndexedTier):
    name = "host"

    def __init__(self, max_bytes: int, device: torch.device | str, clock: Callable[[], float]):
        self.device = torch.device(device)
        self.stats = TierStats()
        self._pin = self.device.type != "cpu" and torch.cuda.is_available()
        self._lock = threading.Lock()
        self._index = BlockIndex(max_bytes, clock, lambda key, entry: None)  # dropping an entry frees it

    def put(self, meta: BlockMeta, kv: torch.Tensor, encoded: Callable[[], bytes]) -> bool:
        nbytes = kv.numel() * kv.element_size()
        if nbytes > self._index.maxsize:
            return False
        copy = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self._pin)
        copy.copy_(kv)  # synchronous: the caller's tensor may go once this returns
        with self._lock:
            self._index[meta.key] = _Entry(meta, copy, nbytes)
        return True

    def _load(self, meta: BlockMeta, entry: _Entry, codec: BlockCodec) -> torch.Tensor | None:
        if (entry.meta != _fresh(meta, entry.meta) or entry.kv.dtype != codec.dtype
                or tuple(entry.kv.shape) != codec.shape):
            self.stats.add("corrupt_entries")
            self._forget(meta.key, entry)
            return None
        return entry.kv.to(self.device, non_blocking=self._pin)

    def figures(self) -> dict[str, Any]:
        with self._lock:
            self._index.expire()
            return {"bytes": int(self._index.currsize), "budget_bytes": int(self._index.maxsize),
                    "entries": len(self._index), "degraded": 0}

    def close(self) -> None:
        with self._lock:
            self._index.clear()


def _fresh(want: BlockMeta, stored: BlockMeta) -> BlockMeta:
    """``want`` with the stored expiry (what a reader does not know in advance) and tenant tag."""
    return BlockMeta(want.key, want.parent, want.namespace_tag, want.tokens, stored.expires_at, stored.tenant)
