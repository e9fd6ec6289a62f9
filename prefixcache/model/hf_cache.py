"""Every contact with `transformers` cache internals lives here (they change between releases).

A request's KV lives in one working buffer ``[L, 2, H, capacity, D]`` per request
(batch size 1). The matched prefix is copied in once from the immutable snapshots;
new tokens are written in place, so there is no ``torch.cat`` per decode step and the
snapshots are never written. Published snapshots are slices cloned out of it.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache, PreTrainedConfig
from transformers.cache_utils import Cache, DynamicLayer, get_layer_types_and_kwargs
from transformers.utils import ModelOutput

from prefixcache.cache.runs import coalesce
from prefixcache.errors import UnsupportedModelError
from prefixcache.model.blend import ShiftTable, rerotate
from prefixcache.model.cascade import AttentionKernels, attend_groups, member_rows
from prefixcache.model.layout import KVLayout
from prefixcache.model.precision import AttentionError, attention_error
from prefixcache.model.private_kv import PrivateKV, PrivatePool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Probe:
    """A model's KV layout, or (``layout`` None) why its KV cannot be cached. Probed once per model."""

    layout: KVLayout | None
    unsupported_reason: str | None = None


def probe(model: torch.nn.Module) -> Probe:
    """``probe_layout``, with a model it refuses logged (once) and reported, not raised."""
    try:
        return Probe(probe_layout(model))
    except UnsupportedModelError as exc:
        log.warning("prefix caching disabled for this model: %s", exc)
        return Probe(None, str(exc))


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
        segments = coalesce(segments)
        length = sum(used for _, used in segments)
        buffer = torch.empty((layout.num_layers, 2, layout.num_kv_heads, max(capacity, length + 1), layout.head_dim),
                             dtype=layout.dtype, device=layout.device)
        pos = 0
        for snap, used in segments:
            buffer[:, :, :, pos : pos + used].copy_(snap[:, :, :, :used])
            pos += used
        self._own(layout, buffer, length)

    @classmethod
    def adopt(cls, layout: KVLayout, buffer: torch.Tensor, length: int) -> WorkingCache:
        """A working cache over ``buffer`` itself (no copy), which it then owns: its first ``length`` tokens
        are the prefix, the rest of its room is for new tokens."""
        expected = (layout.num_layers, 2, layout.num_kv_heads)
        if tuple(buffer.shape[:3]) != expected or buffer.dim() != 5 or not 0 <= length <= buffer.shape[3]:
            raise ValueError(f"cannot adopt a {tuple(buffer.shape)} buffer with {length} tokens for layout {expected}")
        cache = cls.__new__(cls)
        cache._own(layout, buffer, length)
        return cache

    def _own(self, layout: KVLayout, buffer: torch.Tensor, length: int) -> None:
        self.layout, self._buf, self.prefix_len = layout, buffer, length
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

    def view(self, start: int, end: int) -> torch.Tensor:
        """``slice`` without the copy: valid until the cache grows or is written there."""
        if not 0 <= start < end <= self.length:
            raise IndexError(f"view [{start}, {end}) outside cached length {self.length}")
        return self._buf[:, :, :, start:end]

    @property
    def buffer_bytes(self) -> int:
        return self._buf.untyped_storage().nbytes()

    def to_dynamic(self, config: PreTrainedConfig) -> DynamicCache:
        """A ``DynamicCache`` as ``generate()`` builds one for a model of ``config``, holding a copy of the KV
        of tokens [0, length): tensors of its own (``DynamicLayer.update`` concatenates), none into the buffer."""
        copy = DynamicCache(config=config.get_text_config(decoder=True))
        if self.length:
            kv = self.view(0, self.length)  # [L, 2, H, n, D]
            for i in range(self.layout.num_layers):
                copy.update(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0), i)
        return copy


def hand_out(output: ModelOutput, cache: WorkingCache, config: PreTrainedConfig) -> None:
    """Replace ``cache`` in ``generate()``'s ``output`` (a ``ModelOutput``: ``return_dict_in_generate``) by its
    ``to_dynamic`` copy, so the caller holds what ``generate()`` returns and never the engine's working buffer,
    which is then freed (its bytes are reserved only while the call runs). The field is ``cache`` or, before
    transformers renamed it, ``past_key_values``: whichever holds ``cache``."""
    for key in [k for k, v in output.items() if v is cache]:
        output[key] = cache.to_dynamic(config)


