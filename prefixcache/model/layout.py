"""Shape of a model's per-token KV (what the store and the pools allocate)."""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one token's KV across the model; fixed per model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    #: Longest sequence for which every layer attends to all previous tokens (None = unbounded).
    full_attention_limit: int | None

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def window_reason(self, total_tokens: int) -> str | None:
        """Why a sequence of up to ``total_tokens`` cannot reuse stored KV exactly, or None.

        Beyond a sliding window a layer forgets the oldest tokens, which a shared
        full-length snapshot cannot reproduce.
        """
        limit = self.full_attention_limit
        if limit is not None and total_tokens > limit:
            return f"sequence of up to {total_tokens} tokens exceeds the sliding window ({limit})"
        return None


def long_tensor(values: Sequence[int]) -> torch.Tensor:
    """A long CPU tensor of the ints ``values``, through ``array`` (several times faster than ``torch.tensor``
    on a long list). Raises ``TypeError`` for anything but ints, ``OverflowError`` beyond 64 bits."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long)


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """A long tensor of ``values`` on ``device``. On CUDA through pinned memory without waiting: a copy
    from pageable memory drains the stream first, and a step makes several of these per forward."""
    host = long_tensor(values)
    if device.type != "cuda":
        return host if device.type == "cpu" else host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
