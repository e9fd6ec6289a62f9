"""What every lower tier shares: its interface, its figures, and its size-aware index.

A lower tier is a flat map from chained block key to block (the chain already encodes
the prefix), with its own byte budget: ``BlockIndex`` is ``cachetools``' size-aware
LRU with per-entry expiry (``TLRUCache``), which tells the tier which stored blocks it
dropped so their bytes are released too.
"""
from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from cachetools import TLRUCache

from prefixcache.cache.tiers.codec import BlockCodec, BlockMeta

#: Upper bounds (seconds) of the restore-time histogram buckets (the last bucket is +Inf).
RESTORE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Counters every tier keeps (``TierStats.snapshot`` keys besides the gauges and the histogram).
COUNTERS = ("hits", "misses", "restores", "restored_bytes", "write_backs", "failed_writes", "corrupt_entries")


class TierUnavailable(RuntimeError):
    """A tier cannot take a write now (unreachable, failing, or backing off): the write is counted as failed."""


class TierStats:
    """Running figures of one tier; thread-safe (the writer thread and request threads update them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._buckets = [0] * (len(RESTORE_BUCKETS) + 1)
        self._seconds = 0.0

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def restored(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._counts["restores"] += 1
            self._counts["restored_bytes"] += nbytes
            self._buckets[bisect.bisect_left(RESTORE_BUCKETS, seconds)] += 1
            self._seconds += seconds

    def snapshot(self) -> dict[str, Any]:
        """Counters, plus ``restore_seconds``: cumulative bucket counts (``le`` bounds), sum and count."""
        with self._lock:
            cumulative, running = [], 0
            for n in self._buckets:
                running += n
                cumulative.append(running)
            bounds = [*(str(b) for b in RESTORE_BUCKETS), "+Inf"]
            return {**self._counts, "restore_seconds": {"buckets": dict(zip(bounds, cumulative)),
                                                        "sum": self._seconds, "count": running}}


class Tier(Protocol):
    """One lower tier. Every method may be called from several threads at once."""

    name: str
    stats: TierStats

    def contains(self, meta: BlockMeta) -> bool:
        """Whether a live block is stored under ``meta.key`` until at least ``meta.expires_at`` (False when the
        tier cannot be reached): a copy that would expire sooner is written again, with the later expiry."""

    def put(self, meta: BlockMeta, kv: torch.Tensor, encoded: Callable[[], bytes]) -> bool:
        """Store one block (``encoded()`` gives its bytes, made once for all tiers). Whether it was stored."""

    def load_run(self, metas: Sequence[BlockMeta], codec: BlockCodec) -> list[torch.Tensor]:
        """The KV of the longest leading run of ``metas`` stored here and verified by ``codec``
        (``[L, 2, H, n, D]`` each, on the CPU or the device). A block that fails verification is
        deleted, counted in ``corrupt_entries`` and ends the run."""

    def purge(self, tenant: str | None) -> int:
        """Delete the blocks of ``tenant`` (a ``BlockKeys.tenant_tag``; None: every block). Blocks deleted."""

    def figures(self) -> dict[str, Any]:
        """Gauges: ``bytes``, ``budget_bytes``, ``entries``, ``degraded`` (0 or 1). Never raises."""

    def close(self) -> None:
        """Release connections and files (idempotent)."""


class IndexedTier:
    """A tier whose blocks this process indexes in a ``BlockIndex`` (host memory, local disk): the
    lookups and the restore loop; a subclass reads and verifies one block in ``_load``."""

    _lock: threading.Lock
    _index: BlockIndex
    stats: TierStats

    def contains(self, meta: BlockMeta) -> bool:
        with self._lock:
            entry = self._index.get(meta.key)
        return entry is not None and lasts(entry.expires_at, meta.expires_at)

    def load_run(self, metas: Sequence[BlockMeta], codec: BlockCodec) -> list[torch.Tensor]:
        out = []
        for meta in metas:
            with self._lock:
                entry = self._index.get(meta.key)
            kv = None if entry is None else self._load(meta, entry, codec)
            if kv is None:
                break
            out.append(kv)
        return out

    def _load(self, meta: BlockMeta, entry: Any, codec: BlockCodec) -> torch.Tensor | None:
        """The block's KV, verified; None (the entry forgotten, and counted if corrupt) if it is not usable."""
        raise NotImplementedError

    def purge(self, tenant: str | None) -> int:
        with self._lock:
            self._index.expire()  # expired entries go through ``on_drop`` as usual
            doomed = [(key, entry) for key, entry in list(self._index.items())
                      if tenant is None or entry.tenant == tenant]
            for key, _ in doomed:
                del self._index[key]
        for key, entry in doomed:
            self._purged(key, entry)
        return len(doomed)

    def _purged(self, key: bytes, entry: Any) -> None:
        """Free what ``entry`` holds outside the index (a file); nothing by default."""

    def _forget(self, key: bytes, entry: Any) -> None:
        """Drop ``key`` from the index if it still maps to ``entry``."""
        with self._lock:
            if self._index.get(key) is entry:
                try:
                    del self._index[key]
                except KeyError:  # expired meanwhile: already gone
                    pass


class BlockIndex(TLRUCache):
    """A byte-budgeted LRU map with per-entry expiry; ``on_drop(key, value)`` runs for every entry it
    drops by itself (least recently used when over budget, or expired) so the caller frees it."""

    def __init__(self, max_bytes: int, clock: Callable[[], float], on_drop: Callable[[Any, Any], None]):
        super().__init__(max_bytes, ttu=_until, timer=clock, getsizeof=lambda entry: entry.nbytes)
        self._on_drop = on_drop

    def popitem(self) -> tuple[Any, Any]:
        key, value = super().popitem()
        self._on_drop(key, value)
        return key, value

    def expire(self, time: float | None = None) -> list[tuple[Any, Any]]:
        expired = super().expire(time)
        for key, value in expired:
            self._on_drop(key, value)
        return expired


def lasts(stored: float | None, wanted: float | None) -> bool:
    """Whether a copy expiring at ``stored`` lives at least until ``wanted`` (None: never expires)."""
    return stored is None or (wanted is not None and stored >= wanted)


def _until(key: Any, entry: Any, now: float) -> float:
    return float("inf") if entry.expires_at is None else entry.expires_at
