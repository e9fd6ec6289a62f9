"""How far attention is from exact, for cascade and plain attention on the same inputs (pure torch).

In float32 cascade and plain attention agree to ~1e-6, so comparing whole forwards tells a
wrong mask or position from rounding. In bfloat16 and float16 every kernel rounds, and over
many layers rounding alone moves logits by several units, differently on every path: a
cascade forward and a plain one then differ by about as much as a logic error would move
them. So reduced precision is judged one layer at a time, on the inputs the layer really
got: a reference computed in float64 from those inputs upcast, plain attention in the
model's dtype (what SDPA computes there), and the cascade output (``AttentionError``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Cascade attention may be off float64 by this many rounding units (``AttentionError.units``).
#: Chosen by measurement (benchmarks/cascade_gap.py, docs/correctness.md): healthy cascades sit at
#: least 10x below it in every dtype and kernel level measured; broken ones, on the self-check's
#: tiny contexts in float32 (the model's dtype or the float32 machinery check), at least 10x above.
ROUNDING_FACTOR = 64.0


@dataclass(frozen=True, slots=True)
class AttentionError:
    """One layer's attention against float64 on the same inputs (max abs over rows, heads, dims)."""

    cascade: float  # cascade output's error
    plain: float  # plain attention's error in the same dtype
    scale: float  # largest |reference output|

    def unit(self, dtype: torch.dtype) -> float:
        """One rounding unit: plain attention's own error, or one rounding (eps) of the largest output if
        that is more. Plain's error carries what the kernels add (long contexts, peaked scores, a
        device's approximate exp), the eps floor keeps a lucky plain from making the unit tiny."""
        return max(self.plain, torch.finfo(dtype).eps * self.scale)

    def units(self, dtype: torch.dtype) -> float:
        """The statistic ``check_cascade`` judges: the cascade's error in rounding units (NaN stays NaN)."""
        unit = self.unit(dtype)
        return self.cascade / unit if unit > 0 else (0.0 if self.cascade == 0 else math.inf)

    def bound(self, dtype: torch.dtype) -> float:
        """Most ``cascade`` may be for rounding alone: ``ROUNDING_FACTOR`` rounding units."""
        return ROUNDING_FACTOR * self.unit(dtype)

    def describe(self, dtype: torch.dtype) -> str:
        """For a refusal: the statistic against its threshold, and what its unit is made of."""
        eps = torch.finfo(dtype).eps
        return (f"{self.units(dtype):.3g} rounding units from float64, more than rounding allows "
                f"({ROUNDING_FACTOR:g}): max error {self.cascade:.3g}; unit {self.unit(dtype):.3g}, the larger of "
                f"plain {dtype} attention's error ({self.plain:.3g}) and eps x largest output "
                f"({eps:.3g} x {self.scale:.3g})")

    def within(self, dtype: torch.dtype) -> bool:
        # False on NaN anywhere: a NaN unit would otherwise hide behind max()
        return not any(map(math.isnan, (self.cascade, self.plain, self.scale))) and self.units(dtype) <= ROUNDING_FACTOR


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention (the last ``r`` keys are the ``r`` query rows' own), as transformers' SDPA path.

    q: [Hq, r, D]; keys/values: [Hkv, n, D], KV heads repeated for GQA; computed in ``dtype``
    (default q's) from inputs cast to it. Returns [Hq, r, D] in that dtype.
    """
    dtype = q.dtype if dtype is None else dtype
    g = q.shape[0] // keys.shape[0]
    k, v = keys.repeat_interleave(g, dim=0).to(dtype), values.repeat_interleave(g, dim=0).to(dtype)
    r, n = q.shape[1], k.shape[1]
    rows, cols = torch.arange(r, device=q.device).unsqueeze(1), torch.arange(n, device=q.device).unsqueeze(0)
    allowed = cols <= n - r + rows  # [r, n], bottom-right aligned
    return F.scaled_dot_product_attention(q.to(dtype), k, v, attn_mask=allowed, scale=scale)


def attention_error(q: torch.Tensor, out: torch.Tensor,
                    requests: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]], scale: float) -> AttentionError:
    """Errors of a packed cascade output and of plain attention, both in q's dtype, against float64.

    q, out: [Hq, T, D] packed rows; ``requests``: (start, end, keys [Hkv, n, D], values) of
    each request, whose last ``end - start`` keys are its rows' own.
    """
    cascade, plain, top = [], [], []
    for start, end, keys, values in requests:
        rows = q[:, start:end]
        exact = reference_attention(rows, keys, values, scale, torch.float64)
        same = reference_attention(rows, keys, values, scale)
        cascade.append((out[:, start:end].double() - exact).abs().max())
        plain.append((same.double() - exact).abs().max())
        top.append(exact.abs().max())
    # torch's max keeps a NaN (Python's max may drop it), so a NaN output fails ``within``.
    return AttentionError(*(float(torch.stack(v).max()) for v in (cascade, plain, top)))
