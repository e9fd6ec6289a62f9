"""Cascade attention in bfloat16 and float16: as exact as plain attention, and the self-check tells
rounding (batching stays on) from logic errors (refused at any precision)."""
from __future__ import annotations

import pytest
import torch

from prefixcache import PrefixCache
from prefixcache.errors import UnsupportedModelError
from prefixcache.model import cascade
from prefixcache.model.hf_cache import check_cascade, enable_cascade_attention, measure_cascade, probe_layout
from prefixcache.model.private_kv import PrivateKV
from tests.conftest import ARCHS, build_tiny

REDUCED = (torch.bfloat16, torch.float16)


def reduced(arch: str, dtype: torch.dtype):
    model = build_tiny(arch).to(dtype)
    layout = probe_layout(model)
    enable_cascade_attention(model)
    return model, layout


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_batching_stays_enabled(arch, dtype):
    with PrefixCache(build_tiny(arch).to(dtype), batching=True, start_sweeper=False) as pc:
        assert pc.batcher is not None and pc.batcher.disabled_reason is None


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_every_layer_rounds_no_more_than_plain_attention(arch, dtype):
    """Parts and merges in float32, one rounding at the end: at most half a unit in the last place of
    the largest output off float64, and never further than plain attention in the same dtype."""
    model, layout = reduced(arch, dtype)
    m = measure_cascade(model, layout, rows=6)
    eps = torch.finfo(dtype).eps
    assert m.inputs == 0.0 and m.exact < 1e-5
    for err in m.layers:
        assert err.cascade <= 1.01 * max(err.plain, 0.5 * eps * err.scale)


def _no_causal_mask(rows, keys, groups, dtype, device):
    return torch.zeros((groups * rows, keys), dtype=dtype, device=device)


def _mask_one_ahead(rows, keys, groups, dtype, device):
    t, j = torch.arange(rows, device=device).unsqueeze(1), torch.arange(keys, device=device).unsqueeze(0)
    mask = torch.zeros((rows, keys), dtype=dtype, device=device).masked_fill(j > keys - rows + t + 1, float("-inf"))
    return mask.repeat(groups, 1)


def _write_one_late(self, layer, start, keys, values):
    n, slab = keys.shape[1], self.pool.slab
    slab[layer, 0, self.slot, :, start + 1 : start + 1 + n].copy_(keys)
    slab[layer, 1, self.slot, :, start + 1 : start + 1 + n].copy_(values)


def _merge_drops_prefix(o_a, lse_a, o_b, lse_b):
    return o_b


BROKEN = {
    "no causal mask": (cascade, "causal_tail_mask", _no_causal_mask),
    "mask one token ahead": (cascade, "causal_tail_mask", _mask_one_ahead),
    "private KV written one position late": (PrivateKV, "write", _write_one_late),
    "merge drops the shared prefix": (cascade, "merge_two", _merge_drops_prefix),
}


@pytest.mark.parametrize("dtype", (torch.float32, *REDUCED), ids=str)
@pytest.mark.parametrize("bug", BROKEN)
def test_a_broken_cascade_is_refused(bug, dtype, monkeypatch):
    model, layout = reduced("llama-gqa", dtype)
    check_cascade(model, layout)  # the real one passes
    monkeypatch.setattr(*BROKEN[bug])
    with pytest.raises(UnsupportedModelError):
        check_cascade(model, layout)


@pytest.mark.parametrize("arch", ["llama-gqa", "gpt2"])
def test_a_step_at_shifted_positions_is_refused(arch):
    """Rows and positions: a step forward one position off (rotary or absolute) fails in bfloat16."""
    from prefixcache.model.hf_cache import CASCADE_KWARG

    model, layout = reduced(arch, torch.bfloat16)

    def shifted(ids, pos, cache, keep):
        return model(input_ids=ids.unsqueeze(0), position_ids=(pos + 1).unsqueeze(0), past_key_values=cache,
                     use_cache=True, **{CASCADE_KWARG: cache}).logits[0, keep]

    with pytest.raises(UnsupportedModelError, match="rows or positions"):
        check_cascade(model, layout, shifted)


def test_a_layer_outside_the_cascade_is_refused(monkeypatch):
    """Routing: a step whose last layer's attention skips the cascade cache fails in any dtype."""
    model, layout = reduced("llama-gqa", torch.bfloat16)
    from prefixcache.model import hf_cache

    real = hf_cache.CascadeCache.attend

    def first_layer_only(self, layer, query, scale):
        out = real(self, layer, query, scale)
        self.calls -= layer == layout.num_layers - 1
        return out

    monkeypatch.setattr(hf_cache.CascadeCache, "attend", first_layer_only)
    with pytest.raises(UnsupportedModelError, match="ran in 1 of 2 layers"):
        check_cascade(model, layout)


@pytest.fixture(scope="module")
def default_bf16():
    from prefixcache import load_default_model

    return load_default_model(dtype=torch.bfloat16)


@pytest.mark.slow
def test_default_model_in_bfloat16_batches(default_bf16):
    model, tokenizer = default_bf16
    with PrefixCache(model, tokenizer, start_sweeper=False) as pc:
        assert pc.batcher is not None and pc.batcher.disabled_reason is None


@pytest.mark.slow
def test_default_model_in_bfloat16_cascade_is_nearer_float32_than_plain(default_bf16):
    """End to end the rounding-free answer is a float32 copy: the cascade step's logits are nearer it
    than the plain bfloat16 forwards' (rounding in the rest of the model is the same for both)."""
    import copy

    model, _ = default_bf16
    layout = probe_layout(model)
    enable_cascade_attention(model)
    m = measure_cascade(model, layout)
    wide = copy.deepcopy(model).float()
    with torch.no_grad():
        ref = torch.cat([wide(input_ids=torch.tensor([seq])).logits[0, m.prefix_len:] for seq in m.sequences])
    assert float((m.got - ref).abs().max()) <= float((m.want - ref).abs().max())
