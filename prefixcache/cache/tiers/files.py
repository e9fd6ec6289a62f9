"""The disk tier's directory: owner-only, claimed by a marker, held by one process, with its secret.

A tier directory is trusted with KV (and, unencrypted, token ids), and the tier deletes
files in it: it is created (or tightened) to mode 0700, its files are 0600, and nothing in
it is deleted unless it carries ``MARKER`` (written when the tier first took an empty
directory). An exclusive ``flock`` on ``LOCK`` keeps a second process out, since each
process indexes the directory on its own. Small files that must never be seen half
written (the marker, the secret) are written to a temporary file, synced and renamed.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

from prefixcache.errors import ConfigError

MARKER = "PREFIXCACHE_TIER"
LOCK = "lock"
SECRET_FILE = "secret"
SECRET_BYTES = 32
MARKER_TEXT = b"prefixcache disk tier v2\n"


class TierDirectoryError(ConfigError):
    """The disk tier's directory cannot be used (another process holds it, it is not a tier directory, ...)."""

    def __init__(self, directory: Path, why: str):
        super().__init__("tier_disk", str(directory), why)
        self.args = (f"tier_disk {directory}: {why}",)


def private_dir(path: Path) -> None:
    """``path`` as a directory only its owner can enter (created if missing)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    os.chmod(path, 0o700)  # an existing directory is tightened too (PermissionError if not ours)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) atomically: readers see the old file, none, or all of the new one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def claim(root: Path) -> int:
    """Take ``root`` for this process: owner-only, marked, locked. Returns the lock's descriptor (close it to
    release). Raises ``TierDirectoryError`` for a directory in use or one that is not a tier's."""
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
        ours = (LOCK, f".{MARKER}.")  # the lock, and a marker a crash left half written
        if not (root / MARKER).exists() and any(not p.name.startswith(ours) for p in root.iterdir()):
            raise TierDirectoryError(root, f"it is not empty and has no {MARKER} file, so it is not a prefixcache "
                                           "tier directory; nothing in it was touched: choose an empty directory")
        private_dir(root)
    except OSError as exc:
        raise TierDirectoryError(root, f"cannot own it: {exc}") from None
    fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise TierDirectoryError(root, f"another process (pid {holder}) uses it: a disk tier serves one "
                                           "process at a time; share blocks through Redis") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        if not (root / MARKER).exists():
            write_private(root / MARKER, MARKER_TEXT)
    except BaseException:
        os.close(fd)
        raise
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the last descriptor drops the flock


def own_secret(root: Path) -> bytes:
    """The tier's own random secret in ``root/secret`` (hex, 0600), drawn and written atomically on first use.

    Call it with the directory claimed. A file of the wrong length or content raises
    ``TierDirectoryError`` naming it, rather than silently replacing the key of every stored block.
    """
    path = root / SECRET_FILE
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        value = secrets.token_bytes(SECRET_BYTES)
        write_private(path, value.hex().encode())
        return value
    try:
        value = bytes.fromhex(text.decode("ascii").strip())
    except ValueError:
        value = b""
    if len(value) != SECRET_BYTES:
        raise TierDirectoryError(root, f"{path} is not {SECRET_BYTES} bytes of hex ({len(text)} bytes found); "
                                       "restore it, or delete it to draw a new one (its blocks become unreadable)")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return value