# -- cascade (continuous batching) contact -------------------------------------------
# A packed forward runs all active requests as one sequence of T rows (batch 1). The
# model writes each request's new K/V through ``CascadeCache.update`` into its
# ``PrivateKV``; the registered attention function reads the stored prefix snapshots in
# place (never written) plus the private KV, via ``cascade.cascade_attention``.

CASCADE_KWARG = "prefixcache_cascade"  # forward kwarg carrying the CascadeCache to attention


@dataclass(frozen=True, slots=True)
class CascadeRow:
    """One request's part of a packed forward: prefix snapshots read in place, private KV written."""

    segments: Sequence[tuple[torch.Tensor, int]]  # (snapshot [L, 2, H, n, D], tokens used)
    private: PrivateKV
    start: int  # private tokens held before this forward
    count: int  # new tokens (packed rows) in this forward


def private_pool(layout: KVLayout, chunk: int, plan_ahead: bool = False) -> PrivatePool:
    """An empty pool of private KV shaped for ``layout`` (capacity grows by ``chunk`` tokens; see ``PrivatePool``)."""
    return PrivatePool(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.device, chunk,
                       plan_ahead)


class _CascadeLayer(DynamicLayer):
    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0  # the mask transformers builds is ignored by cascade attention


class CascadeCache(Cache):
    """``past_key_values`` of one packed forward over several requests (see ``CascadeRow``)."""

    def __init__(self, rows: Sequence[CascadeRow], num_layers: int, kernels: AttentionKernels | None = None,
                 whole_decodes: bool = False):
        """``kernels``: the device's attention calls (``cascade.kernels_for``; None: chosen per call).
        ``whole_decodes``: pooled decodes attend over their slots' whole capacity, so a step of decodes
        has the same shapes as the previous one while nobody joins or leaves (``step_key``)."""
        super().__init__(layers=[_CascadeLayer() for _ in range(num_layers)])
        self.kernels = kernels
        self.rows = list(rows)
        self.spans, pos = [], 0
        for row in self.rows:
            self.spans.append((pos, pos + row.count))
            pos += row.count
        # Segments read by exactly the same requests form a group: attention is order-free
        # over keys (positions are already in them), so a group's blocks are coalesced into
        # runs (blocks stored by one insert are one tensor) and cost one call per run and layer.
        members_of: dict[tuple[int, int], tuple[torch.Tensor, int, list[int]]] = {}
        for i, row in enumerate(self.rows):
            for snap, used in row.segments:
                members_of.setdefault((id(snap), used), (snap, used, []))[2].append(i)
        groups: dict[tuple[int, ...], list[tuple[torch.Tensor, int]]] = {}
        for snap, used, members in members_of.values():
            groups.setdefault(tuple(members), []).append((snap, used))
        self.groups = [(members, coalesce(segments)) for members, segments in groups.items()]
        self.calls = 0

        # Requests decoding one token are served per pool: one write and one attention call.
        pools: dict[int, tuple[PrivatePool, list[PrivateKV], list[int]]] = {}
        for row, (s, e) in zip(self.rows, self.spans):
            if row.count == 1 and row.start == row.private.length:
                entry = pools.setdefault(id(row.private.pool), (row.private.pool, [], []))
                entry[1].append(row.private)
                entry[2].append(s)
        self.decoding = [pool.decode_group(members, rows, whole_decodes) for pool, members, rows in pools.values()]
        self.batched = {id(kv) for _, members, _ in pools.values() for kv in members}
        self.own = [(s, e, row) for row, (s, e) in zip(self.rows, self.spans) if id(row.private) not in self.batched]
        self.masks: dict[tuple[int, int], torch.Tensor] = {}  # causal masks of prefill chunks, for every layer
        self._plan: list | None = None  # per group: query rows, its runs' keys/values [L, H, n, D] (first attend)

    def plan(self, device: torch.device) -> None:
        """Build what attention needs that does not depend on the layer, once (the first layer does it, or
        whoever needs it first)."""
        if self._plan is not None:
            return
        total = self.spans[-1][1] if self.spans else 0
        self._plan = [(member_rows(members, self.spans, total, device),
                       [(snap[:, 0, :, :used], snap[:, 1, :, :used]) for snap, used in segments])
                      for members, segments in self.groups]

    def step_key(self, own: bool = False) -> tuple | None:
        """What fixes every shape and address a forward over this cache reads, or None when it is not a
        step of pooled decodes only (``own``: or of rows writing their private KV, as a staged prompt's:
        their slabs, slots and positions are in the key). Two caches with equal keys run the same kernels
        on the same tensors (stored snapshots, pool slabs) and differ only in ``step_inputs()``: a step
        captured over one replays for the other once those are copied over."""
        if (self.own and not own) or not (self.decoding or self.own):
            return None
        total = self.spans[-1][1]

        def where(t: torch.Tensor) -> tuple:
            return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype

        groups = tuple((members, tuple((where(snap), used) for snap, used in segments))
                       for members, segments in self.groups)
        # The slab each group was built over (a view of it in the template: the pool may have moved on since).
        decoding = tuple((d.template.keys.data_ptr(), tuple(d.shape), d.slots, d.rows, d.end) for d in self.decoding)
        owned = tuple((s, e, where(row.private.pool.slab), row.private.slot, row.start) for s, e, row in self.own)
        return total, groups, decoding, owned

    def step_inputs(self) -> list[torch.Tensor]:
        """The tensors whose values change from step to step under one ``step_key``: the pooled decodes'
        masks and write targets."""
        return [t for d in self.decoding for t in (d.template.mask, d.targets)]

    def step_constants(self, device: torch.device) -> list[torch.Tensor]:
        """The index tensors a captured step reads that equal ``step_key``s make equal (planned if not yet)."""
        self.plan(device)
        constant = [rows for rows, _ in self._plan if rows is not None]
        return constant + [t for d in self.decoding for t in (d.template.rows, d.template.slots) if t is not None]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [1, H, T, D] packed; each request's rows go to its private KV
        for group in self.decoding:
            group.write(layer_idx, key_states[0], value_states[0])
        for s, e, row in self.own:
            row.private.write(layer_idx, row.start, key_states[0, :, s:e], value_states[0, :, s:e])
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """query: [1, Hq, T, D] → attention output [1, T, Hq, D] (the layout attention functions return)."""
        # One call per stored run (a view, never a copy): copying a chain of runs into one key
        # set per layer per step costs more than the extra calls and merges. What does not
        # depend on the layer (query rows of each group, the runs' views) is planned once.
        self.plan(query.device)
        groups = [(rows, [(keys[layer], values[layer]) for keys, values in runs]) for rows, runs in self._plan]
        own = [(s, e, *row.private.view(layer, row.start + row.count)) for s, e, row in self.own]
        batches = [group.batch(layer) for group in self.decoding]
        out = attend_groups(query[0], groups, own, scale, batches, self.masks, self.kernels)  # [Hq, T, D]
        self.calls += 1
        return out.transpose(0, 1).unsqueeze(0)


