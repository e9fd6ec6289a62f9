"""The fused Llama forward computes what the model computes, on packed and unpacked row counts, never stale."""
from __future__ import annotations

import pytest
import torch

from prefixcache.errors import UnsupportedModelError
from prefixcache.model.cpu.llama_forward import FusedLlama
from prefixcache.model.cpu.packed_linear import PackedLinears
from prefixcache.model.hf_cache import check_cascade, probe_layout
from prefixcache.serving.request import SamplingParams
from tests.conftest import build_tiny
from tests.serving.test_batching import NS, expected, make_engine

pytestmark = pytest.mark.skipif(PackedLinears.build(torch.nn.Linear(4, 4), 4)[0] is None,
                                reason="this torch build has no MKL packed linear")


def fused_llama(rows=8):
    model = build_tiny("llama-gqa")
    fused, reason = FusedLlama.build(model, rows)
    assert reason is None
    return model, fused, probe_layout(model)


def test_equals_the_models_forward_with_packed_padded_and_plain_products():
    model, fused, layout = fused_llama(rows=8)
    packs = fused.packs
    for rows in (4, 6, 8, 12):  # 4..8 rows: packed (4 and 6 padded to 8); 12: each module's own product
        check_cascade(model, layout, fused, rows=rows)
    assert fused.packs == packs == 2 * 4 + 1  # 2 layers of q/k/v, o, gate/up, down; the LM head


def test_the_check_catches_a_wrong_packed_product_and_only_where_it_is_used():
    model, fused, layout = fused_llama(rows=8)
    group = fused.layers[1].gate_up  # a wrong packed copy, behind the weights' backs:
    wrong = torch.cat([m.weight.detach() for m in group.modules]) * 2  # its version checks still pass
    group.packed = torch.ops.mkl._mkl_reorder_linear_weight(wrong, 8)
    with pytest.raises(UnsupportedModelError, match="differs"):
        check_cascade(model, layout, fused, rows=8)
    check_cascade(model, layout, fused, rows=12)  # 12 rows do not read the packed copy


def test_weights_edited_or_replaced_are_packed_again_before_the_next_step():
    model, fused, layout = fused_llama(rows=8)
    packs = fused.packs
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # in place: version counter moves
        model.model.layers[1].mlp.down_proj.weight = torch.nn.Parameter(torch.randn(64, 128) * 0.05)
        model.lm_head.weight.add_(0.01)
    assert fused.ready() and fused.packs == packs + 3
    check_cascade(model, layout, fused, rows=8)
    with torch.inference_mode():
        model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(torch.randn(128, 64), requires_grad=False)
    assert not fused.ready()  # an inference tensor has no version counter: the model's forward serves


def test_hooks_and_instance_forwards_send_the_step_through_the_model():
    model, fused, _ = fused_llama()
    assert fused.ready()
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert not fused.ready()
    handle.remove()
    model.model.norm.forward = lambda x: x  # e.g. a library's wrapper
    assert not fused.ready()
    del model.model.norm.forward
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert not fused.ready()
    finally:
        handle.remove()
    assert fused.ready()
    attn = model.model.layers[0].self_attn
    original = attn.v_proj
    attn.v_proj = torch.nn.Linear(64, 32, bias=False)  # replaced (an adapter would wrap it): not the packed weights
    assert not fused.ready()
    attn.v_proj = original
    assert fused.ready()


def test_build_says_why_it_cannot_serve():
    assert "LlamaForCausalLM" in FusedLlama.build(build_tiny("qwen2"), 8)[1]
    assert "bfloat16" in FusedLlama.build(build_tiny("llama-gqa").to(torch.bfloat16), 8)[1]
    model = build_tiny("llama-gqa")

    class Norm(type(model.model.norm)):
        pass

    model.model.layers[1].post_attention_layernorm.__class__ = Norm
    assert "Norm where the fused forward expects LlamaRMSNorm" in FusedLlama.build(model, 8)[1]


def test_engine_runs_its_steps_fused_and_falls_back_to_the_models_forward_per_step():
    model, ref = build_tiny("llama-gqa"), build_tiny("llama-gqa")
    engine = make_engine(model, max_batch=4, token_budget=16, prefill_chunk=8, fast_path=True)
    try:
        fast = engine.runner.step_forward
        assert fast is not None and fast.kind == "fused"
        assert engine.extra_weight_bytes == sum(m.weight.nbytes for m in model.modules()
                                                 if type(m) is torch.nn.Linear)
        prompts = [list(range(10, 30)) + [40 + i] * (i + 1) for i in range(4)]
        reqs = [engine.submit(p, NS, "t", SamplingParams(max_new_tokens=6)) for p in prompts]
        assert [engine.wait(r, timeout=60).tokens for r in reqs] == [expected(ref, p, 6) for p in prompts]
        assert fast.fast_steps == engine.steps > 0
        steps = engine.steps
        handle = model.model.layers[0].register_forward_hook(lambda *args: None)  # the model's forward serves
        try:
            got = engine.generate(prompts[0] + [7], NS, "t", SamplingParams(max_new_tokens=3)).tokens
        finally:
            handle.remove()
        assert got == expected(ref, prompts[0] + [7], 3)
        assert engine.steps > steps and fast.fast_steps == steps
    finally:
        engine.close()


def test_engine_uses_packed_modules_when_the_fused_forward_disagrees(monkeypatch):
    def wrong(self, input_ids, position_ids, cache, keep):  # right shapes, wrong values
        for layer in self.layers:
            cache.attend(layer.index, torch.zeros(1, self.heads, input_ids.shape[0], self.head_dim), layer.scale)
        return torch.zeros(keep.shape[0], self.lm_head.modules[0].out_features)

    monkeypatch.setattr(FusedLlama, "__call__", wrong)
    engine = make_engine(build_tiny("llama-gqa"), max_batch=4, fast_path=True)
    try:
        assert engine.runner.step_forward.kind == "packed" and engine.disabled_reason is None
    finally:
        engine.close()
