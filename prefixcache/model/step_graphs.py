"""Captured steps: a step of decodes, or a hit's new tokens, replayed instead of launched kernel by kernel.

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
eagerly. A capture or a replay that raises does the same (the step then runs eagerly). Captured
steps are kept for the ``limit`` most recently used keys of each kind (decode steps, staged prompt
steps), so hits never evict the decode steps.

A prompt's tokens past its stored prefix prefilled alone in one step (a hit's; or a short prompt's)
launch as many kernels as a decode step, for one token's worth of first-token time. Such a step is *staged*
(``run(..., staged=True)``): the caller pads its tokens to a bucket (``bucket``: a power of two) and
points its one row at a staging slab of that bucket (``staging``), the same tensor for every step of
that bucket, then copies the real tokens' keys and values into the request's own KV. Its key is then
the bucket and the stored prefix it reads, which repeats whenever requests share a prefix and their new
tokens a bucket, in any order with other steps: a key seen ``repeats`` times is captured. A staged step
that fails to capture or replay switches staging off (``prefill_disabled``: its slabs freed, prompt steps
run unpadded and eagerly from then on); decode steps stay captured.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from prefixcache.model.hf_cache import CascadeCache, private_pool
from prefixcache.model.layout import KVLayout
from prefixcache.model.private_kv import PrivateKV

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
    """Decode steps and staged prompt steps captured by ``capture`` and replayed (see the module docstring)."""

    def __init__(self, forward: Forward, capture: Capture, repeats: int = 2, limit: int = 8,
                 staged_tokens: int = 0):
        """``staged_tokens``: the most new tokens a staged step may have (0: none is staged)."""
        if repeats < 1 or limit < 1 or staged_tokens < 0:
            raise ValueError("repeats and limit must be at least 1, staged_tokens at least 0")
        self._forward, self._capture, self.repeats, self.limit = forward, capture, repeats, limit
        self.staged_tokens = staged_tokens
        self._steps: OrderedDict[tuple, _Captured] = OrderedDict()
        self._last: tuple | None = None
        self._seen = 0
        self._staged_seen: OrderedDict[tuple, int] = OrderedDict()  # staged keys not captured yet: times seen
        self._staging: dict[int, PrivateKV] = {}  # by bucket
        #: Bytes of the staging slabs: kept as a number, as other threads read it while the loop adds a slab.
        self.staging_bytes = 0
        self.disabled: str | None = None  # why capturing was switched off
        self.prefill_disabled: str | None = None  # why capturing staged steps was switched off
        self.captures = self.replays = 0
        self.staged_captures = self.staged_replays = 0  # of those, staged prompt steps

    def bucket(self, tokens: int) -> int | None:
        """The padded length a staged step of ``tokens`` new tokens runs at (the next power of two, at
        least 16), or None when it is not staged (more than ``staged_tokens``, or staging is off)."""
        if self.prefill_disabled is not None or not 0 < tokens <= self.staged_tokens:
            return None
        return max(16, 1 << (tokens - 1).bit_length())

    def staging(self, bucket: int, layout: KVLayout) -> PrivateKV:
        """The staging slab of ``bucket`` tokens (made on first use; one per bucket, kept)."""
        kv = self._staging.get(bucket)
        if kv is None:
            kv = self._staging[bucket] = private_pool(layout, bucket).acquire(bucket)
            kv.reserve(bucket)
            self.staging_bytes += kv.pool.nbytes
        return kv

    def staging_cost(self, bucket: int, layout: KVLayout) -> int:
        """The bytes of KV a staged step of ``bucket`` tokens would add: its staging slab's, 0 once made."""
        return 0 if bucket in self._staging else bucket * layout.bytes_per_token

    def shed(self) -> None:
        """Free the staging slabs, with the staged steps captured over them (staging stays on: a slab is made
        again when a step of its bucket needs it)."""
        for key in [k for k in self._steps if k[0] == "staged"]:
            del self._steps[key]
        self._staged_seen.clear()
        self._staging.clear()
        self.staging_bytes = 0

    def run(self, cache: CascadeCache, ids: torch.Tensor, pos: torch.Tensor, keep: torch.Tensor,
            staged: bool = False) -> torch.Tensor:
        """Logits of the step: replayed when its shape was captured, else computed eagerly (and captured
        when the shape has repeated enough). ``staged``: a staged step (see the module docstring)."""
        off = self.prefill_disabled if staged else self.disabled
        key = None if off is not None else cache.step_key(own=staged)
        if key is None:
            return self._forward(ids, pos, cache, keep)
        key = ("staged" if staged else "decode", key)
        captured = self._steps.get(key)
        if captured is not None:
            for target, value in zip(captured.inputs, [ids, pos, keep, *cache.step_inputs()], strict=True):
                target.copy_(value)
            self._steps.move_to_end(key)
            try:
                logits = captured.replay()
            except Exception as exc:  # noqa: BLE001 - the step runs eagerly; capturing its kind goes off
                self._disable(key[0], f"replaying a {_kind(key)} failed: {type(exc).__name__}: {exc}")
                return self._forward(ids, pos, cache, keep)
            self.replays += 1
            self.staged_replays += staged
            return logits
        logits = self._forward(ids, pos, cache, keep)
        if staged:  # seen so often, in any order with other steps
            seen = self._staged_seen.pop(key, 0) + 1
            self._staged_seen[key] = seen
            while len(self._staged_seen) > 4 * self.limit:
                self._staged_seen.popitem(last=False)
        else:  # seen so often in a row
            seen = self._seen = self._seen + 1 if key == self._last else 1
            self._last = key
        if seen >= self.repeats:
            self._staged_seen.pop(key, None)
            self._capture_step(key, cache, ids, pos, keep, logits)
        return logits

    def _capture_step(self, key: tuple, cache: CascadeCache, ids: torch.Tensor, pos: torch.Tensor,
                      keep: torch.Tensor, logits: torch.Tensor) -> None:
        """Capture the step just run eagerly (its inputs as they are), replay it, and keep it if it gives
        the same logits. Writing the step's keys again is harmless: the same values at the same places."""
        kind = _kind(key)
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
            self._disable(key[0], f"capturing a {kind} failed: {type(exc).__name__}: {exc}")
            return
        differs = replay_difference(again, logits)
        if differs is not None:
            self._disable(key[0], f"a captured {kind} replayed {differs}")
            return
        self._steps[key] = _Captured(replay, [*inputs, *cache.step_inputs()], constant)
        self.captures += 1
        self.staged_captures += key[0] == "staged"
        kept = [k for k in self._steps if k[0] == key[0]]  # least recently used first
        for old in kept[: max(0, len(kept) - self.limit)]:  # each kind its own ``limit``: hits never evict decodes
            del self._steps[old]

    def _disable(self, kind: str, reason: str) -> None:
        """Switch capturing steps of ``kind`` ("decode" or "staged") off for good; the other kind's stay."""
        if kind == "staged":
            log.warning("%s; prompt steps run kernel by kernel from now on", reason)
            self.prefill_disabled = reason
            self.shed()
        else:
            log.warning("%s; decode steps run eagerly from now on", reason)
            self.disabled = reason
            for key in [k for k in self._steps if k[0] == kind]:
                del self._steps[key]


def _kind(key: tuple) -> str:
    return "staged prompt step" if key[0] == "staged" else "decode step"


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