def _cascade_forward(module, query, key, value, attention_mask, *args, delegate=None, **kwargs):
    cache = kwargs.pop(CASCADE_KWARG, None)
    if cache is None:  # not a packed forward: behave exactly as the model's own implementation
        return delegate(module, query, key, value, attention_mask, *args, **kwargs)
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise UnsupportedModelError("cascade attention has no softcap or attention sinks")
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    return cache.attend(module.layer_idx, query, scale), None


def enable_cascade_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to cascade-capable attention (idempotent; same results for ordinary calls).

    Registers ``prefixcache_cascade`` (delegating to SDPA unless a forward carries a
    ``CascadeCache``) and its mask function. Raises ``UnsupportedModelError`` if the
    model does not dispatch attention through ``AttentionInterface`` or is not on SDPA.
    """
    from functools import partial

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = "prefixcache_cascade"
    current = model.config._attn_implementation
    if current == name:
        return
    if current != "sdpa":
        raise UnsupportedModelError(f"attention implementation {current!r} (cascade delegates to 'sdpa' only)")
    AttentionInterface.register(name, partial(_cascade_forward, delegate=sdpa_attention_forward))
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise UnsupportedModelError(f"{type(model).__name__} cannot switch its attention implementation")


def cascade_step(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: CascadeCache,
                 keep: torch.Tensor) -> torch.Tensor:
    """One packed step through the model's own forward. input_ids, position_ids: [T]; keep: [K] rows
    that sample. Returns logits [K, V]."""
    return model(input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), past_key_values=cache,
                 use_cache=True, logits_to_keep=keep, **{CASCADE_KWARG: cache}).logits[0]


class _TracedCascadeCache(CascadeCache):
    """A ``CascadeCache`` that keeps, per layer, the new keys/values and queries it got and what attention returned."""

    def __init__(self, rows: Sequence[CascadeRow], num_layers: int):
        super().__init__(rows, num_layers)
        self.new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # [H, T, D] each
        self.attended: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # q, out [Hq, T, D]; scale

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.new_kv[layer_idx] = (key_states[0].clone(), value_states[0].clone())
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def attend(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        out = super().attend(layer, query, scale)
        self.attended[layer] = (query[0].clone(), out[0].transpose(0, 1).clone(), scale)
        return out

    def request_kv(self, layer: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(start, end, keys [H, n, D], values) of each request at ``layer``, its own rows last: rebuilt from
        the prefix snapshots and the new rows as the model passed them, not read back from the private KV
        this step wrote (so a write to the wrong place shows). Tokens held from earlier steps are read."""
        k_new, v_new = self.new_kv[layer]
        out = []
        for row, (s, e) in zip(self.rows, self.spans):
            held_k, held_v = row.private.view(layer, row.start)
            keys = [snap[layer, 0, :, :used] for snap, used in row.segments] + [held_k, k_new[:, s:e]]
            values = [snap[layer, 1, :, :used] for snap, used in row.segments] + [held_v, v_new[:, s:e]]
            out.append((s, e, torch.cat(keys, 1), torch.cat(values, 1)))
        return out


