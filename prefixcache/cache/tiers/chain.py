"""The tier chain below the device store: host memory, local disk, Redis (each optional).

The store hands the chain what leaves the device (``offload``: write-back on eviction),
what it stores when the policy is write-through or the prefix is pinned (``stored``),
and asks it, on a device miss, for the longest run of blocks it can restore
(``restore``). Writes run on one writer thread behind a byte-bounded queue: a request
never waits for a tier, and a block that does not fit the queue is dropped and counted
(``failed_writes``). Reads run on the requesting thread, tier by tier: each tier serves
the longest verified run it holds from where the tiers above it stopped.

Tiers are inclusive: a block is written to every tier that does not hold it yet, so a
block dropped from a faster tier is usually still in a slower one. Only full blocks go
down (a partial last block is recomputed: at most ``block_size - 1`` tokens). Every block
is sealed and opened by one ``BlockCodec`` (a MAC keyed from the secret, optionally
encryption). ``purge`` deletes a tenant's blocks from every tier, for a flush to reach them.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.cache.handles import EvictedSnapshot
from prefixcache.cache.policy import OFFLOAD_REASONS
from prefixcache.cache.tiers.base import Tier
from prefixcache.cache.tiers.codec import BlockCodec, BlockKeys, BlockMeta
from prefixcache.config import WRITE_POLICIES
from prefixcache.errors import TierPurgeError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVShape:
    """What a restored block must look like: ``[layers, 2, kv_heads, block_size, head_dim]`` of ``dtype``."""

    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device

    def block(self) -> tuple[int, ...]:
        return (self.layers, 2, self.kv_heads, self.block_size, self.head_dim)

    @property
    def name(self) -> str:
        return f"L{self.layers}xH{self.kv_heads}xD{self.head_dim}xB{self.block_size}:{self.dtype}"


class TierChain:
    def __init__(self, tiers: Sequence[Tier], keys: BlockKeys, shape: KVShape, *, write_policy: str = "write-back",
                 queue_bytes: int = 256 << 20, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic, encrypt: bool = False,
                 idle: Callable[[], None] = lambda: None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {WRITE_POLICIES}")
        self.tiers = list(tiers)
        self.keys, self.shape = keys, shape
        self.codec = BlockCodec(keys, shape.dtype, shape.block(), encrypt=encrypt)
        self.write_through = write_policy == "write-through"
        self.queue_bytes = queue_bytes
        self._clock, self._monotonic = clock, monotonic
        self._idle = idle  # the writer thread, about to wait for blocks (``WorkerThreads.release``)
        self._cv = threading.Condition()
        self._queue: deque[tuple[EvictedSnapshot, float | None]] = deque()  # (block, wall-clock expiry)
        self._pending = 0  # bytes queued or being written
        self._closed = False
        self._thread = threading.Thread(target=self._writer, name="prefixcache-tier-writer", daemon=True)
        self._thread.start()

    # -- writes (store side) -------------------------------------------------------
    def offload(self, snap: EvictedSnapshot) -> None:
        """Eviction hook: write the block back unless it expired or was flushed. Never blocks."""
        if snap.reason in OFFLOAD_REASONS:
            self._enqueue(snap)

    def stored(self, snaps: Sequence[EvictedSnapshot]) -> None:
        """Blocks just stored (write-through) or pinned: queue them for every tier. Never blocks."""
        for snap in snaps:
            self._enqueue(snap)

    def _enqueue(self, snap: EvictedSnapshot) -> None:
        if not self._full_block(snap):
            return
        nbytes = snap.kv.numel() * snap.kv.element_size()
        with self._cv:
            if self._closed or self._pending + nbytes > self.queue_bytes:
                for tier in self.tiers:
                    tier.stats.add("failed_writes")
                return
            self._pending += nbytes
            self._queue.append((snap, self._expiry(snap)))
            self._cv.notify()

    def flush_writes(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (or ``timeout`` seconds pass). Whether the queue is empty."""
        deadline = None if timeout is None else self._monotonic() + timeout
        with self._cv:
            while self._pending:
                left = None if deadline is None else deadline - self._monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 0.5)
        return True

    def drain(self, snaps: Sequence[EvictedSnapshot], timeout: float) -> int:
        """At shutdown: write every block still only on the device, within ``timeout`` seconds. Blocks written."""
        self.flush_writes(timeout)
        deadline, written = self._monotonic() + timeout, 0
        for snap in snaps:
            if self._monotonic() > deadline:
                log.warning("tier drain stopped at its deadline; the rest of the device cache is not kept")
                break
            if self._full_block(snap):
                written += self._write(snap, self._expiry(snap))
        return written

    def _writer(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._idle()
                    self._cv.wait()
                if not self._queue:
                    return
                snap, expires = self._queue.popleft()
            try:
                self._write(snap, expires)
            except Exception:  # noqa: BLE001 - the writer must outlive any one block
                log.exception("tier write failed")
            finally:
                with self._cv:
                    self._pending -= snap.kv.numel() * snap.kv.element_size()
                    self._cv.notify_all()

    def _expiry(self, snap: EvictedSnapshot) -> float | None:
        """The block's TTL as an absolute wall-clock time (it survives restarts, and waits in the queue)."""
        return None if snap.expires_in is None else self._clock() + snap.expires_in

    def _write(self, snap: EvictedSnapshot, expires: float | None) -> int:
        """Write one full block to every tier that lacks it. Returns the tiers written."""
        bs = self.shape.block_size
        index = snap.start // bs
        keys = self.keys.blocks(snap.namespace, snap.tokens, bs, index + 1)
        meta = BlockMeta(keys[index + 1], keys[index], self.keys.namespace_tag(snap.namespace),
                         tuple(snap.tokens[snap.start:]), expires, self.keys.tenant_tag(snap.tenant))
        blob: list[bytes] = []

        def encoded() -> bytes:
            if not blob:
                blob.append(self.codec.encode(meta, snap.kv))
            return blob[0]

        written = 0
        for tier in self.tiers:
            try:
                if tier.contains(meta):
                    continue
                if tier.put(meta, snap.kv, encoded):
                    tier.stats.add("write_backs")
                    written += 1
            except Exception as exc:  # noqa: BLE001 - one tier failing must not stop the others
                tier.stats.add("failed_writes")
                log.debug("tier %s: write failed: %s", tier.name, exc)
        return written

    def _full_block(self, snap: EvictedSnapshot) -> bool:
        bs = self.shape.block_size
        return snap.start % bs == 0 and len(snap.tokens) - snap.start == bs

    # -- reads ---------------------------------------------------------------------
    def restore(self, namespace: tuple[str, ...], tokens: Sequence[int], first: int,
                limit: int, tenant: str) -> tuple[int, torch.Tensor] | None:
        """The KV of the longest run of full blocks of ``tokens`` (of ``tenant``'s namespace) from ``first``
        (block aligned) up to ``limit`` that the tiers hold: ``(end, kv)``, ``kv``: ``[L, 2, H, end - first, D]``
        on the device, a fresh tensor. None when no tier holds the block at ``first``."""
        bs = self.shape.block_size
        lo, hi = first // bs, limit // bs
        if hi <= lo or not self.tiers:
            return None
        keys = self.keys.blocks(namespace, tokens, bs, hi)
        tag, owner = self.keys.namespace_tag(namespace), self.keys.tenant_tag(tenant)
        metas = [BlockMeta(keys[i + 1], keys[i], tag, tuple(tokens[i * bs : (i + 1) * bs]), None, owner)
                 for i in range(lo, hi)]
        parts: list[torch.Tensor] = []
        for tier in self.tiers:
            if len(parts) == len(metas):
                break
            start = self._monotonic()
            try:
                got = tier.load_run(metas[len(parts):], self.codec)
            except Exception as exc:  # noqa: BLE001 - a broken tier is a miss, never a failed request
                log.warning("tier %s: lookup failed: %s", tier.name, exc)
                got = []
            if not got:
                tier.stats.add("misses")
                continue
            got = [g.to(self.shape.device, non_blocking=True) for g in got]
            tier.stats.add("hits")
            tier.stats.restored(sum(g.numel() * g.element_size() for g in got), self._monotonic() - start)
            parts.extend(got)
        if not parts:
            return None
        return first + len(parts) * bs, torch.cat(parts, dim=3)

    # -- upkeep --------------------------------------------------------------------
    def sweep(self) -> None:
        for tier in self.tiers:
            sweep = getattr(tier, "sweep", None)
            if sweep is not None:
                sweep()

    def purge(self, tenant: str | None = None, timeout: float = 30.0) -> int:
        """Delete ``tenant``'s blocks (None: every tenant's) from every tier, so a flushed prefix does not come
        back from below: writes of them still queued are dropped, the one being written is waited for
        (at most ``timeout`` seconds), then each tier deletes them. Returns the blocks deleted. A tier
        that cannot be reached raises ``TierPurgeError`` after the others were purged."""
        with self._cv:
            kept: deque[tuple[EvictedSnapshot, float | None]] = deque()
            for snap, expires in self._queue:
                if tenant is None or snap.tenant == tenant:
                    self._pending -= snap.kv.numel() * snap.kv.element_size()
                else:
                    kept.append((snap, expires))
            self._queue = kept
            self._cv.notify_all()
        self.flush_writes(timeout)
        tag = None if tenant is None else self.keys.tenant_tag(tenant)
        deleted, failed = 0, []
        for tier in self.tiers:
            try:
                deleted += tier.purge(tag)
            except Exception as exc:  # noqa: BLE001 - purge the other tiers all the same
                log.warning("tier %s: purge failed: %s", tier.name, exc)
                failed.append(tier.name)
        if failed:
            raise TierPurgeError(f"the {', '.join(failed)} tier(s) could not be purged; their blocks remain "
                                 "until their TTL or LRU drops them, or a later purge")
        return deleted

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier: gauges (bytes, budget, entries, degraded; ``queued_bytes``, the writer's backlog, which every
        tier shares) and counters (``TierStats``). Never raises."""
        with self._cv:
            queued = self._pending
        out = {}
        for tier in self.tiers:
            try:
                figures = tier.figures()
            except Exception as exc:  # noqa: BLE001 - a scrape must not fail on a tier: report it degraded
                log.warning("tier %s: figures failed: %s", tier.name, exc)
                figures = {"bytes": 0, "budget_bytes": 0, "entries": 0, "degraded": 1}
            out[tier.name] = {**figures, "queued_bytes": queued, **tier.stats.snapshot()}
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        for tier in self.tiers:
            tier.close()
