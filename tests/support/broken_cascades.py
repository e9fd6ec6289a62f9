"""Deliberately broken cascades, each a logic error the start-up check must refuse in any dtype.

``ONE_AHEAD``, ``MISSING_BLOCK`` and ``GQA_MODULO`` wrap ``hf_cache.attend_groups`` (``variant(real)``
returns the broken function); ``merge_swapped`` replaces ``cascade.merge_two``. Shared by the check's
tests and ``benchmarks/cascade_gap.py``, which measures how far each lands above the threshold.
"""
from __future__ import annotations

import torch


def merge_swapped(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """``merge_two`` with the log-sum-exp weights swapped: each part weighed by the other's mass."""
    weight_a = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    return torch.lerp(o_b, o_a, weight_a.to(o_a.dtype))


def one_ahead(real):
    def attend_groups(q, groups, own, scale, batches, masks, *rest):
        # each chunk's private keys get the next token's: every row sees one key past its own
        gen = torch.Generator().manual_seed(0)
        longer = []
        for s, e, k, v in own:
            extra = torch.randn((2, k.shape[0], 1, k.shape[2]), generator=gen).to(k)
            longer.append((s, e, torch.cat([k, extra[0]], 1), torch.cat([v, extra[1]], 1)))
        return real(q, groups, longer, scale, batches, masks, *rest)
    return attend_groups


def missing_block(real):
    def attend_groups(q, groups, own, scale, batches, masks, *rest):
        # the first group's first stored run is left out
        groups = [(rows, runs[1:]) for rows, runs in groups[:1] if len(runs) > 1] + list(groups[1:])
        return real(q, groups, own, scale, batches, masks, *rest)
    return attend_groups


def gqa_modulo(real):
    def attend_groups(q, groups, own, scale, batches, masks, *rest):
        # the cascade maps query head h' to KV head h' // g: put head h at (h % Hkv) g + h // Hkv
        hkv = batches[0].keys.shape[1] if batches else own[0][2].shape[0]
        g = q.shape[0] // hkv
        to = torch.tensor([(h % hkv) * g + h // hkv for h in range(q.shape[0])], device=q.device)
        moved = torch.empty_like(q)
        moved[to] = q
        return real(moved, groups, own, scale, batches, masks, *rest)[to]
    return attend_groups


BROKEN_GROUPS = {"mask one key ahead": one_ahead, "a prefix block missing": missing_block,
                 "query head h reads KV head h % Hkv": gqa_modulo}
