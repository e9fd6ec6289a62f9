"""Runs: snapshots stored by one insert are views of one tensor; adjacent views read as one."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def coalesce(segments: Sequence[tuple[torch.Tensor, int]]) -> list[tuple[torch.Tensor, int]]:
    """Merge consecutive ``(snapshot, tokens used)`` segments that are adjacent views of one run.

    The result reads the same tokens in the same order with fewer, longer views (no copy).
    """
    out: list[tuple[torch.Tensor, int]] = []
    for snap, used in segments:
        if out:
            prev, prev_used = out[-1]
            if prev_used == prev.shape[3] and follows(prev, snap):
                merged = prev.as_strided((*prev.shape[:3], prev_used + used, prev.shape[4]), prev.stride(),
                                         prev.storage_offset())
                out[-1] = (merged, prev_used + used)
                continue
        out.append((snap, used))
    return out


def follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` ([L, 2, H, n, D]) starts in memory right where ``a`` ends, as views of one tensor."""
    return (storage_key(a) == storage_key(b) and a.stride() == b.stride()
            and b.storage_offset() == a.storage_offset() + a.shape[3] * a.stride(3))
