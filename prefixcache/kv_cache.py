"""Every contact with `transformers` cache internals lives here (they change between releases).

A request's KV lives in one working buffer ``[L, 2, H, capacity, D]`` per request
(batch size 1). The matched prefix is copied in once from the immutable snapshots;
new tokens are written in place, so there is no ``torch.cat`` per decode step and the
snapshots are never written. Published snapshots are slices cloned out of it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs

log = logging.getLogger(__name__)


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


class UnsupportedModelError(RuntimeError):
    """The model's cache layout cannot be shared as plain per-layer KV; serve uncached."""


def probe_layout(model: torch.nn.Module) -> KVLayout:
    """Run one token through the model to learn its KV shapes; raise if they are not plain KV."""
    config = model.config.get_text_config(decoder=True)
    layer_types, kwargs = get_layer_types_and_kwargs(config)
    windows = []
    for kind, kw in zip(layer_types, kwargs):
        if kind in ("sliding_attention", "chunked_attention"):
            windows.append(int(kw["sliding_window"]))
        elif kind != "full_attention":
            raise UnsupportedModelError(f"layer type {kind!r} is not plain attention KV")
    device = next(model.parameters()).device
    probe = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), past_key_values=probe, use_cache=True)
    shapes = {tuple(layer.keys.shape) for layer in probe.layers}
    if len(shapes) != 1 or any(type(layer) is not DynamicLayer for layer in probe.layers):
        raise UnsupportedModelError(f"layers differ in KV shape or type: {sorted(shapes)}")
    _, heads, _, head_dim = shapes.pop()
    k = probe.layers[0].keys
    # A sliding window equals full attention while the sequence fits inside it.
    limit = min(windows) if windows else None
    return KVLayout(len(probe.layers), heads, head_dim, k.dtype, k.device, limit)


class _BufferLayer(DynamicLayer):
    """One layer's view of the shared working buffer."""

    def __init__(self, owner: WorkingCache, index: int):
        super().__init__()
        self._owner, self._index = owner, index
        self.length = owner.prefix_len

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [1, H, n, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        buf = self._owner.reserve(end)
        buf[self._index, 0, :, self.length : end].copy_(key_states[0])
        buf[self._index, 1, :, self.length : end].copy_(value_states[0])
        self.length = end
        self.keys = buf[self._index, 0, :, :end].unsqueeze(0)
        self.values = buf[self._index, 1, :, :end].unsqueeze(0)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("prefixcache working caches are not croppable")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("prefixcache working caches hold one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("prefixcache working caches hold one sequence")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("prefixcache working caches hold one sequence")


class WorkingCache(DynamicCache):
    """A request's ``past_key_values``: the copied prefix plus its own new tokens."""

    def __init__(self, layout: KVLayout, segments: Sequence[tuple[torch.Tensor, int]], capacity: int):
        """``segments``: snapshot tensors ``[L, 2, H, n, D]`` and how many leading tokens of each to use."""
        self.layout = layout
        self.prefix_len = sum(used for _, used in segments)
        cap = max(capacity, self.prefix_len + 1)
        self._buf = torch.empty((layout.num_layers, 2, layout.num_kv_heads, cap, layout.head_dim),
                                dtype=layout.dtype, device=layout.device)
        pos = 0
        for snap, used in segments:
            self._buf[:, :, :, pos : pos + used].copy_(snap[:, :, :, :used])
            pos += used
        Cache.__init__(self, layers=[_BufferLayer(self, i) for i in range(layout.num_layers)])

    def reserve(self, end: int) -> torch.Tensor:
        """The buffer, grown (doubling) if ``end`` tokens do not fit."""
        cap = self._buf.shape[3]
        if end > cap:
            grown = torch.empty((*self._buf.shape[:3], max(end, 2 * cap), self._buf.shape[4]),
                                dtype=self._buf.dtype, device=self._buf.device)
            grown[:, :, :, :cap].copy_(self._buf)
            self._buf = grown
        return self._buf

    @property
    def length(self) -> int:
        """Tokens whose KV every layer holds."""
        return min(layer.length for layer in self.layers)

    def slice(self, start: int, end: int) -> torch.Tensor:
        """A fresh tensor ``[L, 2, H, end-start, D]`` with the KV of tokens [start, end)."""
        if not 0 <= start < end <= self.length:
            raise IndexError(f"slice [{start}, {end}) outside cached length {self.length}")
        return self._buf[:, :, :, start:end].clone()

    @property
    def buffer_bytes(self) -> int:
        return self._buf.untyped_storage().nbytes()
