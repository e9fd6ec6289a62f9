"""A min-heap of items keyed by a number, with O(log n) re-keying and O(1) removal.

The store keeps its evictable leaves (keyed by last access) and its expiry candidates
(keyed by deadline) in these, so making room costs O(log n) per block instead of a scan
of every node. Stale heap entries are skipped lazily; the heap is rebuilt when they
outnumber the live ones, so its size stays within a constant of the live count.
"""
from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from heapq import heappush
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class KeyedHeap(Generic[T]):
    """Items with a key; ``peek``/``pop`` give the smallest key, ties in insertion order."""

    def __init__(self) -> None:
        self._live: dict[T, tuple[float, int]] = {}  # item -> (key, sequence of its heap entry)
        self._heap: list[tuple[float, int, T]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: object) -> bool:
        return item in self._live

    def key(self, item: T) -> float | None:
        entry = self._live.get(item)
        return None if entry is None else entry[0]

    def items(self) -> Iterator[tuple[T, float]]:
        for item, (key, _) in self._live.items():
            yield item, key

    def set(self, item: T, key: float) -> None:
        """Insert ``item`` or change its key (a no-op when the key is unchanged)."""
        live = self._live
        entry = live.get(item)
        if entry is not None and entry[0] == key:
            return
        seq = self._seq = self._seq + 1
        live[item] = (key, seq)
        heap = self._heap
        heappush(heap, (key, seq, item))
        # Stale entries pile up when keys change; rebuilding at 2x keeps pushes O(log n) amortised.
        if len(heap) > 2 * len(live) + 32:
            self._heap = [(k, s, i) for i, (k, s) in self._live.items()]
            heapq.heapify(self._heap)

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def peek(self) -> tuple[T, float] | None:
        """The item with the smallest key, or None when empty."""
        heap = self._heap
        while heap:
            key, seq, item = heap[0]
            if self._live.get(item, (None, -1))[1] == seq:
                return item, key
            heapq.heappop(heap)  # stale: removed or re-keyed since
        return None

    def pop(self) -> tuple[T, float] | None:
        top = self.peek()
        if top is not None:
            heapq.heappop(self._heap)
            del self._live[top[0]]
        return top