@dataclass(frozen=True, slots=True)
class CascadeMeasure:
    """What ``check_cascade`` judges: one packed step against plain forwards of the same requests."""

    got: torch.Tensor  # float32 logits [K, V] of the packed cascade step
    want: torch.Tensor  # float32 logits [K, V] of plain forwards, one per request
    sequences: list[list[int]]  # the plain forwards' token ids; their logits from ``prefix_len`` on are ``want``
    prefix_len: int
    calls: int  # layers whose attention ran through the cascade
    inputs: float  # layer 0: max |new K/V of the step - the plain forward's| / max |the plain forward's|
    layers: list[AttentionError]  # per layer, on the inputs it got in the step
    machinery: AttentionError  # the cascade machinery in float32 on random data of the model's head shapes

    @property
    def exact(self) -> float:
        """The machinery's max error / max |reference| (float32)."""
        return self.machinery.cascade / self.machinery.scale


def measure_cascade(model: torch.nn.Module, layout: KVLayout,
                    forward: Callable[[torch.Tensor, torch.Tensor, CascadeCache, torch.Tensor], torch.Tensor] | None
                    = None, rows: int = 4) -> CascadeMeasure:
    """Run the step ``check_cascade`` checks (arguments as there) and measure it."""
    device = layout.device
    prefix, suffixes = list(range(1, 7)), [[7, 8, 9], [10]] + [[11 + i] for i in range(max(0, rows - 4))]
    probe = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix], device=device), past_key_values=probe, use_cache=True)
    snap = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in probe.layers])  # [L, 2, H, 6, D]
    requests = []
    pool = private_pool(layout, 4)
    for suffix in suffixes:
        private = pool.acquire()
        private.reserve(len(suffix))
        requests.append(CascadeRow([(snap, len(prefix))], private, 0, len(suffix)))
    cache = _TracedCascadeCache(requests, layout.num_layers)
    ids = [t for s in suffixes for t in s]
    pos = [len(prefix) + i for s in suffixes for i in range(len(s))]
    ids_t, pos_t = torch.tensor(ids, device=device), torch.tensor(pos, device=device)
    sequences = [prefix + s for s in suffixes]
    plain = [DynamicCache() for _ in sequences]
    with torch.no_grad():
        keep = torch.arange(len(ids), device=device)
        got = forward(ids_t, pos_t, cache, keep) if forward is not None else cascade_step(model, ids_t, pos_t,
                                                                                             cache, keep)
        want = torch.cat([model(input_ids=torch.tensor([seq], device=device), past_key_values=kv,
                                use_cache=True).logits[0, len(prefix):] for seq, kv in zip(sequences, plain)])
    if 0 not in cache.new_kv or not cache.attended:
        raise UnsupportedModelError("the model's attention does not go through the cascade cache")
    inputs = 0.0
    for which in (0, 1):  # keys, values
        step = cache.new_kv[0][which]
        mine = torch.cat([(kv.layers[0].keys, kv.layers[0].values)[which][0, :, len(prefix):] for kv in plain], 1)
        inputs = max(inputs, float((step.float() - mine.float()).abs().max() / mine.float().abs().max()))
    layers = [attention_error(*cache.attended[i][:2], cache.request_kv(i), cache.attended[i][2])
              for i in sorted(cache.attended) if i in cache.new_kv]
    heads, scale = cache.attended[0][0].shape[0], cache.attended[0][2]
    return CascadeMeasure(got.float(), want.float(), sequences, len(prefix), cache.calls, inputs, layers,
                          _machinery_error(layout, heads, scale))


