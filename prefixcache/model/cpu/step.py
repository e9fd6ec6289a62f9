"""The CPU fast path behind one interface: ``build_step_forward`` gives a ``StepForward`` or says why not.

A ``StepForward`` computes what the model's own forward computes for one packed cascade step
(``hf_cache.cascade_step``) with fewer weight repacks: the fused Llama forward (q/k/v and
gate/up as one MKL-packed product each) where it serves and agrees with the model's forward,
else the model's forward with MKL-packed linear modules. Whatever cannot be served that way
(another device or dtype, hooks, a replaced module) runs through the model's own forward.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixcache.errors import UnsupportedModelError
from prefixcache.model.cpu.llama_forward import FusedLlama
from prefixcache.model.cpu.packed_linear import PackedLinears
from prefixcache.model.hf_cache import CascadeCache, cascade_step, check_cascade
from prefixcache.model.layout import KVLayout

#: Ways of computing a step, fastest first.
KINDS = ("fused", "packed")


class StepForward:
    """One packed step: ``(input_ids [T], position_ids [T], cache, keep [K]) -> logits [K, V]``."""

    def __init__(self, model: torch.nn.Module, kind: str, fused: FusedLlama | None = None,
                 packed: PackedLinears | None = None):
        self.model, self.kind, self._fused, self._packed = model, kind, fused, packed
        self.fast_steps = 0  # steps served by the fast path (not the model's own forward)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights that have an extra packed copy (the copy costs about as much again; not KV)."""
        return (self._fused or self._packed).weight_bytes

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: CascadeCache,
                 keep: torch.Tensor) -> torch.Tensor:
        # Inference mode skips autograd bookkeeping on every op of the step; it is entered after the
        # packed weights are refreshed (``ready``, ``installed``), so those stay normal tensors.
        # Everything else that outlives the step is written in place (private KV) or cloned by the caller.
        if self._fused is not None:
            if not self._fused.ready():  # a module was replaced or hooked since: the model's own forward
                with torch.inference_mode():
                    return cascade_step(self.model, input_ids, position_ids, cache, keep)
            self.fast_steps += 1
            with torch.inference_mode():
                return self._fused(input_ids, position_ids, cache, keep)
        self.fast_steps += 1
        with self._packed.installed(), torch.inference_mode():
            return cascade_step(self.model, input_ids, position_ids, cache, keep)


def build_step_forward(model: torch.nn.Module, layout: KVLayout, rows: int, max_bytes: int,
                       kinds: Sequence[str] = KINDS) -> tuple[StepForward | None, str | None]:
    """The fastest of ``kinds`` that serves ``model`` for steps of up to ``rows`` rows, checked against
    the model's own forward, with at most ``max_bytes`` of packed weights; else (None, why not)."""
    reasons = []
    for kind in kinds:
        if kind == "fused":
            fused, reason = FusedLlama.build(model, rows, max_bytes)
            if fused is not None:
                try:
                    check_cascade(model, layout, fused, rows=rows)  # a step of ``rows`` rows: packed products
                    return StepForward(model, kind, fused=fused), None
                except UnsupportedModelError as exc:
                    reason = f"it differs from the model's own forward: {exc}"
        elif kind == "packed":
            packed, reason = PackedLinears.build(model, rows, max_bytes)
            if packed is not None:
                return StepForward(model, kind, packed=packed), None
        else:
            raise ValueError(f"unknown step forward {kind!r}; known: {KINDS}")
        reasons.append(f"{kind}: {reason}")
    return None, "; ".join(reasons) or "none asked for"
