"""Local-disk tier: one file per block under a directory, indexed in memory.

The directory is claimed first (``files.claim``: owner-only, a marker, an exclusive lock),
and nothing in it is deleted before that. Blocks live under ``blocks/<tenant tag>/``, so a
tenant's blocks can be purged after a restart too; each is written (mode 0600) to a
temporary file and renamed into place, so a partial write is never readable under a
block's name. At start-up the index is rebuilt from the files' fixed-size prefixes (expiry
and length, no header or KV read), least recently used first by modification time; a
restore checks the file's size before reading it, then reads and verifies it whole
(``BlockCodec.decode``). TTLs travel with the blocks: an expired block is a miss at read time
and is deleted by the sweep (``figures``/``sweep``). A full disk (``ENOSPC``/``EDQUOT``)
stops writes for a while; reads go on.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import shutil
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prefixcache.cache.tiers import files
from prefixcache.cache.tiers.base import BlockIndex, IndexedTier, TierStats, TierUnavailable
from prefixcache.cache.tiers.codec import KEY_BYTES, PREFIX, BlockCodec, BlockMeta, CorruptBlock, read_prefix

log = logging.getLogger(__name__)

SUFFIX = ".kv"
#: Seconds writes stay off after the disk reported itself full.
FULL_BACKOFF_SECONDS = 30.0
#: The directory of blocks written without a tenant tag.
NO_TENANT = "_"


@dataclass(frozen=True, slots=True)
class _Entry:
    path: Path
    nbytes: int
    expires_at: float | None
    tenant: str = ""


class DiskTier(IndexedTier):
    name = "disk"

    def __init__(self, directory: str | os.PathLike, max_bytes: int, clock: Callable[[], float],
                 monotonic: Callable[[], float] = time.monotonic):
        self.root = Path(directory)
        self.stats = TierStats()
        self._clock, self._monotonic = clock, monotonic
        self._lock = threading.RLock()  # a purge holds it across the base class's own use of it
        self._full_until = 0.0
        self._blocks = self.root / "blocks"
        self._tmp = self.root / "tmp"
        self._lock_fd: int | None = files.claim(self.root)  # before anything in the directory is touched
        try:
            for d in (self._blocks, self._tmp):
                files.private_dir(d)
            for leftover in self._tmp.iterdir():  # writes a crash interrupted: never renamed, never readable
                leftover.unlink(missing_ok=True)
            self._index = BlockIndex(max_bytes, clock, self._drop)
            self.rebuilt_entries = self._rebuild()
        except BaseException:
            self.close()
            raise

    def own_secret(self) -> bytes:
        """The directory's own random secret (used when no hash secret is configured)."""
        return files.own_secret(self.root)

    # -- start-up ------------------------------------------------------------------
    def _rebuild(self) -> int:
        """Index every block file by its prefix, oldest modification first (so LRU order survives)."""
        found = []
        for path in self._blocks.glob(f"*/*/*{SUFFIX}"):
            try:
                st = path.lstat()
                if not stat.S_ISREG(st.st_mode):
                    raise CorruptBlock("not a regular file")
                with path.open("rb") as f:
                    prefix = read_prefix(f.read(PREFIX.size))
                if prefix.total_bytes != st.st_size:
                    raise CorruptBlock("size does not match its prefix")
                key = bytes.fromhex(path.stem)
                if len(key) != KEY_BYTES:
                    raise CorruptBlock("not a block key")
                found.append((st.st_mtime, key, _Entry(path, st.st_size, prefix.expires_at, path.parent.parent.name)))
            except (OSError, ValueError) as exc:  # CorruptBlock is a ValueError
                log.warning("disk tier: unreadable block file %s deleted (%s)", path, exc)
                self.stats.add("corrupt_entries")
                path.unlink(missing_ok=True)
        found.sort(key=lambda f: f[0])
        with self._lock:
            for _, key, entry in found:
                self._set(key, entry)
        return len(found)

    # -- tier interface ------------------------------------------------------------
    def put(self, meta: BlockMeta, kv: torch.Tensor, encoded: Callable[[], bytes]) -> bool:
        if self._monotonic() < self._full_until:  # counted as a failed write, as any tier backing off
            raise TierUnavailable("disk tier: the disk is full, writes back off")
        if meta.expires_at is not None and meta.expires_at <= self._clock():
            return False
        blob = encoded()
        if len(blob) > self._index.maxsize:
            return False
        path = self._path(meta.key, meta.tenant)
        tmp = self._tmp / f"{secrets.token_hex(8)}.part"
        try:
            files.private_dir(path.parent.parent)
            files.private_dir(path.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            with self._lock:  # the index and the name change together
                self._index.expire()  # an expired copy of this block goes (its file unlinked) before, not after
                self._index.pop(meta.key, None)  # a live copy's file is replaced below: no drop, no unlink
                os.replace(tmp, path)  # atomic: readers see the old file, no file, or the whole new one
                self._set(meta.key, _Entry(path, len(blob), meta.expires_at, path.parent.parent.name))
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._full_until = self._monotonic() + FULL_BACKOFF_SECONDS
                log.warning("disk tier: the disk is full; writes stop for %.0f s (reads go on)", FULL_BACKOFF_SECONDS)
            raise
        return True

    def _load(self, meta: BlockMeta, entry: _Entry, codec: BlockCodec) -> torch.Tensor | None:
        try:
            kv = codec.decode(_read(entry.path, codec.max_bytes), meta)
        except FileNotFoundError:  # deleted meanwhile (evicted by another thread)
            self._forget(meta.key, entry)
            return None
        except (OSError, CorruptBlock) as exc:
            log.warning("disk tier: block %s refused (%s); deleted, recomputing", meta.key.hex()[:12], exc)
            self.stats.add("corrupt_entries")
            self._forget(meta.key, entry)
            entry.path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(entry.path)  # recency survives a restart
        return kv

    def purge(self, tenant: str | None) -> int:
        if tenant is not None and (not tenant or tenant.strip("0123456789abcdef") not in ("", NO_TENANT)):
            raise ValueError("purge takes a tenant tag (BlockKeys.tenant_tag), never a path")
        with self._lock:  # no write renames a file in, or indexes one, while the directories go
            n = super().purge(tenant)
            # Files no index entry names (a write racing the purge) go too, with their directories.
            targets = [self._blocks / tenant] if tenant is not None else list(self._blocks.iterdir())
            for target in targets:
                shutil.rmtree(target, ignore_errors=True)
        return n

    def _purged(self, key: bytes, entry: _Entry) -> None:
        entry.path.unlink(missing_ok=True)

    def sweep(self) -> None:
        with self._lock:
            self._index.expire()

    def figures(self) -> dict[str, Any]:
        self.sweep()
        with self._lock:
            return {"bytes": int(self._index.currsize), "budget_bytes": int(self._index.maxsize),
                    "entries": len(self._index), "degraded": int(self._monotonic() < self._full_until)}

    def close(self) -> None:
        """Release the directory (every file is complete or absent; the index is rebuilt at the next start)."""
        fd, self._lock_fd = self._lock_fd, None
        files.release(fd)

    # -- internals -----------------------------------------------------------------
    def _path(self, key: bytes, tenant: str) -> Path:
        name = key.hex()
        return self._blocks / (tenant or NO_TENANT) / name[:2] / f"{name}{SUFFIX}"

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


def _read(path: Path, limit: int) -> bytearray:
    """The file's bytes; ``CorruptBlock`` without reading them when it is larger than ``limit`` or not a file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)  # the size of what is open, not of a name that may change meanwhile
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise CorruptBlock(f"{st.st_size} bytes: larger than a block can be; refused unread")
        blob = bytearray(st.st_size)
        with os.fdopen(fd, "rb", closefd=False) as f:
            if f.readinto(blob) != st.st_size:
                raise CorruptBlock("file shorter than its size")
        return blob
    finally:
        os.close(fd)
