"""Cascade attention: shared prefix KV read once for many requests, merged exactly by log-sum-exp.

Pure torch, no ``transformers``. Queries of all active requests are *packed*: request
``i`` owns rows ``spans[i] = (start, end)`` of ``q: [Hq, T, D]``. Keys come in two kinds:

- ``Shared`` segments (a stored prefix block, read in place, never written): every
  query row of every member sees every key, so one attention call serves all members.
- one private ``(k, v)`` per request (``[Hkv, m_i, D]``) whose last ``end - start``
  keys are the request's own queries, so it is causal there (bottom-right aligned);
  or, for requests decoding one token, a ``PrivateBatch``: their private KV as slots of
  one padded tensor, attended in one call with a length mask.

Softmax over a union of key sets is the log-sum-exp weighted mix of the softmaxes over
the parts, so the result equals attention over the concatenation (to fp rounding). Parts
and merges are computed in float32 (``accumulation_dtype``) and the result is rounded to
q's dtype once, so in bfloat16/float16 the cascade rounds no more than plain attention.
GQA: ``Hq = g * Hkv``; query head ``h`` reads KV head ``h // g`` (as ``repeat_kv``), so
queries are viewed as ``[Hkv, g * rows, D]`` instead of repeating keys.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixcache.model.layout import index_tensor


@dataclass(frozen=True, slots=True)
class Shared:
    """A KV segment every query of ``members`` (request indices) attends to in full."""

    keys: torch.Tensor  # [Hkv, n, D]
    values: torch.Tensor  # [Hkv, n, D]
    members: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrivateBatch:
    """One-token queries of several requests over their private KV, held as slots of one tensor."""

    keys: torch.Tensor  # [S, Hkv, C, D]: member i's keys are keys[slots[i], :, :length_i]
    values: torch.Tensor  # [S, Hkv, C, D]
    rows: torch.Tensor  # long [n]: packed query row of each member
    slots: torch.Tensor | None  # long [n]: each member's slot; None when the members are slots 0..S-1 in order
    mask: torch.Tensor  # additive [S, 1, 1, C] (accumulation dtype): member i sees its first length_i keys, an idle slot key 0
    in_order: bool = False  # rows are 0..n-1: member i is packed row i (a step of decodes only)

    @classmethod
    def build(cls, keys: torch.Tensor, values: torch.Tensor, rows: Sequence[int], slots: Sequence[int],
              lengths: Sequence[int]) -> PrivateBatch:
        """Index tensors and mask from plain lists (layer-independent: build once per step)."""
        slots_n, _, capacity, _ = keys.shape
        device = keys.device
        identity = tuple(slots) == tuple(range(slots_n))
        # One host-to-device copy: the slots, their lengths (idle slots: a dummy key, dropped later), the rows.
        seen_host = [1] * slots_n
        for slot, length in zip(slots, lengths):
            seen_host[slot] = length
        packed = index_tensor([*slots, *seen_host, *rows], device)
        slot_t, seen, rows_t = packed[: len(slots)], packed[len(slots) : len(slots) + slots_n], packed[len(slots) + slots_n :]
        visible = torch.arange(capacity, device=device).unsqueeze(0) < seen.unsqueeze(1)  # [S, C]
        mask = torch.zeros(visible.shape, dtype=accumulation_dtype(keys.dtype), device=device)
        mask = mask.masked_fill(~visible, float("-inf"))
        return cls(keys, values, rows_t, None if identity else slot_t, mask.view(slots_n, 1, 1, capacity),
                   tuple(rows) == tuple(range(len(rows))))

    def covers(self, total: int) -> bool:
        """Whether the members are all ``total`` packed rows, in order (a step of decodes only)."""
        return self.in_order and self.rows.shape[0] == total


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial attentions are computed and merged in: float32, or wider inputs' own."""
    return torch.promote_types(dtype, torch.float32)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp. q: [1, H, R, D], k/v: [1, H, n, D], mask: additive [R, n].

    Also batched: q [B, H, R, D] with k/v [B, H, n, D] and a mask broadcastable to [B, H, R, n].
    Returns out [1, H, R, D] and lse [1, H, R], both in ``accumulation_dtype(q.dtype)``.

    Narrower inputs (bfloat16, float16) are upcast first: a kernel in their dtype rounds its
    probabilities and its output to that dtype, and a cascade merges several such outputs, so
    it would round more often than plain attention does. Upcast, each part and the merge stay
    exact to float32 and the caller rounds once at the end.
    """
    wide = accumulation_dtype(q.dtype)
    q, k, v = q.to(wide), k.to(wide), v.to(wide)
    mask = None if mask is None else mask.to(wide)
    if q.device.type == "cpu" and wide == torch.float32:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask,
                                                                         scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [1, H, R, n]
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def causal_tail_mask(rows: int, keys: int, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [groups * rows, keys]: query t (of the last ``rows``) sees keys <= keys - rows + t."""
    t = torch.arange(rows, device=device).unsqueeze(1)
    j = torch.arange(keys, device=device).unsqueeze(0)
    allowed = j <= keys - rows + t  # [rows, keys]
    mask = torch.zeros((rows, keys), dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
    return mask.repeat(groups, 1)


def merge_two(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Exact merge of two partial attentions over disjoint key sets (in their dtype: see ``attend``).

    Softmax over the union weighs part a by exp(lse_a) / (exp(lse_a) + exp(lse_b)) =
    sigmoid(lse_a - lse_b). o: [..., R, D], lse: [..., R] (accumulation dtype); part b must be
    present (finite lse) on every row. The union's lse is ``torch.logaddexp(lse_a, lse_b)``.
    """
    weight_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    return torch.lerp(o_b, o_a, weight_a.to(o_a.dtype))


def cascade_attention(q: torch.Tensor, spans: Sequence[tuple[int, int]], shared: Sequence[Shared],
                      private: Sequence[tuple[torch.Tensor, torch.Tensor] | None], scale: float,
                      batches: Sequence[PrivateBatch] = (),
                      masks: dict[tuple, torch.Tensor] | None = None,
                      kernels: AttentionKernels | None = None) -> torch.Tensor:
    """Packed cascade attention. q: [Hq, T, D]; private[i]: ([Hkv, m_i, D], [Hkv, m_i, D]), or None
    for a request whose row is in one of ``batches``. Returns [Hq, T, D].

    Segments with the same ``members`` share one selection of query rows and one scatter
    (a chain of stored runs read by one request costs one call per run, no copies).
    ``masks``, ``kernels``: see ``attend_groups``."""
    by_members: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for seg in shared:
        by_members.setdefault(tuple(seg.members), []).append((seg.keys, seg.values))
    total = q.shape[1]
    groups = [(member_rows(members, spans, total, q.device), kv) for members, kv in by_members.items()]
    own = [(start, end, kv[0], kv[1]) for (start, end), kv in zip(spans, private) if kv is not None]
    return attend_groups(q, groups, own, scale, batches, {} if masks is None else masks, kernels)


def attend_groups(q: torch.Tensor, groups: Sequence[tuple[torch.Tensor | None, Sequence[tuple[torch.Tensor,
                  torch.Tensor]]]], own: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]], scale: float,
                  batches: Sequence[PrivateBatch], masks: dict[tuple, torch.Tensor],
                  kernels: AttentionKernels | None = None) -> torch.Tensor:
    """The work of ``cascade_attention`` once its layer-independent parts are planned (per forward).

    ``groups``: (packed query rows of the members, None for all rows; their shared (k, v) runs
    [Hkv, n, D]); ``own``: (start, end, k, v) of each request attending to its private KV
    alone; ``batches``: the one-token rows served per pool. Every row is in ``own`` or a
    batch. ``masks``: causal masks by (rows, keys) and other per-forward tensors, kept by the
    caller across the layers of one forward (same dtype, device and heads), so a prefill
    chunk's mask is built once. ``kernels``: the device's attention calls (``kernels_for``).
    """
    hq, total, dim = q.shape
    hkv = batches[0].keys.shape[1] if batches else own[0][2].shape[0]
    g = hq // hkv
    kernels = kernels_for(q.device, q.dtype, dim) if kernels is None else kernels
    if not groups and not batches and len(own) == 1 and own[0][:2] == (0, total):
        # One request over its own keys alone (a prompt's first chunk): one call, nothing to merge.
        out = kernels.alone(q.reshape(hkv, g, total, dim), own[0][2], own[0][3], scale)
        if out is not None:
            return out.reshape(hq, total, dim)
    qg = kernels.prepare(q.reshape(hkv, g, total, dim))  # [Hkv, g, T, D]
    acc, acc_lse = _attend_private(qg, own, scale, batches, masks, kernels)  # present on every row
    for n, (rows, segs) in enumerate(groups):
        sel = qg if rows is None else qg.index_select(2, rows)  # [Hkv, g, r, D]
        o_part = lse_part = None
        for keys, values in segs:
            o, lse = kernels.full(sel, keys, values, scale)
            if o_part is None:
                o_part, lse_part = o, lse
            else:
                o_part, lse_part = merge_two(o, lse, o_part, lse_part), torch.logaddexp(lse, lse_part)
        last = n + 1 == len(groups)
        if rows is None:
            acc = merge_two(o_part, lse_part, acc, acc_lse)
            acc_lse = acc_lse if last else torch.logaddexp(lse_part, acc_lse)
        else:
            here = acc_lse.index_select(2, rows)
            acc.index_copy_(2, rows, merge_two(o_part, lse_part, acc.index_select(2, rows), here))
            if not last:
                acc_lse.index_copy_(2, rows, torch.logaddexp(lse_part, here))
    return acc.to(q.dtype).reshape(hq, total, dim)


def _attend_private(qg: torch.Tensor, own: Sequence[tuple[int, int, torch.Tensor, torch.Tensor]], scale: float,
                    batches: Sequence[PrivateBatch], masks: dict[tuple, torch.Tensor],
                    kernels: AttentionKernels) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row over its request's private KV (which holds at least the row's own key):
    out [Hkv, g, T, D] and lse [Hkv, g, T] (the accumulation dtype)."""
    hkv, g, total, dim = qg.shape
    if not own and len(batches) == 1 and batches[0].covers(total):
        return _attend_batch(qg, batches[0], scale, masks, kernels)  # a step of decodes only: every row, in order
    wide = accumulation_dtype(qg.dtype)
    o_priv = qg.new_empty((hkv, g, total, dim), dtype=wide)
    l_priv = qg.new_empty((hkv, g, total), dtype=wide)
    for batch in batches:
        o, lse = _attend_batch(qg, batch, scale, masks, kernels)
        o_priv.index_copy_(2, batch.rows, o)
        l_priv.index_copy_(2, batch.rows, lse)
    # Requests with as many rows over as many private keys (a burst of questions) share one call where the
    # kernels stack them; every other request is a call of its own.
    alike: dict[tuple[int, ...], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for item in own:
        alike.setdefault((item[1] - item[0], item[2].shape[1]) if kernels.batch_own else (item[0],), []).append(item)
    for items in alike.values():
        if len(items) == 1:
            start, end, k, v = items[0]
            o, lse = kernels.causal(qg[:, :, start:end].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale, masks)
            o_priv[:, :, start:end] = o[0]
            l_priv[:, :, start:end] = lse[0]
            continue
        r = items[0][1] - items[0][0]
        starts = tuple(item[0] for item in items)
        index = masks.get(("rows", r, starts))
        if index is None:  # their packed rows, once per forward
            index = masks["rows", r, starts] = index_tensor([s + i for s in starts for i in range(r)], qg.device)
        b = len(items)
        q = qg.index_select(2, index).view(hkv, g, b, r, dim).permute(2, 0, 1, 3, 4)  # [B, Hkv, g, r, D]
        k = torch.stack([item[2] for item in items])  # [B, Hkv, n, D]
        v = torch.stack([item[3] for item in items])
        o, lse = kernels.causal(q, k, v, scale, masks)
        o_priv.index_copy_(2, index, o.permute(1, 2, 0, 3, 4).reshape(hkv, g, b * r, dim))
        l_priv.index_copy_(2, index, lse.permute(1, 2, 0, 3).reshape(hkv, g, b * r))
    return o_priv, l_priv


def _attend_batch(qg: torch.Tensor, batch: PrivateBatch, scale: float, masks: dict[tuple, torch.Tensor],
                  kernels: AttentionKernels) -> tuple[torch.Tensor, torch.Tensor]:
    """Members' one-token queries (rows of qg [Hkv, g, T, D]) over their slots: one call, masked to
    each member's length; slots not in ``batch`` get a dummy key and are dropped. Returns
    out [Hkv, g, n, D] and lse [Hkv, g, n]."""
    rows = qg if batch.covers(qg.shape[2]) else qg.index_select(2, batch.rows)
    q = rows.permute(2, 0, 1, 3)  # [n, Hkv, g, D]
    if batch.slots is None:
        qs = q
    else:
        qs = q.new_zeros((batch.keys.shape[0], *q.shape[1:]))
        qs.index_copy_(0, batch.slots, q)
    o, lse = kernels.masked(qs, batch.keys, batch.values, scale, batch.mask, masks)  # [S, Hkv, g, D], [S, Hkv, g]
    if batch.slots is not None:
        o, lse = o.index_select(0, batch.slots), lse.index_select(0, batch.slots)
    return o.permute(1, 2, 0, 3), lse.permute(1, 2, 0)


class AttentionKernels(Protocol):
    """The attention calls a cascade is made of, on one device. Each returns (out, lse) in the
    accumulation dtype; the cascade merges them there and rounds once. ``g`` query heads share
    each KV head (query head ``h·g + j`` reads KV head ``h``)."""

    #: Whether requests with equal row and key counts are stacked into one ``causal`` call.
    batch_own: bool

    def prepare(self, qg: torch.Tensor) -> torch.Tensor:
        """Queries [Hkv, g, T, D] as the calls take them (upcast once on the CPU; as they are on CUDA)."""

    def full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row sees every key. q [Hkv, g, r, D], k/v [Hkv, n, D] → out [Hkv, g, r, D], lse [Hkv, g, r]."""

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               masks: dict[tuple, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows over their request's private keys, whose last ``r`` are the rows' own (bottom-right causal).
        q [B, Hkv, g, r, D], k/v [B, Hkv, n, D] with n >= r → out [B, Hkv, g, r, D], lse [B, Hkv, g, r]."""

    def alone(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
        """One request's rows over its own keys, which are the rows' keys and nothing else (bottom-right
        causal: a prompt's first chunk). q [Hkv, g, r, D], k/v [Hkv, r, D] → out [Hkv, g, r, D] in q's
        dtype, rounded once by the kernel. None: the kernels have no such call (the general path serves)."""

    def masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor,
               masks: dict[tuple, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One-token rows of several slots. q [S, H, g, D], k/v [S, H, C, D], mask additive [S, 1, 1, C]
        (accumulation dtype) → out [S, H, g, D], lse [S, H, g]."""


class TorchKernels:
    """Attention through torch's CPU flash kernel (float32) or explicit score matrices, in the
    accumulation dtype: the reference path, and the one every device can run. A GQA group's query
    heads are one run of rows against their KV head (no repeated keys)."""

    batch_own = False  # on the CPU a stacked copy costs more than the calls it saves

    def prepare(self, qg: torch.Tensor) -> torch.Tensor:
        return qg.to(accumulation_dtype(qg.dtype))  # once here, not per call

    def full(self, q, k, v, scale):
        hkv, g, r, dim = q.shape
        o, lse = attend(q.reshape(1, hkv, g * r, dim), k.unsqueeze(0), v.unsqueeze(0), scale)
        return o.view(hkv, g, r, dim), lse.view(hkv, g, r)

    def causal(self, q, k, v, scale, masks):
        b, hkv, g, r, dim = q.shape
        mask = None
        if r > 1:
            mask = masks.get((r, k.shape[2]))
            if mask is None:
                mask = masks[(r, k.shape[2])] = causal_tail_mask(r, k.shape[2], g, q.dtype, q.device)
        o, lse = attend(q.reshape(b, hkv, g * r, dim), k, v, scale, mask)
        return o.view(b, hkv, g, r, dim), lse.view(b, hkv, g, r)

    def alone(self, q, k, v, scale):
        return None  # the general path: the same calls, one part

    def masked(self, q, k, v, scale, mask, masks):
        return attend(q, k, v, scale, mask)


def kernels_for(device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernels:
    """The attention kernels for queries on ``device`` in ``dtype``: fused CUDA kernels where they
    serve, else torch's. Keep one per model: it learns what the device's kernels accept."""
    if device.type == "cuda":
        from prefixcache.model.cuda import fused_kernels

        kernels = fused_kernels(dtype, head_dim)
        if kernels is not None:
            return kernels
    return TorchKernels()


def member_rows(members: Sequence[int], spans: Sequence[tuple[int, int]], total: int,
                device: torch.device) -> torch.Tensor | None:
    """Packed query rows of ``members``; None when they are all rows."""
    covered = sum(spans[i][1] - spans[i][0] for i in members)
    if covered == total:
        return None
    return torch.cat([torch.arange(spans[i][0], spans[i][1], device=device) for i in members])


def batched_cascade(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor,
                    private: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Convenience form: q [B, Hq, t, D] (same t per request), prefix [1, Hkv, P, D] shared by all B.

    ``private[i]`` is ([Hkv, m_i, D], ...) with m_i >= t. Returns [B, Hq, t, D].
    """
    b, hq, t, dim = q.shape
    packed = q.permute(1, 0, 2, 3).reshape(hq, b * t, dim)  # [Hq, B*t, D]
    spans = [(i * t, (i + 1) * t) for i in range(b)]
    seg = Shared(prefix_k[0], prefix_v[0], tuple(range(b)))
    out = cascade_attention(packed, spans, [seg] if prefix_k.shape[2] else [], private, scale)
    return out.reshape(hq, b, t, dim).permute(1, 0, 2, 3)