def _machinery_error(layout: KVLayout, heads: int, scale: float) -> AttentionError:
    """Errors, against float64, of one float32 cascade layer on random data of the model's head
    shapes and device, through every path a step takes: a prefill chunk and decodes sharing a prefix,
    a decode that reads fewer tokens of it, one after tokens held from earlier steps, and a chunk after
    held tokens on a prefix of its own (private writes, the pooled decode call, causal masks, merges);
    then, as a step of its own, a prompt alone over its own keys (one call where the kernels have it).
    The worse of the two steps, in float32 rounding units (NaN worst of all)."""
    hkv, dim, device = layout.num_kv_heads, layout.head_dim, layout.device
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device)

    one = replace(layout, num_layers=1, dtype=torch.float32)
    shared, other = rand(1, 2, hkv, 6, dim), rand(1, 2, hkv, 3, dim)  # [L, 2, H, n, D] snapshots
    pool = private_pool(one, 4)
    # (segments, private tokens held before the step, new rows)
    plan = [([(shared, 6)], 0, 3), ([(shared, 6)], 0, 1), ([(shared, 4)], 2, 1), ([(other, 3)], 1, 2)]
    rows = []
    for segments, held, count in plan:
        private = pool.acquire(held + count)
        if held:
            private.load(rand(1, 2, hkv, held, dim))
        private.reserve(held + count)
        rows.append(CascadeRow(segments, private, held, count))
    alone = private_pool(one, 4).acquire(5)
    alone.reserve(5)
    errors = []
    for step_rows in (rows, [CascadeRow([], alone, 0, 5)]):
        cache = _TracedCascadeCache(step_rows, 1)
        total = sum(row.count for row in step_rows)
        cache.update(rand(1, hkv, total, dim), rand(1, hkv, total, dim), 0)
        cache.attend(0, rand(1, heads, total, dim), scale)
        q, out, _ = cache.attended[0]
        errors.append(attention_error(q, out, cache.request_kv(0), scale))
    return max(errors, key=lambda e: math.inf if math.isnan(e.units(torch.float32)) else e.units(torch.float32))


def check_cascade(model: torch.nn.Module, layout: KVLayout,
                  forward: Callable[[torch.Tensor, torch.Tensor, CascadeCache, torch.Tensor], torch.Tensor] | None
                  = None, rows: int = 4) -> None:
    """Compare one packed cascade forward with plain forwards on a few tokens; raise if they differ.

    Catches architectures whose attention does not route through the registered
    function (or differs in some way we do not model), so they fall back instead of being wrong.
    ``forward(input_ids [T], position_ids [T], cache, keep [K]) -> logits [K, V]`` is checked
    instead of the model's own forward when given (tests pass deliberately broken ones).
    ``rows``: packed rows of the checked step (at least 4); beyond 4 they are one-token requests
    decoding together, so a forward whose products depend on the row count is checked at that count.

    Criterion (``measure_cascade`` measures it; margins measured in docs/correctness.md). Attention
    is judged by one statistic, an error in *rounding units*: max |cascade - float64| over the
    layer's outputs divided by the larger of plain attention's own max error in the same dtype and
    one rounding of the largest output, ``eps(dtype) * max |float64|`` (``AttentionError.units``).
    A healthy cascade rounds like plain attention, a few units at most on every kernel level and
    device measured; a logic error on the step's tiny contexts moves outputs by a large fraction
    of themselves, thousands of units in float32. Parts of the check:

    - routing: every layer's attention runs through the cascade, and the layer-0 keys/values of
      the step equal the plain forwards' at the same tokens to within ``8 * eps(dtype)`` of their
      largest (rows and positions: a shifted position moves rotary keys by their own size);
    - the cascade machinery itself (private writes, pooled decodes, causal chunks, shared and
      partial prefixes, merges, the GQA head mapping) on random data of the model's head shapes
      in float32, whatever the model's dtype: at most ``ROUNDING_FACTOR`` (64) units. This is what
      catches logic errors when the model runs in bfloat16/float16, whose unit (1/128 or 1/1024
      of the largest output) is too coarse to tell every logic error from rounding;
    - every layer, on the inputs it got: at most ``rounding_factor(dtype)`` units in the model's
      dtype, 64 in float32, 16 in bfloat16/float16 (``AttentionError.within``);
    - float32 and wider: the logits also agree to 1e-3 of the largest (the whole forward, rounding
      there is far smaller). In bfloat16/float16 logits are not compared: rounding alone moves
      them by units after a few dozen layers, on each path differently.
    """
    m = measure_cascade(model, layout, forward, rows)
    dtype = layout.dtype
    if m.calls != layout.num_layers or len(m.layers) != layout.num_layers:
        raise UnsupportedModelError(f"cascade attention ran in {m.calls} of {layout.num_layers} layers")
    if not m.inputs <= 8 * torch.finfo(dtype).eps:
        raise UnsupportedModelError(f"the packed step's layer-0 keys/values differ from a plain forward's by "
                                    f"{m.inputs:.3g} of their largest (wrong rows or positions)")
    if not m.machinery.within(torch.float32):
        raise UnsupportedModelError("cascade attention in float32 on random data of the model's head shapes is "
                                    + m.machinery.describe(torch.float32))
    for i, err in enumerate(m.layers):
        if not err.within(dtype):
            raise UnsupportedModelError(f"cascade attention in layer {i} is {err.describe(dtype)}")
    if torch.finfo(dtype).bits >= 32:
        err = float((m.got - m.want).abs().max())
        tol = 1e-3 * max(1.0, float(m.want.abs().max()))
        if not err <= tol:
            raise UnsupportedModelError(f"cascade self-check differs from plain attention by {err:.3g} "
                                        f"(tolerance {tol:.3g})")


