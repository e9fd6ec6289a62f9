"""One batched step: the requests' new tokens in, the sampling rows' logits out.

The runner owns the tensors of a step: it packs every request's new tokens into one
sequence, builds the ``CascadeCache`` that routes each request's attention over its shared
prefix snapshots (read in place) and its private KV, and runs one forward: the model's own
forward (``cascade_step``). With a ``Capture`` (CUDA graphs on CUDA), steps of decodes whose
shape repeats are captured and replayed (``StepGraphs``), and so are steps of one request's prompt
tokens past its stored prefix, all of them alone in one step, at most ``staged_tokens`` (a hit's new
tokens): those run *staged*, padded to a bucket over a staging slab, whether replayed or not, so a
prompt gets the same answer before and after its shape is captured.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from prefixcache.errors import UnsupportedModelError
from prefixcache.model.cascade import kernels_for
from prefixcache.model.hf_cache import CascadeCache, CascadeRow, cascade_step
from prefixcache.model.layout import KVLayout, index_tensor
from prefixcache.model.step_graphs import Capture, StepGraphs
from prefixcache.serving.request import Request


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, capture: Capture | None = None,
                 captured_steps: int = 8, staged_tokens: int = 0,
                 room: Callable[[int], bool] = lambda nbytes: True):
        """``capture``: how steps are captured (None: every step runs eagerly); ``captured_steps``: how
        many step shapes stay captured (the most recently used); ``staged_tokens``: the most new tokens
        of a prompt step that is staged (0: none; only with a ``capture``); ``room``: whether that many
        more bytes of KV (a new staging slab) fit the KV total, reserved there if so (a step whose slab
        does not fit runs unstaged)."""
        self.model, self.layout, self._room = model, layout, room
        self.kernels = kernels_for(layout.device, layout.dtype, layout.head_dim)  # attention calls, one per model
        self.graphs = None if capture is None else StepGraphs(self._forward, capture, limit=captured_steps,
                                                               staged_tokens=staged_tokens)
        self.steps = 0

    def run(self, plan: Sequence[tuple[Request, int]]) -> torch.Tensor:
        """One packed forward of ``plan`` ((request, new tokens) pairs); returns logits [K, V] for the
        K requests whose prompt is complete after this step (they sample), in plan order."""
        if len(plan) == 1 and self.graphs is not None:
            req, n = plan[0]
            bucket = self.graphs.bucket(n)
            if (bucket is not None and req.prefilling and req.private.length == 0
                    and req.held_len + n == len(req.prompt) and self._slab_fits(bucket)):
                return self._run_staged(req, n, bucket)
        ids, pos, rows, keep, at = [], [], [], [], 0
        for req, n in plan:
            start = req.held_len
            new = req.prompt[start : start + n] if req.prefilling else [req.output[-1]]
            req.private.reserve(req.private.length + n)
            rows.append(CascadeRow(req.segments, req.private, req.private.length, n))
            ids.extend(new)
            pos.extend(range(start, start + n))
            at += n
            if start + n >= len(req.prompt):
                keep.append(at - 1)
        cache = CascadeCache(rows, self.layout.num_layers, self.kernels, whole_decodes=self.graphs is not None)
        device = self.layout.device
        packed = index_tensor([*ids, *pos, *keep], device)  # one copy to the device
        ids_t, pos_t, keep_t = packed[: at], packed[at : 2 * at], packed[2 * at :]  # [T], [T] packed; [K]
        with torch.inference_mode():
            if self.graphs is None:
                logits = self._forward(ids_t, pos_t, cache, keep_t)
            else:
                logits = self.graphs.run(cache, ids_t, pos_t, keep_t)
        self.steps += 1
        return logits.clone()  # [K, V], a normal tensor for the samplers (a replay refills its output)

    def _slab_fits(self, bucket: int) -> bool:
        """Whether ``bucket``'s staging slab is made, or fits the KV total (``room``: reserved there then)."""
        cost = self.graphs.staging_cost(bucket, self.layout)
        return cost == 0 or self._room(cost)

    def _run_staged(self, req: Request, n: int, bucket: int) -> torch.Tensor:
        """The last ``n`` prompt tokens of ``req`` (which holds no private tokens yet), staged: padded to
        ``bucket`` with copies of the last token at its position (the causal mask keeps them from every
        real row) over the bucket's staging slab, whose first ``n`` tokens are then copied to ``req``'s
        private KV. Logits [1, V] of its last real token."""
        start = req.held_len
        new = req.prompt[start : start + n]
        staging = self.graphs.staging(bucket, self.layout)
        req.private.reserve(n)
        cache = CascadeCache([CascadeRow(req.segments, staging, 0, bucket)], self.layout.num_layers, self.kernels)
        pad = bucket - n
        packed = index_tensor([*new, *[new[-1]] * pad, *range(start, start + n), *[start + n - 1] * pad, n - 1],
                              self.layout.device)
        with torch.inference_mode():
            logits = self.graphs.run(cache, packed[:bucket], packed[bucket : 2 * bucket], packed[2 * bucket :],
                                     staged=True)
            req.private.place(0, staging.window(0, n))
        self.steps += 1
        return logits.clone()

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, cache: CascadeCache, keep: torch.Tensor) -> torch.Tensor:
        before = cache.calls
        logits = cascade_step(self.model, ids, pos, cache, keep)
        if cache.calls - before != self.layout.num_layers:
            raise UnsupportedModelError(f"cascade attention ran in {cache.calls - before} of "
                                        f"{self.layout.num_layers} layers")
        return logits
