"""A packed cascade forward of Llama-architecture models from MKL-packed fused weights (CPU, fp32).

Why: in a decode step of 16 requests the model's linear layers cost most of the time, and
each layer's q, k and v projections (and the MLP's gate and up) read the same input. One
packed product per group instead of one per module, with the layer's other work done in a
few fused ops, makes that step faster than the model's own forward with packed modules
(figures: docs/benchmarks.md).

What it computes: what ``LlamaForCausalLM.forward`` computes for a packed ``CascadeCache``
step: embeddings; per layer RMSNorm, q/k/v, rotary positions, the new K/V written through
the cache, cascade attention, output projection and residual, RMSNorm, the gated MLP (the
model's own activation) and residual; the final RMSNorm and the LM head on the rows that
sample. Only the grouping of products and the fused RMSNorm differ, so results agree to
fp32 rounding.

How it stays right:
- It serves only the exact transformers Llama classes (a subclass or another family may
  compute something else), and no step runs through it while a module it was built from has
  been replaced (e.g. by an adapter's wrapper) or any module of the model has a hook or an
  instance-level ``forward`` (e.g. accelerate's offloading).
- Before each step every packed weight is checked by identity and version counter and packed
  again if it changed; one that cannot be checked sends the step through the model's forward.
- The engine compares it with the model's own forward before serving (``check_cascade``) and
  does not use it if they differ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixcache.model.cpu.packed_linear import PackedWeight, packing_ops_reason
from prefixcache.model.hf_cache import CascadeCache


class _Layer:
    """One decoder layer's weights: packed groups and what the fused ops read."""

    def __init__(self, layer, rows: int, ops, pads: dict[int, torch.Tensor]):
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = PackedWeight([attn.q_proj, attn.k_proj, attn.v_proj], rows, ops, pads)
        self.o = PackedWeight([attn.o_proj], rows, ops, pads)
        self.gate_up = PackedWeight([mlp.gate_proj, mlp.up_proj], rows, ops, pads)
        self.down = PackedWeight([mlp.down_proj], rows, ops, pads)
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.act = mlp.act_fn
        self.scale = attn.scaling
        self.index = attn.layer_idx

    @property
    def weights(self) -> tuple[PackedWeight, ...]:
        return self.qkv, self.o, self.gate_up, self.down


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    return torch.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _product(weight: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    """x [n, in] through the group: packed where it serves n rows, else each module's F.linear side by side."""
    if weight.serves(x.shape[0]):
        return weight(x)
    outs = [F.linear(x, m.weight, m.bias) for m in weight.modules]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions as transformers' ``apply_rotary_pos_emb`` (rotate_half convention). x: [T, H, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class FusedLlama:
    """Packed forward of a ``LlamaForCausalLM`` over a ``CascadeCache`` (see the module docstring)."""

    def __init__(self, model, rows: int, ops):
        self.model = model
        inner = model.model
        pads: dict[int, torch.Tensor] = {}
        self.layers = [_Layer(layer, rows, ops, pads) for layer in inner.layers]
        self.lm_head = PackedWeight([model.lm_head], rows, ops, pads)
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = inner.layers[0].self_attn.head_dim
        self._all_modules = list(model.modules())

    @classmethod
    def build(cls, model: torch.nn.Module, rows: int,
              max_bytes: int | None = None) -> tuple[FusedLlama | None, str | None]:
        """The fused forward for ``model``, or (None, reason) where it cannot serve it."""
        reason = _unsupported(model)
        if reason is not None:
            return None, reason
        linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
        ops, reason = packing_ops_reason(linears, rows, max_bytes)
        if reason is not None:
            return None, reason
        fused = cls(model, rows, ops)
        if not fused.ready():  # packs every weight now, not in the first request's step
            return None, "a module has a hook or its own forward, or a weight has no version counter"
        return fused, None

    @property
    def weights(self) -> list[PackedWeight]:
        return [w for layer in self.layers for w in layer.weights] + [self.lm_head]

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights that have a packed copy (the copy's resident size is about the same)."""
        return sum(w.nbytes for w in self.weights)

    @property
    def packs(self) -> int:
        """Weight groups packed (initially and after a change)."""
        return sum(w.packs for w in self.weights)

    def ready(self) -> bool:
        """Whether the next step may run here: the modules it was built from still make up the model
        (none replaced, e.g. by an adapter's wrapper), none has a hook or an instance forward, and
        every packed weight is current."""
        hooks = torch.nn.modules.module
        modules = list(self.model.modules())
        if len(modules) != len(self._all_modules) or any(a is not b for a, b in zip(modules, self._all_modules)):
            return False
        if (hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or any(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__ for m in modules)):
            return False
        try:
            for weight in self.weights:
                weight.refresh()
        except RuntimeError:  # a weight swapped for an inference tensor: a change could not be seen
            return False
        return True

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: CascadeCache,
                 keep: torch.Tensor) -> torch.Tensor:
        """input_ids, position_ids: [T] packed rows; keep: [K] rows that sample. Returns logits [K, V]."""
        t = input_ids.shape[0]
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        h = self.embed(input_ids)  # [T, H]
        cos, sin = self.rotary(h, position_ids.unsqueeze(0))  # [1, T, D]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]: every head
        for layer in self.layers:
            qkv = _product(layer.qkv, _rms_norm(layer.input_norm, h))  # [T, (Hq + 2 Hkv) D]
            qk = _rotate(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d), cos, sin)  # q and k heads at once
            q = qk[:, :hq].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
            k = qk[:, hq:].transpose(0, 1).unsqueeze(0)
            v = qkv[:, (hq + hkv) * d :].view(t, hkv, d).transpose(0, 1).unsqueeze(0)
            cache.update(k, v, layer.index)
            attn = cache.attend(layer.index, q, layer.scale)  # [1, T, Hq, D]
            h = h + _product(layer.o, attn.reshape(t, hq * d))
            gate, up = _product(layer.gate_up, _rms_norm(layer.post_norm, h)).chunk(2, dim=-1)
            h = h + _product(layer.down, layer.act(gate) * up)
        return _product(self.lm_head, _rms_norm(self.norm, h.index_select(0, keep)))


def _unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused forward cannot compute what ``model`` computes, or None."""
    from transformers.models.llama import modeling_llama as llama

    if type(model) is not llama.LlamaForCausalLM:
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM"
    inner = model.model
    expected = [(inner, llama.LlamaModel), (inner.embed_tokens, torch.nn.Embedding), (inner.norm, llama.LlamaRMSNorm),
                (inner.rotary_emb, llama.LlamaRotaryEmbedding), (model.lm_head, torch.nn.Linear)]
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        expected += [(layer, llama.LlamaDecoderLayer), (attn, llama.LlamaAttention), (mlp, llama.LlamaMLP),
                     (layer.input_layernorm, llama.LlamaRMSNorm), (layer.post_attention_layernorm, llama.LlamaRMSNorm)]
        expected += [(m, torch.nn.Linear) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                     mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    for module, kind in expected:
        if type(module) is not kind:
            return f"{type(module).__name__} where the fused forward expects {kind.__name__}"
    if getattr(model.config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1 splits the projections"
    return None
