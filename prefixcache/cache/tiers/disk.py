"""Local-disk tier: one file per block under a directory, indexed in memory.

A block is written to a temporary file and renamed into place, so a partial write is
never readable under a block's name. At start-up the index is rebuilt from the files'
headers (a few hundred bytes each, no KV read), least recently used first by
modification time; a restore re-reads the whole file and verifies it (``codec.decode``).
TTLs travel in the header: an expired block is a miss at read time and is deleted by the
sweep (``figures``/``sweep``). A full disk (``ENOSPC``/``EDQUOT``) stops writes for a
while; reads go on.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixcache.cache.tiers.base import BlockIndex, IndexedTier, TierStats
from prefixcache.cache.tiers.codec import MAGIC, BlockMeta, CorruptBlock, decode, expires_at

log = logging.getLogger(__name__)

SUFFIX = ".kv"
#: Seconds writes stay off after the disk reported itself full.
FULL_BACKOFF_SECONDS = 30.0
_HEAD = len(MAGIC) + 4


@dataclass(frozen=True, slots=True)
class _Entry:
    path: Path
    nbytes: int
    expires_at: float | None


class DiskTier(IndexedTier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, max_bytes: int, clock: Callable[[], float],
                 monotonic: Callable[[], float] = time.monotonic):
        self.root = Path(directory)
        self.stats = TierStats()
        self._clock, self._monotonic = clock, monotonic
        self._lock = threading.Lock()
        self._full_until = 0.0
        self._blocks = self.root / "blocks"
        self._tmp = self.root / "tmp"
        for d in (self._blocks, self._tmp):
            d.mkdir(parents=True, exist_ok=True)
        for leftover in self._tmp.iterdir():  # writes a crash interrupted: never renamed, never readable
            leftover.unlink(missing_ok=True)
        self._index = BlockIndex(max_bytes, clock, self._drop)
        self.rebuilt_entries = self._rebuild()

    # -- start-up ------------------------------------------------------------------
    def _rebuild(self) -> int:
        """Index every block file by its header, oldest modification first (so LRU order survives)."""
        found = []
        for path in self._blocks.glob(f"*/*{SUFFIX}"):
            try:
                stat = path.stat()
                with path.open("rb") as f:
                    head = f.read(_HEAD)
                    if len(head) != _HEAD or head[: len(MAGIC)] != MAGIC:
                        raise CorruptBlock("bad magic")
                    (size,) = struct.unpack_from("<I", head, len(MAGIC))
                    header = _json(f.read(size))
                key = bytes.fromhex(path.stem)
                found.append((stat.st_mtime, key, _Entry(path, stat.st_size, expires_at(header))))
            except (OSError, ValueError, CorruptBlock):
                log.warning("disk tier: unreadable block file %s deleted", path)
                self.stats.add("corrupt_entries")
                path.unlink(missing_ok=True)
        found.sort(key=lambda f: f[0])
        with self._lock:
            for _, key, entry in found:
                self._set(key, entry)
        return len(found)

    # -- tier interface ------------------------------------------------------------
    def put(self, meta: BlockMeta, kv: torch.Tensor, encoded: Callable[[], bytes]) -> bool:
        if self._monotonic() < self._full_until:
            return False
        if meta.expires_at is not None and meta.expires_at <= self._clock():
            return False
        blob = encoded()
        if len(blob) > self._index.maxsize:
            return False
        path = self._path(meta.key)
        tmp = self._tmp / f"{secrets.token_hex(8)}.part"
        try:
            path.parent.mkdir(exist_ok=True)
            with tmp.open("wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: readers see the old file, no file, or the whole new one
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._full_until = self._monotonic() + FULL_BACKOFF_SECONDS
                log.warning("disk tier: the disk is full; writes stop for %.0f s (reads go on)", FULL_BACKOFF_SECONDS)
            raise
        with self._lock:
            self._set(meta.key, _Entry(path, len(blob), meta.expires_at))
        return True

    def _load(self, meta: BlockMeta, entry: _Entry, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        try:
            with entry.path.open("rb") as f:
                blob = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(blob)
            kv = decode(blob, meta, dtype, shape)
        except FileNotFoundError:  # deleted meanwhile (evicted by another thread)
            self._forget(meta.key, entry)
            return None
        except (OSError, CorruptBlock) as exc:
            log.warning("disk tier: block %s refused (%s); deleted, recomputing", meta.key.hex()[:12], exc)
            self.stats.add("corrupt_entries")
            self._forget(meta.key, entry)
            entry.path.unlink(missing_ok=True)
            return None
        os.utime(entry.path)  # recency survives a restart
        return kv

    def sweep(self) -> None:
        with self._lock:
            self._index.expire()

    def figures(self) -> dict[str, Any]:
        self.sweep()
        with self._lock:
            return {"bytes": int(self._index.currsize), "budget_bytes": int(self._index.maxsize),
                    "entries": len(self._index), "degraded": int(self._monotonic() < self._full_until)}

    def close(self) -> None:
        pass  # every file is complete or absent; the index is rebuilt at the next start

    # -- internals -----------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self._blocks / name[:2] / f"{name}{SUFFIX}"

    def _set(self, key: bytes, entry: _Entry) -> None:
        """Index ``entry`` (the LRU may drop others, or this one if it cannot fit; its file goes then too)."""
        try:
            self._index[key] = entry
        except ValueError:  # larger than the whole budget
            entry.path.unlink(missing_ok=True)
        if key not in self._index:
            entry.path.unlink(missing_ok=True)

    @staticmethod
    def _drop(key: bytes, entry: _Entry) -> None:
        entry.path.unlink(missing_ok=True)


def _json(raw: bytes) -> dict:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise CorruptBlock(f"unreadable header: {exc}") from None
