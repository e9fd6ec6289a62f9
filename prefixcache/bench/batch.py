"""transformers' own prefix sharing: ``model.generate_batch`` (continuous batching, paged KV).

All requests of a round go in one call, as its users would submit them. Per-request
TTFT comes from ``record_timestamps``: first token time minus the request's creation
time, so it includes the wait behind other requests in the same call (there is no
per-request arrival time in a batch call).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from prefixcache.bench.systems import Served

#: Tokens per page of transformers' paged cache (its default, 256).
PAGE_SIZE = 256


class BatchSystemError(RuntimeError):
    """generate_batch dropped or failed a request."""


@dataclass(frozen=True, slots=True)
class BatchCall:
    served: list[Served]  # in prompt order
    wall: float  # seconds for the whole call, set-up included
    kv_bytes: int  # peak KV held during the call (generate_batch: the paged pool it allocates)


class GenerateBatch:
    """``model.generate_batch(...)`` with ``ContinuousBatchingConfig(allow_block_sharing=...)``.

    The paged pool is sized to hold every request of the call unshared (on CPU its
    default is ~90 % of RAM and masks for 8,192-token batches, which takes seconds to set
    up); ``max_batch_tokens`` bounds one forward.
    """

    def __init__(self, model: torch.nn.Module, output_tokens: int, *, sharing: bool, max_batch_tokens: int,
                 bytes_per_token: int):
        self.model, self.output_tokens, self.sharing = model, output_tokens, sharing
        self.max_batch_tokens, self.bytes_per_token = max_batch_tokens, bytes_per_token
        self.name = "generate-batch" if sharing else "generate-batch-noshare"
        self.notes: list[str] = []

    def start(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def call(self, prompts: list[list[int]]) -> BatchCall:
        pad = self.model.generation_config.pad_token_id
        # A fresh config per call: generate_batch writes eos_token_id=-1 ("disabled") into it.
        config = GenerationConfig(max_new_tokens=self.output_tokens, do_sample=False, eos_token_id=None,
                                  pad_token_id=0 if pad is None else pad)
        blocks = sum(math.ceil((len(p) + self.output_tokens) / PAGE_SIZE) for p in prompts) + 1
        cb = ContinuousBatchingConfig(allow_block_sharing=self.sharing, num_blocks=blocks, page_size=PAGE_SIZE,
                                      max_batch_tokens=self.max_batch_tokens)
        quiet = logging.getLogger("ContinuousBatchingLogger")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # "eos_token_id not set, disabled": intended here
        try:
            t0 = time.perf_counter()
            outs = self.model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb,
                                             record_timestamps=True, progress_bar=False, warmup=False)
            wall = time.perf_counter() - t0
        finally:
            quiet.setLevel(level)
        results = list(outs.values())
        bad = [r.request_id for r in results if r.error is not None or not r.timestamps]
        if len(results) != len(prompts) or bad:
            raise BatchSystemError(f"generate_batch returned {len(results)}/{len(prompts)} results; failed: {bad}")
        served = [Served(tuple(r.generated_tokens), r.timestamps[0] - r.created_time,
                         r.timestamps[-1] - r.created_time, None) for r in results]
        return BatchCall(served, wall, blocks * PAGE_SIZE * self.bytes_per_token)
