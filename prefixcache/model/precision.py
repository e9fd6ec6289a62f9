"""How far attention is from exact, for cascade and plain attention on the same inputs (pure torch).

In float32 cascade and plain attention agree to ~1e-6, so comparing whole forwards tells a
wrong mask or position from rounding. In bfloat16 and float16 every kernel rounds, and over
many layers rounding alone moves logits by several units, differently on every path: a
cascade forward and a plain one then differ by about as much as a logic error would move
them. So reduced precision is judged one layer at a time, on the inputs the layer really
got: a reference computed in float64 from those inputs upcast, plain attention in the
model's dtype (what SDPA computes there), and the cascade output (``AttentionError``).

The judgement is one statistic, the cascade's error in *rounding units* (``AttentionError.units``):
its max error divided by plain attention's, or by what rounding alone leaves when plain was lucky.
Healthy and broken cascades' distributions of it, per dtype, CPU kernel level and device, are in
docs/correctness.md (measured by benchmarks/cascade_gap.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: Cascade attention in float32 (and wider) may be off float64 by this many rounding units
#: (``AttentionError.units``); ``REDUCED_ROUNDING_FACTOR`` in bfloat16/float16. Chosen by measurement
#: (benchmarks/cascade_gap.py, docs/correctness.md): healthy cascades stay at least 10x below them in
#: every dtype, CPU kernel level and device measured (float32 up to 4.3 units, reduced precision up to
#: 0.95), and a logic error on the self-check's tiny contexts lands at least 10x above in float32 (the
#: model's own dtype, or the float32 machinery check that runs whatever the model's dtype).
ROUNDING_FACTOR = 64.0
#: In bfloat16/float16 a unit is 1/128 or 1/1024 of the largest output and a healthy cascade rounds
#: in it once or twice; a lower threshold keeps the grosser logic errors visible layer by layer.
REDUCED_ROUNDING_FACTOR = 16.0


def rounding_factor(dtype: torch.dtype) -> float:
    """The threshold, in rounding units, for attention computed in ``dtype``."""
    return REDUCED_ROUNDING_FACTOR if torch.finfo(dtype).bits < 32 else ROUNDING_FACTOR


@dataclass(frozen=True, slots=True)
class AttentionError:
    """One layer's attention against float64 on the same inputs (max abs over rows, heads, dims)."""

    cascade: float  # cascade output's error
    plain: float  # plain attention's error in the same dtype
    scale: float  # largest |reference output|
    logit: float = 0.0  # largest |score| (q·k·scale) of a key some row attends to

    def unit(self, dtype: torch.dtype) -> float:
        """One rounding unit: plain attention's own max error, or what rounding alone leaves if that is
        more: one rounding of the largest output in ``dtype``, plus one float32 rounding of the largest
        score (every kernel forms scores in float32 at best, and an error δ in the scores moves the
        output by about δ of its size). Plain's error is one draw of the same rounding, lucky or not:
        the floor keeps a lucky draw from shrinking the unit when scores are large."""
        eps = torch.finfo(dtype).eps
        wide = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
        return max(self.plain, (eps + wide * self.logit) * self.scale)

    def units(self, dtype: torch.dtype) -> float:
        """The statistic ``check_cascade`` judges: the cascade's error in rounding units (NaN stays NaN)."""
        unit = self.unit(dtype)
        return self.cascade / unit if unit > 0 else (0.0 if self.cascade == 0 else math.inf)

    def bound(self, dtype: torch.dtype) -> float:
        """Most ``cascade`` may be for rounding alone: ``rounding_factor(dtype)`` rounding units."""
        return rounding_factor(dtype) * self.unit(dtype)

    def within(self, dtype: torch.dtype) -> bool:
        # False on NaN anywhere: max() in ``unit`` could otherwise drop one
        values = (self.cascade, self.plain, self.scale, self.logit)
        return not any(map(math.isnan, values)) and self.units(dtype) <= rounding_factor(dtype)

    def describe(self, dtype: torch.dtype) -> str:
        """For a refusal: the statistic against its threshold, and what its unit is made of."""
        return (f"{self.units(dtype):.3g} rounding units from float64, more than rounding allows "
                f"({rounding_factor(dtype):g}): max error {self.cascade:.3g}; unit {self.unit(dtype):.3g} (plain {dtype} "
                f"attention's error {self.plain:.3g}; largest output {self.scale:.3g}, largest score "
                f"{self.logit:.3g})")


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
    cascade, plain, top, logit = [], [], [], []
    for start, end, keys, values in requests:
        rows = q[:, start:end]
        exact = reference_attention(rows, keys, values, scale, torch.float64)
        same = reference_attention(rows, keys, values, scale)
        cascade.append((out[:, start:end].double() - exact).abs().max())
        plain.append((same.double() - exact).abs().max())
        top.append(exact.abs().max())
        logit.append(largest_score(rows, keys, scale))
    # torch's max keeps a NaN (Python's max may drop it), so a NaN output fails ``within``.
    return AttentionError(*(float(torch.stack(v).max()) for v in (cascade, plain, top, logit)))


def largest_score(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Largest |q·k·scale| (float64, a 0-d tensor) over the keys each row attends to, causal as
    ``reference_attention``. q: [Hq, r, D]; keys: [Hkv, n, D]."""
    g = q.shape[0] // keys.shape[0]
    r, n = q.shape[1], keys.shape[1]
    scores = q.double() @ keys.double().repeat_interleave(g, dim=0).transpose(1, 2) * scale  # [Hq, r, n]
    rows, cols = torch.arange(r, device=q.device).unsqueeze(1), torch.arange(n, device=q.device).unsqueeze(0)
    return scores.masked_fill(cols > n - r + rows, 0.0).abs().max()  # [r, n] mask broadcast over heads
