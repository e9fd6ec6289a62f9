"""One total for all KV memory: stored snapshots plus the buffers requests compute into.

The store holds snapshots (within its own budget, ``max_bytes``). Outside it, running
requests hold KV buffers: the batching engine's private pools, the serial engine's working
caches and prewarm buffers. Each kind reserves here, before allocating, the most its buffers
may grow to, and gives it back when they are freed (or hands it over to the stored bytes as the
store takes in the KV computed there just before the buffer is freed: ``Reservation.hand_over``),
so ``store bytes + reserved <= total``: the store keeps that bound when it inserts (its room
shrinks by what is reserved), and a reservation that does not fit first makes the store evict
what may go (unpinned snapshots nobody reads), then waits, at most ``wait_seconds``, for others
to give memory back, then is refused with ``KVMemoryError``. No torch here: bytes only.

Locks: the store's lock, then the ledger's, never the other way round. Each side checks
``stored + reserved`` and acts under the ledger's lock: a reservation in ``_change``, the
store when it adds a block (``KVStore._grow``, holding its own lock already). The store's
bytes grow nowhere else, so the ledger reads them without the store's lock (they may only
shrink meanwhile), and it lets go of its own lock before it asks the store to ``reclaim``.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from prefixcache.errors import KVMemoryError, RequestCancelledError

#: What holds KV outside the store: the batching engine's private pools, the serial engine's
#: working caches, prewarm buffers.
KINDS = ("private", "serial", "prewarm")


class Reclaimable(Protocol):
    bytes: int

    def reclaim(self, limit: int) -> bool:
        """Evict what may go until at most ``limit`` bytes are stored; whether that was reached."""


class KVLedger:
    def __init__(self, total_bytes: int, wait_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.total = total_bytes
        self.wait_seconds = wait_seconds
        self._clock = clock
        self._held = dict.fromkeys(KINDS, 0)
        #: Sum of every kind's reservation. Read without the lock it is a plan only (it may have grown
        #: since); what it admits is checked again under ``lock``.
        self.reserved = 0
        self._cv = threading.Condition()
        self._store: Reclaimable | None = None

    def attach(self, store: Reclaimable) -> None:
        """The store whose snapshots count against the total and give way to reservations."""
        self._store = store

    @property
    def lock(self) -> threading.Condition:
        """Held while ``stored + reserved`` is checked and grown (after the store's lock, never before it)."""
        return self._cv

    def fits_stored(self, nbytes: int) -> bool:
        """Whether the store may add ``nbytes`` within the total beside what is reserved; the caller holds
        ``lock`` until it has added them."""
        return self.stored + self.reserved + nbytes <= self.total

    @property
    def stored(self) -> int:
        return 0 if self._store is None else self._store.bytes

    def held(self) -> dict[str, int]:
        """Bytes per kind: ``stored`` (snapshots) and each kind's reservation."""
        with self._cv:
            return {"stored": self.stored, **self._held}

    def try_set(self, kind: str, nbytes: int) -> bool:
        """Make ``kind``'s reservation ``nbytes`` if it fits (evicting snapshots that may go); shrinking always does."""
        return self._change(kind, lambda _held: nbytes)

    def force(self, kind: str, nbytes: int) -> None:
        """Record ``kind``'s reservation as ``nbytes`` whether or not it fits (what is already allocated)."""
        with self._cv:
            self._put(kind, nbytes)

    def reserve(self, kind: str, nbytes: int, cancel: threading.Event | None = None) -> Reservation:
        """Reserve ``nbytes`` more for ``kind``, waiting at most ``wait_seconds`` for room.

        Raises ``KVMemoryError`` (at once if ``nbytes`` exceeds the total) or
        ``RequestCancelledError`` if ``cancel`` is set while waiting.
        """
        if nbytes > self.total:
            raise KVMemoryError(f"this request needs {nbytes} bytes of KV, more than the total of {self.total} "
                                "bytes all KV memory may use")
        deadline = self._clock() + self.wait_seconds
        while True:
            if nbytes == 0 or self._change(kind, lambda held: held + nbytes):
                return Reservation(self, kind, nbytes)
            if cancel is not None and cancel.is_set():
                raise RequestCancelledError("cancelled while waiting for KV memory")
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise KVMemoryError(f"no room for {nbytes} bytes of KV within {self.wait_seconds:g} s: the total is "
                                    f"{self.total} bytes and running requests and pinned prefixes hold it; retry")
            with self._cv:
                self._cv.wait(min(remaining, 0.05))

    def release(self, kind: str, nbytes: int) -> None:
        with self._cv:
            self._put(kind, self._held[kind] - nbytes)

    # -- internals -----------------------------------------------------------------
    def _change(self, kind: str, target: Callable[[int], int]) -> bool:
        """Set ``kind``'s reservation to ``target(current)`` if it fits, after one reclaim if needed."""
        for attempt in (0, 1):
            with self._cv:
                want = target(self._held[kind])
                if self._fits(kind, want):
                    self._put(kind, want)
                    return True
                limit = self.total - (self.reserved - self._held[kind]) - want
            if attempt or self._store is None or limit < 0 or not self._store.reclaim(limit):
                return False
        return False

    def _fits(self, kind: str, nbytes: int) -> bool:
        if nbytes <= self._held[kind]:
            return True
        return self.stored + self.reserved - self._held[kind] + nbytes <= self.total

    def _put(self, kind: str, nbytes: int) -> None:
        assert nbytes >= 0, f"negative {kind} reservation"
        shrunk = nbytes < self._held[kind]
        self.reserved += nbytes - self._held[kind]
        self._held[kind] = nbytes
        if shrunk:
            self._cv.notify_all()


class Reservation:
    """Bytes reserved for one buffer; ``release()`` (or leaving the ``with`` block) gives them back once."""

    def __init__(self, ledger: KVLedger, kind: str, nbytes: int):
        self._ledger, self.kind, self.nbytes = ledger, kind, nbytes

    def release(self) -> None:
        if self.nbytes:
            self._ledger.release(self.kind, self.nbytes)
            self.nbytes = 0

    def hand_over(self, nbytes: int) -> None:
        """Give back ``nbytes`` that stored snapshots now hold instead (``KVStore.insert`` with ``own``: blocks
        copied from this reservation's buffer, which is freed right after); called under the ledger's lock, as
        the store adds them, so ``stored + reserved`` never grows."""
        assert 0 <= nbytes <= self.nbytes
        self._ledger.release(self.kind, nbytes)
        self.nbytes -= nbytes

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
