"""Cascade attention on CUDA through fused kernels that return the log-sum-exp.

Each part of a cascade (a shared run, a request's private keys, the pooled decodes) is one
call of torch's flash kernel (bfloat16/float16, head dim a multiple of 8 up to 256) or of its
memory-efficient kernel (float32, other head dims, and any call that needs a mask), in the
model's dtype: no ``heads × rows × keys`` score matrix is ever materialised. The kernels
accumulate in float32 and return the log-sum-exp in float32; their outputs are widened to
float32 for the merges, so a cascade rounds once more than one plain call at most.

A private prefill chunk whose request holds earlier tokens is attended as two parts merged
like any other: the held tokens in full, and the chunk's own keys causally (a square, where
the kernels' top-left causal alignment is the bottom-right one the cascade needs). Chunks of
equal length over equal key counts (a burst of questions) are stacked into one call.
"""
from __future__ import annotations

import torch

from prefixcache.model.cascade import accumulation_dtype, merge_two

_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_EFFICIENT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BIAS_ALIGN = 16  # the memory-efficient kernel reads its bias in rows aligned to this many elements


def fused_kernels(dtype: torch.dtype, head_dim: int) -> FusedKernels | None:
    """Fused kernels for queries of ``dtype`` and ``head_dim`` on CUDA, or None where none serves."""
    if dtype not in _EFFICIENT_DTYPES:
        return None
    return FusedKernels(flash=dtype in _FLASH_DTYPES and head_dim % 8 == 0 and head_dim <= 256)


class FusedKernels:
    """``cascade.AttentionKernels`` on CUDA (see the module docstring)."""

    batch_own = True  # a burst of equal-length prompt chunks is one call per layer, not one per request

    def __init__(self, flash: bool, flash_op=None, efficient_op=None):
        """``flash``: use the flash kernel where no mask is needed; it reads a GQA group's KV head for all
        the group's query heads. The ops default to torch's (``aten._scaled_dot_product_flash_attention``
        and ``_efficient_attention``); tests on a machine without CUDA pass stand-ins with the same contract."""
        self.flash = flash
        self.native_gqa = flash  # cleared if the flash op refuses fewer KV heads than query heads
        self._flash_op = flash_op or torch.ops.aten._scaled_dot_product_flash_attention
        self._efficient_op = efficient_op or torch.ops.aten._scaled_dot_product_efficient_attention

    def prepare(self, qg: torch.Tensor) -> torch.Tensor:
        return qg  # the kernels take the model's dtype

    def full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        hkv, g, r, dim = q.shape  # k/v [Hkv, n, D]
        if g > 1 and self.native_gqa:
            got = self._grouped(q.reshape(1, hkv * g, r, dim), k.unsqueeze(0), v.unsqueeze(0), scale, False)
            if got is not None:
                return got[0].view(hkv, g, r, dim), got[1].view(hkv, g, r)
        # A group's query heads as one run of rows against their KV head: no causal mask, no repeated keys.
        o, lse = self._call(q.reshape(1, hkv, g * r, dim), k.unsqueeze(0), v.unsqueeze(0), scale, False)
        return o.view(hkv, g, r, dim), lse.view(hkv, g, r)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               masks: dict[tuple, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        b, hkv, g, r, dim = q.shape  # k/v [B, Hkv, n, D]
        n = k.shape[2]
        heads = q.reshape(b, hkv * g, r, dim)  # query head h·g + j, as the kernels map GQA heads
        o, lse = self._heads(heads, k[:, :, n - r:], v[:, :, n - r:], scale, causal=r > 1)
        if n > r:  # tokens held from earlier steps: every row sees them all
            held_o, held_lse = self._heads(heads, k[:, :, : n - r], v[:, :, : n - r], scale, causal=False)
            o, lse = merge_two(held_o, held_lse, o, lse), torch.logaddexp(held_lse, lse)
        return o.view(b, hkv, g, r, dim), lse.view(b, hkv, g, r)

    def alone(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        hkv, g, r, dim = q.shape  # k/v [Hkv, n, D]
        if k.shape[1] != r:
            return None  # tokens held from earlier steps: two parts to merge
        heads = q.reshape(1, hkv * g, r, dim)
        out, _ = self._heads(heads, k.unsqueeze(0), v.unsqueeze(0), scale, causal=r > 1, widen=False)
        return out.view(hkv, g, r, dim)

    def masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
               masks: dict[tuple, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        # q [S, H, g, D], k/v [S, H, C, D], mask [S, 1, 1, C]: one bias per step, shared by the layers
        key = ("bias", mask.data_ptr(), q.dtype)
        bias = masks.get(key)
        if bias is None:
            slots, _, _, width = mask.shape
            padded = mask.new_zeros((slots, 1, 1, -(-width // _BIAS_ALIGN) * _BIAS_ALIGN), dtype=q.dtype)
            padded[..., :width] = mask
            bias = masks[key] = padded[..., :width]
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        return self._efficient(q, k, v, scale, bias, causal=False)

    def _heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               causal: bool, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, r, D] against k/v [B, Hkv, n, D]: the kernel's own GQA, else KV heads repeated."""
        g = q.shape[1] // k.shape[1]
        if g > 1 and self.native_gqa:
            got = self._grouped(q, k, v, scale, causal, widen)
            if got is not None:
                return got
        if g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return self._call(q, k, v, scale, causal, widen)

    def _grouped(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 causal: bool, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The flash kernel with fewer KV heads than query heads, or None (and not again) if it refuses."""
        try:
            return self._call(q, k, v, scale, causal, widen)
        except RuntimeError:
            self.native_gqa = False
            return None

    def _call(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              causal: bool, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flash:
            out = self._flash_op(q, k, v, 0.0, causal, False, scale=scale)
            return _widen(out[0], out[1], q.shape[2], widen)
        return self._efficient(q, k, v, scale, None, causal, widen)

    def _efficient(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, bias: torch.Tensor | None,
                   causal: bool, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._efficient_op(q, k, v, bias, True, 0.0, causal, scale=scale)
        return _widen(out[0], out[1], q.shape[2], widen)


def _widen(out: torch.Tensor, lse: torch.Tensor, rows: int, widen: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and log-sum-exp in the accumulation dtype (``widen``; else as the kernel
    returned them); the memory-efficient kernel pads the log-sum-exp's rows to a multiple of 32."""
    if not widen:
        return out, lse[..., :rows]
    wide = accumulation_dtype(out.dtype)
    return out.to(wide), lse[..., :rows].to(wide)
