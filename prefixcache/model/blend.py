"""Reusing a chunk's KV away from where it was computed (CacheBlend): re-rotation and token selection.

Pure torch. A chunk's KV is computed alone at positions ``0..m-1``. Rotary position
embeddings rotate each key by an angle proportional to its position, and a rotation by
``a`` then by ``b`` is one by ``a + b``, so the chunk's keys at positions ``s..s+m-1`` are
its stored keys rotated once more by ``s``; values carry no position. Exact (to float
rounding) for rotary models whose cos/sin carry no extra scale; ``hf_cache.check_rerotation``
measures it per model before any chunk is moved.

What re-rotation cannot restore is attention *across* chunks: a chunk computed alone
never saw the tokens placed before it. ``select_recompute`` picks the tokens whose KV on an
early layer deviates most from a full prefill's; those are recomputed in context.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

#: ``(cos, sin)`` of a rotation by ``delta`` positions: float32 ``[D]`` each, in the model's convention.
ShiftTable = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary pairing of (first half, second half) of the head dimension: ``[-x2, x1]``."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate(kv: torch.Tensor, delta: int, shift: ShiftTable, out: torch.Tensor | None = None) -> torch.Tensor:
    """``kv``: ``[L, 2, H, m, D]`` computed at positions p; returns (or writes into ``out``) the same KV at p + delta.

    Keys are rotated by ``delta`` positions in float32, values copied. ``out`` may be a view
    of a larger buffer (``[L, 2, H, m, D]``); ``kv`` is never written.
    """
    if out is None:
        out = torch.empty_like(kv)
    out[:, 1].copy_(kv[:, 1])
    if delta == 0:
        out[:, 0].copy_(kv[:, 0])
        return out
    cos, sin = shift(delta)  # [D]
    keys = kv[:, 0].float()  # [L, H, m, D]
    out[:, 0].copy_(keys * cos + rotate_half(keys) * sin)
    return out


def kv_deviation(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Per token, squared distance between two KV sets of one layer: ``old``/``new`` ``[2, H, T, D]`` → ``[T]`` float32."""
    return (new.float() - old.float()).square().sum(dim=(0, 1, 3))


def recompute_count(reused: int, share: float) -> int:
    """How many of ``reused`` tokens a recompute ``share`` (0..1) recomputes (rounded up: a share > 0 recomputes one at least)."""
    return min(reused, math.ceil(reused * share - 1e-9)) if share > 0 else 0


def select_recompute(deviation: torch.Tensor, positions: torch.Tensor, share: float) -> torch.Tensor:
    """The positions to recompute: the ``share`` of ``positions`` (long ``[T]``) with the largest ``deviation`` ``[T]``.

    Returned sorted (long ``[k]``). Ties go to the earlier position (a stable sort).
    """
    k = recompute_count(int(positions.numel()), share)
    if k == 0:
        return positions[:0]
    order = torch.sort(deviation, descending=True, stable=True).indices[:k]
    return torch.sort(positions[order]).values
