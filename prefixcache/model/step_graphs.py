"""Captured decode steps: a step of decodes replayed instead of launched kernel by kernel.

A decode step of a few dozen requests costs the GPU a few milliseconds and the host far more:
it launches about a thousand small kernels, one Python call each. Once the same step shape
repeats (the same requests decoding over the same stored prefixes and private pool), the step
is captured once (``Capture``: CUDA graphs on CUDA) and later steps of that shape copy their few
changing tensors (token ids, positions, the pooled decodes' masks and write targets) into the
captured step's inputs and replay it.

What a step reads is fixed by ``CascadeCache.step_key``: the addresses and shapes of the stored
snapshots and pool slabs, the requests' slots and rows. A step whose key has no captured step
runs eagerly; a key seen on ``repeats`` steps in a row is captured. Capturing is checked: the
captured step, replayed on the inputs of the step just run eagerly, must give the same logits,
else capturing is switched off for good (``disabled``, with the reason) and every step runs
eagerly. A capture that raises does the same. Captured steps are kept for the ``limit`` most
recently used keys.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixcache.model.hf_cache import CascadeCache

log = logging.getLogger(__name__)

#: forward(input_ids [T], position_ids [T], cache, keep [K]) -> logits [K, V]
Forward = Callable[[torch.Tensor, torch.Tensor, CascadeCache, torch.Tensor], torch.Tensor]


class Capture(Protocol):
    """Records the kernels ``fn`` launches; returns a call that runs them again on the same tensors
    and returns the tensor ``fn`` returned (refilled)."""

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]: ...


@dataclass(slots=True)
class _Captured:
    replay: Callable[[], torch.Tensor]
    inputs: list[torch.Tensor]  # ids, positions, keep, then the cache's changing tensors: refilled per step
    constant: list[torch.Tensor]  # index tensors the captured kernels read: kept alive with them


class StepGraphs:
    """Decode steps captured by ``capture`` and replayed (see the module docstring)."""

    def __init__(self, forward: Forward, capture: Capture, repeats: int = 2, limit: int = 8):
        if repeats < 1 or limit < 1:
            raise ValueError("repeats and limit must be at least 1")
        self._forward, self._capture, self.repeats, self.limit = forward, capture, repeats, limit
        self._steps: OrderedDict[tuple, _Captured] = OrderedDict()
        self._last: tuple | None = None
        self._seen = 0
        self.disabled: str | None = None  # why capturing was switched off
        self.captures = self.replays = 0

    def run(self, cache: CascadeCache, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Logits of the step: replayed when its shape was captured, else computed eagerly (and captured
        when the shape has repeated enough)."""
        key = None if self.disabled is not None else cache.step_key()
        if key is None:
            return self._forward(ids, pos, cache, keep)
        captured = self._steps.get(key)
        if captured is not None:
            for target, value in zip(captured.inputs, [ids, pos, keep, *cache.step_inputs()], strict=True):
                target.copy_(value)
            self._steps.move_to_end(key)
            self.replays += 1
            return captured.replay()
        self._seen = self._seen + 1 if key == self._last else 1
        self._last = key
        logits = self._forward(ids, pos, cache, keep)
        if self._seen >= self.repeats:
            self._capture_step(key, cache, ids, pos, keep, logits)
        return logits

    def _capture_step(self, key: tuple, cache: CascadeCache, ids: torch.Tensor, pos: torch.Tensor,
                      keep: torch.Tensor, logits: torch.Tensor) -> None:
        """Capture the step just run eagerly (its inputs as they are), replay it, and keep it if it gives
        the same logits. Writing the step's keys again is harmless: the same values at the same places."""
        constant = cache.step_constants(ids.device)  # planned by the eager step already
        inputs = [ids.clone(), pos.clone(), keep.clone()]
        static_ids, static_pos, static_keep = inputs

        def step() -> torch.Tensor:
            cache.masks.clear()  # per-step tensors derived from the inputs are computed in the step
            return self._forward(static_ids, static_pos, cache, static_keep)

        try:
            replay = self._capture(step)
            again = replay()
        except Exception as exc:  # noqa: BLE001 - the eager step stands; capturing goes off
            self._disable(f"capturing a decode step failed: {type(exc).__name__}: {exc}")
            return
        differs = replay_difference(again, logits)
        if differs is not None:
            self._disable(f"a captured decode step replayed {differs}")
            return
        self._steps[key] = _Captured(replay, [*inputs, *cache.step_inputs()], constant)
        self.captures += 1
        while len(self._steps) > self.limit:
            self._steps.popitem(last=False)

    def _disable(self, reason: str) -> None:
        log.warning("%s; decode steps run eagerly from now on", reason)
        self.disabled = reason
        self._steps.clear()


def device_capture(device: torch.device) -> Capture | None:
    """The capture of ``device``'s kind: CUDA graphs on CUDA; None elsewhere (a CPU launches no kernels)."""
    if device.type != "cuda":
        return None
    from prefixcache.model.cuda import CudaGraphCapture

    return CudaGraphCapture(device)


def replay_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How a replayed step's logits differ from the eager step's, or None when they agree: equal, or
    within two roundings of the largest logit (a kernel may pick another reduction order in a capture)."""
    if got.shape != want.shape:
        return f"logits of shape {tuple(got.shape)} instead of {tuple(want.shape)}"
    if torch.equal(got, want):
        return None
    err = float((got.float() - want.float()).abs().max())
    tol = 2 * torch.finfo(want.dtype).eps * max(1.0, float(want.float().abs().max()))
    return None if err <= tol else f"logits {err:.3g} away from the eager step's (tolerance {tol:.3g})"