# -- chunk blending contact -----------------------------------------------------------
# A blend forward runs some of a prompt's tokens (any positions, in order) through the
# model's own forward against the request's whole KV buffer ``[L, 2, H, n, D]``: each layer
# writes the rows' new K/V at their positions, then their queries attend to every key at or
# before their own position, whether it was reused, recomputed or prefilled.

class _StopForward(Exception):
    """Raised by ``BlendCache.update`` at its stop layer: the rest of the forward is not needed."""


class BlendCache(Cache):
    """``past_key_values`` of a blend forward over ``buffer`` (written in place at ``positions``)."""

    def __init__(self, buffer: torch.Tensor, positions: torch.Tensor, stop_layer: int | None = None):
        """``buffer``: ``[L, 2, H, n, D]``; ``positions``: long ``[T]``, increasing, the rows' places in it.
        With ``stop_layer`` the forward ends after writing that layer; ``previous`` then holds the KV
        ``[2, H, T, D]`` the rows had there before it was overwritten."""
        super().__init__(layers=[_CascadeLayer() for _ in range(buffer.shape[0])])
        self.buffer, self.positions, self.stop_layer = buffer, positions, stop_layer
        self.end = int(positions[-1]) + 1  # keys beyond the last row are never read
        self.visible = torch.arange(self.end, device=buffer.device)[None, :] <= positions[:, None]  # [T, end]
        self.previous: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # key_states: [1, H, T, D]
        if layer_idx == self.stop_layer:
            self.previous = self.buffer[layer_idx, :, :, self.positions].clone()
        self.buffer[layer_idx, 0, :, self.positions] = key_states[0].to(self.buffer.dtype)
        self.buffer[layer_idx, 1, :, self.positions] = value_states[0].to(self.buffer.dtype)
        if layer_idx == self.stop_layer:
            raise _StopForward
        return key_states, value_states

    def attend(self, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor:
        """query: [1, Hq, T, D] → [1, T, Hq, D] over the buffer's keys up to each row's position."""
        keys = self.buffer[None, layer, 0, :, : self.end].to(query.dtype)  # [1, H, end, D]
        values = self.buffer[None, layer, 1, :, : self.end].to(query.dtype)
        # Four dimensions and grouped heads as they are: torch's fused CPU kernel (three dimensions, or
        # heads repeated, take its reference path, several times slower).
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=self.visible, scale=scale,
                                                               enable_gqa=query.shape[1] != keys.shape[1])
        return out.transpose(1, 2)  # [1, T, Hq, D]


