"""Private KV of batched requests: the tokens each request computes itself (suffix and answer).

Pure torch, no ``transformers``. Requests share one ``PrivatePool``: a tensor
``[L, 2, S, H, C, D]`` with one *slot* per request, so the decode attention of every
request in the pool is one padded call per layer (``cascade.PrivateBatch``) and their new
keys are written with one indexed copy. Capacity ``C`` grows by whole chunks when a slot
needs more, never per token; a pool that plans ahead (the shared one) grows at once to the
most any live request may hold (its ``need``: suffix + max new tokens), so a burst costs one
reallocation, not one per chunk; any other pool grows by at least an eighth of its capacity
(capped at its requests' needs). Requests admitted together get their slots in one
reallocation. A leaving request's slot is reused by the next one admitted, or the live slots
are repacked into an exact-size tensor when nobody is waiting; an empty
pool holds nothing. A request whose private tokens
could exceed ``BatchConfig.pool_max_tokens`` gets a pool of its own, so one long prompt
never pads every other slot to its length.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.model.cascade import PrivateBatch
from prefixcache.model.layout import index_tensor


class PrivatePool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, chunk: int, plan_ahead: bool = False):
        self._shape = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device, self.chunk = dtype, device, chunk
        self.plan_ahead = plan_ahead  # size capacity for the live requests' needs, not their lengths
        self.owners: list[PrivateKV | None] = []
        self.slab = self._alloc(0, 0)

    def _alloc(self, slots: int, capacity: int) -> torch.Tensor:
        layers, heads, dim = self._shape
        # Zeros, not empty: masked-out keys still enter q·k, and garbage may be inf/NaN.
        return torch.zeros((layers, 2, slots, heads, capacity, dim), dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.slab.shape[4]

    @property
    def nbytes(self) -> int:
        return self.slab.numel() * self.slab.element_size()

    def acquire(self, need: int = 0) -> PrivateKV:
        """A new request's empty private KV (``need``: the most tokens it may hold): a free slot, else one more."""
        return self.acquire_all([need])[0]

    def acquire_all(self, needs: list[int]) -> list[PrivateKV]:
        """Empty private KVs for requests joining together: free slots first, then at most one reallocation."""
        free = [i for i, owner in enumerate(self.owners) if owner is None]
        slots = len(self.owners) + max(0, len(needs) - len(free))
        capacity = max(self.capacity, self._planned(needs))
        if slots != len(self.owners) or capacity != self.capacity:
            self._resize(slots, capacity)
            free = [i for i, owner in enumerate(self.owners) if owner is None]
        joined = []
        for slot, need in zip(free, needs):
            kv = PrivateKV(self, slot, need)
            self.owners[slot] = kv
            joined.append(kv)
        return joined

    def release(self, kv: PrivateKV, trim: bool = True) -> None:
        """Free ``kv``'s slot. With ``trim`` (nobody waiting to reuse it) repack the live slots
        into an exact-size tensor, so the bytes held are only what live requests use."""
        if kv.slot < 0 or self.owners[kv.slot] is not kv:
            return
        self.owners[kv.slot], kv.slot = None, -1
        live = [o for o in self.owners if o is not None]
        if not live:
            self.owners, self.slab = [], self._alloc(0, 0)
        elif trim:
            self._resize(len(live), max(self._round(max(o.length for o in live)), self._planned()))

    def reserve(self, end: int) -> None:
        """Make room for ``end`` tokens in every slot (rounded up to a chunk); one copy per growth.

        A pool that plans ahead grows at once to its live requests' needs. Any other (a long
        prompt's own pool) grows by at least an eighth of its capacity, capped at the most its
        requests may hold: a long answer after a long prompt costs a few copies of the prompt's
        KV, not one per chunk, for at most an eighth more bytes held."""
        if end > self.capacity:
            target = max(self._round(end), self._planned())
            if not self.plan_ahead:
                target = max(target, min(self._round(self.capacity + self.capacity // 8), self._most_needed()))
            self._resize(len(self.owners), target)

    def _planned(self, joining: Sequence[int] = ()) -> int:
        """Capacity for the most any live (or ``joining``) request may hold; 0 unless planning ahead."""
        return self._most_needed(joining) if self.plan_ahead else 0

    def _most_needed(self, joining: Sequence[int] = ()) -> int:
        """The most any live (or ``joining``) request may hold, rounded up to a chunk."""
        return self._round(max([o.need for o in self.owners if o is not None] + list(joining), default=0))

    def _round(self, tokens: int) -> int:
        return -(-tokens // self.chunk) * self.chunk

    def _resize(self, slots: int, capacity: int) -> None:
        """Reallocate as ``[.., slots, .., capacity, ..]``, live requests packed into the first slots."""
        grown = self._alloc(slots, capacity)
        owners: list[PrivateKV | None] = [None] * slots
        for new_slot, kv in enumerate(o for o in self.owners if o is not None):
            grown[:, :, new_slot, :, : kv.length].copy_(self.slab[:, :, kv.slot, :, : kv.length])
            kv.slot, owners[new_slot] = new_slot, kv
        self.slab, self.owners = grown, owners

    def decode_group(self, members: list[PrivateKV], rows: list[int], whole: bool = False) -> DecodeGroup:
        """The members decoding one token each in the next forward (``rows``: their packed query rows).

        Its indices and mask do not depend on the layer, so they are built here, once per step.
        ``whole``: attend over every slot's whole capacity (masked to each member's length), so the
        step's shapes stay the same from one step to the next while the pool keeps its shape (what a
        captured step needs); otherwise over the longest member's length only.
        """
        lengths = [kv.length + 1 for kv in members]  # their new key included
        end = self.capacity if whole else max(lengths)
        slots = [kv.slot for kv in members]
        template = PrivateBatch.build(self.slab[0, 0, :, :, :end], self.slab[0, 1, :, :, :end], rows, slots, lengths)
        # Where the new keys and values go in one layer's [2, S, H, C, D] viewed as rows of D:
        # keys of member i, head h at ((s_i·H + h)·C + p_i), values one S·H·C further; ordered
        # (k/v, head, member) like the source the write assembles.
        _, _, n_slots, heads, capacity, _ = self.slab.shape
        packed = index_tensor([*slots, *(kv.length for kv in members)], self.device)
        slot_t, pos_t = packed[: len(slots)], packed[len(slots) :]
        head_t = torch.arange(heads, dtype=torch.long, device=self.device).unsqueeze(1)  # [H, 1]
        keys_at = ((slot_t * heads + head_t) * capacity + pos_t).reshape(-1)  # [H·n]
        targets = torch.cat([keys_at, keys_at + n_slots * heads * capacity])
        return DecodeGroup(self, template, targets, self.slab.shape, end, tuple(slots), tuple(rows))


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """One pool's decoding members in one forward: a write and an attention call per layer."""

    pool: PrivatePool
    template: PrivateBatch  # index tensors and mask (the layer-0 views are replaced per layer)
    targets: torch.Tensor  # long [2·H·n]: rows of a layer's slab viewed as [2·S·H·C, D]
    shape: torch.Size  # the slab's shape the targets were computed for
    end: int  # keys read per slot
    slots: tuple[int, ...]  # each member's slot (host copy of what the tensors encode)
    rows: tuple[int, ...]  # each member's packed query row

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the members' new keys/values, taken from packed ``[H, T, D]`` at their rows: one indexed copy."""
        slab = self.pool.slab
        if slab.shape != self.shape:
            raise RuntimeError("the private pool was resized during a step")
        batch = self.template
        if not batch.covers(keys.shape[1]):
            keys, values = keys.index_select(1, batch.rows), values.index_select(1, batch.rows)
        source = torch.cat([keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1])])
        slab[layer].view(-1, slab.shape[-1]).index_copy_(0, self.targets, source)

    def batch(self, layer: int) -> PrivateBatch:
        t, kv = self.template, self.pool.slab[layer, :, :, :, : self.end]
        return PrivateBatch(kv[0], kv[1], t.rows, t.slots, t.mask, t.in_order)


class PrivateKV:
    """One request's slot in a ``PrivatePool``; ``length`` = private tokens held, ``need`` = the most it may hold."""

    def __init__(self, pool: PrivatePool, slot: int, need: int = 0):
        self.pool, self.slot, self.length, self.need = pool, slot, 0, need

    def reserve(self, end: int) -> None:
        self.pool.reserve(end)

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        # keys/values: [H, n, D] at private positions [start, start + n)
        n = keys.shape[1]
        slab = self.pool.slab
        slab[layer, 0, self.slot, :, start : start + n].copy_(keys)
        slab[layer, 1, self.slot, :, start : start + n].copy_(values)

    def load(self, kv: torch.Tensor) -> None:
        """Append tokens computed elsewhere: ``kv`` [L, 2, H, n, D] (e.g. a stored snapshot's tail)."""
        self.reserve(self.length + kv.shape[3])
        self.place(self.length, kv)
        self.length += kv.shape[3]

    def place(self, start: int, kv: torch.Tensor) -> None:
        """Write ``kv`` [L, 2, H, n, D] at private positions [start, start + n) of every layer, in one copy
        (room reserved; ``length`` is the caller's to move, as after ``write``)."""
        self.pool.slab[:, :, self.slot, :, start : start + kv.shape[3]].copy_(kv)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        slab = self.pool.slab
        return slab[layer, 0, self.slot, :, :end], slab[layer, 1, self.slot, :, :end]  # [H, end, D], no copy

    def window(self, start: int, end: int) -> torch.Tensor:
        """A view ``[L, 2, H, end-start, D]`` of private tokens [start, end) (clone before publishing)."""
        return self.pool.slab[:, :, self.slot, :, start:end]

    def release(self, trim: bool = True) -> None:
        self.pool.release(self, trim)
