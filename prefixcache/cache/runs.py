"""Runs: snapshots stored by one insert are views of one tensor; adjacent views read as one.

``TensorRuns`` is everything the store does to a snapshot's payload: slice a run into
blocks, copy, join, measure. The store holds one such object (``KVStore(kv_ops=...)``):
``prefixcache.cache.sized.SizedRuns`` does the same bookkeeping with byte sizes and no
tensors, so the trie, policy and store code can replay traffic without any KV.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: a replay on byte sizes never loads torch
    import torch


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def coalesce(segments: Sequence[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """Merge consecutive ``(snapshot, tokens used)`` segments that are adjacent views of one run.

    The result reads the same tokens in the same order with fewer, longer views (no copy).
    """
    groups: list[list[Any]] = []  # [first snapshot, tokens used, the last snapshot when used whole]
    for snap, used in segments:
        if groups and groups[-1][2] is not None and follows(groups[-1][2], snap):
            groups[-1][1] += used
        else:
            groups.append([snap, used, None])
        groups[-1][2] = snap if used == snap.shape[3] else None
    # One view per joined run (more tokens than its first snapshot), made once, not one per block joined.
    return [(first.as_strided((*first.shape[:3], used, first.shape[4]), first.stride(), first.storage_offset())
             if used > first.shape[3] else first, used) for first, used, _ in groups]


def follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` ([L, 2, H, n, D]) starts in memory right where ``a`` ends, as views of one tensor."""
    return (storage_key(a) == storage_key(b) and a.stride() == b.stride()
            and b.storage_offset() == a.storage_offset() + a.shape[3] * a.stride(3))


class RunOps(Protocol):
    """What the store does to snapshot payloads; a *run* is what a ``KVSlicer`` returns."""

    def per_token(self, run: Any) -> int:
        """Bytes of one token of ``run``."""

    def view(self, run: Any, start: int, end: int) -> Any:
        """Tokens ``[start, end)`` of ``run``, sharing its memory."""

    def copy(self, run: Any, end: int) -> Any:
        """A new run holding only tokens ``[0, end)`` of ``run``."""

    def key(self, snap: Any) -> int:
        """Identity of the run a snapshot is a view of."""

    def follows(self, a: Any, b: Any) -> bool:
        """Whether ``b`` starts right where ``a`` ends in one run."""

    def join(self, snaps: Sequence[Any]) -> Any:
        """A new run holding the tokens of adjacent views ``snaps``, in order."""

    def tokens(self, snap: Any) -> int:
        """Tokens a snapshot covers."""

    def nbytes(self, snap: Any) -> int:
        """Bytes a snapshot covers."""

    def run_nbytes(self, snap: Any) -> int:
        """Bytes of the whole run ``snap`` is a view of."""

    def own(self, snap: Any, nbytes: int) -> Any:
        """The snapshot holding only its own bytes (not a view keeping a whole run alive)."""


class TensorRuns:
    """``RunOps`` over tensors ``[L, 2, H, n, D]``: what the store does with real KV."""

    def per_token(self, run: torch.Tensor) -> int:
        return run[:, :, :, :1].numel() * run.element_size()

    def view(self, run: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return run[:, :, :, start:end]

    def copy(self, run: torch.Tensor, end: int) -> torch.Tensor:
        return run[:, :, :, :end].clone()

    def key(self, snap: torch.Tensor) -> int:
        return storage_key(snap)

    def follows(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        return follows(a, b)

    def join(self, snaps: Sequence[torch.Tensor]) -> torch.Tensor:
        head = snaps[0]
        total = sum(s.shape[3] for s in snaps)
        return head.as_strided((*head.shape[:3], total, head.shape[4]), head.stride(), head.storage_offset()).clone()

    def tokens(self, snap: torch.Tensor) -> int:
        return snap.shape[-2]

    def nbytes(self, snap: torch.Tensor) -> int:
        return snap.numel() * snap.element_size()

    def run_nbytes(self, snap: torch.Tensor) -> int:
        return snap.untyped_storage().nbytes()

    def own(self, snap: torch.Tensor, nbytes: int) -> torch.Tensor:
        return snap.clone() if snap.untyped_storage().nbytes() != nbytes else snap