def blend_forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: BlendCache) -> None:
    """Run ``input_ids`` ``[T]`` at ``cache.positions`` through the model (or up to its stop layer), writing their KV."""
    try:
        model(input_ids=input_ids.unsqueeze(0), position_ids=cache.positions.unsqueeze(0), past_key_values=cache,
              use_cache=True, logits_to_keep=1, **{CASCADE_KWARG: cache})
    except _StopForward:
        pass


def compute_alone(model: torch.nn.Module, layout: KVLayout, ids: Sequence[int],
                  segments: Sequence[tuple[torch.Tensor, int]] = (), start: int = 0) -> WorkingCache:
    """The KV of ``ids`` with nothing before them, at positions ``start, start+1, ...``, in a working cache.

    ``segments`` (snapshots ``[L, 2, H, n, D]``, tokens used) hold the KV of a first part of ``ids``
    already computed that way; only the rest is run."""
    cache = WorkingCache(layout, segments, len(ids))
    done = cache.prefix_len
    if done < len(ids):
        rest = torch.tensor([list(ids[done:])], device=layout.device)
        positions = torch.arange(start + done, start + len(ids), device=layout.device).unsqueeze(0)
        with torch.no_grad():
            model(input_ids=rest, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


#: Rotary variants whose angles depend on the sequence length: a stored chunk cannot be re-rotated exactly.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rotary_shift(model: torch.nn.Module) -> ShiftTable:
    """The model's rotation by ``delta`` positions as float32 ``(cos [D], sin [D])``, from its own rotary module.

    Raises ``UnsupportedModelError`` for a model without one rotary embedding, or one whose angles
    depend on the sequence length."""
    rotary = {id(m): m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")
              and isinstance(getattr(m, "inv_freq", None), torch.Tensor)}
    if len(rotary) != 1:
        raise UnsupportedModelError("no single rotary position embedding (absolute positions cannot be re-rotated)"
                                    if not rotary else "several rotary embeddings (per layer type)")
    module = next(iter(rotary.values()))
    kind = getattr(module, "rope_type", "default")
    if kind in _LENGTH_DEPENDENT_ROPE:
        raise UnsupportedModelError(f"rotary scaling {kind!r} depends on the sequence length")
    probe = torch.zeros(1, dtype=torch.float32, device=module.inv_freq.device)

    # Some variants (YaRN) scale cos and sin; stored keys carry that scale once already, so a shift is the
    # rotation alone.
    scale = float(getattr(module, "attention_scaling", 1.0) or 1.0)

    def shift(delta: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            cos, sin = module(probe, torch.tensor([[delta]], device=probe.device))
        return cos[0, 0].float() / scale, sin[0, 0].float() / scale
    return shift


def rerotation_error(model: torch.nn.Module, layout: KVLayout, shift: ShiftTable,
                     ids: Sequence[int], delta: int) -> float:
    """max |KV computed at 0 and re-rotated by ``delta`` - KV computed at ``delta``| / max |the latter|, every layer."""
    at_zero = compute_alone(model, layout, ids).slice(0, len(ids))
    in_place = compute_alone(model, layout, ids, start=delta).slice(0, len(ids)).float()
    moved = rerotate(at_zero, delta, shift).float()
    return float((moved - in_place).abs().max() / in_place.abs().max().clamp_min(1e-30))


def check_rerotation(model: torch.nn.Module, layout: KVLayout) -> ShiftTable:
    """The model's ``rotary_shift`` once a few tokens computed at position 0 and re-rotated match the same tokens
    computed in place, in every layer; else ``UnsupportedModelError`` (chunks are then prefilled, not moved).

    Tolerance: ``8 * eps(dtype)`` of the largest KV value, at least 1e-4 (float32 angles of a
    position near the probe's differ by about that); the rounding of both computations in bfloat16
    is about 1.5 eps on a small model, a scale applied twice (e.g. YaRN's 1.14) 17 eps."""
    shift = rotary_shift(model)
    vocab = model.get_input_embeddings().num_embeddings
    ids = [(7 * i + 3) % vocab for i in range(8)]
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 2048
    delta = max(1, min(509, limit - len(ids)))
    err = rerotation_error(model, layout, shift, ids, delta)
    tol = max(1e-4, 8 * torch.finfo(layout.dtype).eps)
    if not err <= tol:
        raise UnsupportedModelError(f"keys re-rotated by {delta} positions differ from keys computed there by "
                                    f"{err:.3g} of the largest (tolerance {tol:.3g})")
    return shift
