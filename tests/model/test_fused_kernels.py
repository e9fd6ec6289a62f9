"""The CUDA kernels' cascade logic (GQA layout, held + own causal split, padded bias) on any machine.

The fused kernels' ops are replaced by stand-ins with their contract (top-left causal, log-sum-exp
in float32, the memory-efficient one's padded to a multiple of 32 rows), so what this checks is the
code around the kernels; tests/gpu runs the real kernels."""
from __future__ import annotations

import pytest
import torch

from prefixcache.model.cascade import PrivateBatch, Shared, TorchKernels, cascade_attention
from prefixcache.model.cuda import FusedKernels


def _scores(q, k, scale, bias, causal):
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale  # [B, H, L, S]
    if bias is not None:
        s = s + bias.double()
    if causal:
        rows, cols = s.shape[-2:]
        s = s.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), float("-inf"))  # top-left
    return s


def _gqa(q, k):
    assert q.shape[0] == k.shape[0] and q.shape[1] % k.shape[1] == 0
    return k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head h reads KV head h // g


def flash_stand_in(q, k, v, dropout, causal, debug, scale):
    assert q.dtype == k.dtype and dropout == 0.0 and q.stride(-1) == k.stride(-1) == 1
    k, v = _gqa(q, k), _gqa(q, v)
    s = _scores(q, k, scale, None, causal)
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.double())
    return out.to(q.dtype), lse.float(), None, None, 0, 0, None, None, None


def efficient_stand_in(q, k, v, bias, compute_lse, dropout, causal, scale):
    assert compute_lse and dropout == 0.0 and q.shape[:2] == k.shape[:2]
    if bias is not None:
        assert bias.dtype == q.dtype and bias.shape == (*q.shape[:3], k.shape[2])
        assert bias.stride(0) % 16 == 0 and bias.stride(-1) == 1
    s = _scores(q, k, scale, bias, causal)
    lse = torch.logsumexp(s, -1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.double())
    rows = q.shape[2]
    padded = torch.full((*lse.shape[:2], -(-rows // 32) * 32), float("nan"))
    padded[..., :rows] = lse
    return out.to(q.dtype), padded, None, None


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("native_gqa", [True, False])
def test_fused_cascade_equals_torch_cascade(flash, hq, hkv, native_gqa):
    """Shared runs for some members, prefill chunks with and without held tokens (two alike, stacked),
    pooled decodes; with the flash kernel's own GQA and with KV heads repeated."""
    gen = torch.Generator().manual_seed(hq * 7 + hkv + flash)
    d = 16

    def rand(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).float()

    shared = [Shared(rand(hkv, 20, d), rand(hkv, 20, d), (0, 1, 2, 3)), Shared(rand(hkv, 7, d), rand(hkv, 7, d), (1, 3))]
    # chunks: none held, 4 held, two alike (3 rows after 2 held, stacked), then two decodes in a pool
    rows, held = [5, 3, 3, 3, 1, 1], [0, 4, 2, 2]
    private = [(rand(hkv, r + h, d), rand(hkv, r + h, d)) for r, h in zip(rows[:4], held)]
    keys, values = rand(3, hkv, 9, d), rand(3, hkv, 9, d)  # pool of 3 slots, capacity 9
    batch = PrivateBatch.build(keys, values, rows=[14, 15], slots=[2, 0], lengths=[6, 9])
    q = rand(hq, sum(rows), d)
    spans = [(0, 5), (5, 8), (8, 11), (11, 14), (14, 15), (15, 16)]
    shared.append(Shared(rand(hkv, 4, d), rand(hkv, 4, d), (2, 3, 4)))
    want = cascade_attention(q, spans, shared, [*private, None, None], 0.3, [batch], kernels=TorchKernels())
    fused = FusedKernels(flash, flash_op=flash_stand_in, efficient_op=efficient_stand_in)
    fused.native_gqa = flash and native_gqa
    got = cascade_attention(q, spans, shared, [*private, None, None], 0.3, [batch], kernels=fused)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("held", [0, 3])
def test_a_prompt_alone_over_its_own_keys_is_one_call_in_the_model_s_dtype(flash, held):
    """A cold prompt's step (one request, no stored prefix): one kernel call returning the model's dtype,
    equal to the general path; with tokens held from earlier steps the general path serves."""
    gen = torch.Generator().manual_seed(held)
    hq, hkv, d, r = 8, 2, 16, 6
    q = torch.randn(hq, r, d, generator=gen)
    k, v = torch.randn(hkv, r + held, d, generator=gen), torch.randn(hkv, r + held, d, generator=gen)
    calls = []

    def counted(op):
        return lambda *a, **kw: calls.append(op) or op(*a, **kw)

    fused = FusedKernels(flash, flash_op=counted(flash_stand_in), efficient_op=counted(efficient_stand_in))
    got = cascade_attention(q, [(0, r)], [], [(k, v)], 0.3, kernels=fused)
    want = cascade_attention(q, [(0, r)], [], [(k, v)], 0.3, kernels=TorchKernels())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.dtype == q.dtype
    assert len(calls) == (1 if held == 0 else 2)
    assert fused.alone(q.view(hkv, 4, r, d), k, v, 0.3) is None or held == 0


def test_fused_bias_is_built_once_per_step():
    fused = FusedKernels(False, flash_op=flash_stand_in, efficient_op=efficient_stand_in)
    keys = torch.randn(2, 2, 5, 8)
    batch = PrivateBatch.build(keys, keys, rows=[0, 1], slots=[0, 1], lengths=[3, 5])
    masks: dict = {}
    q = torch.randn(2, 2, 2, 8)
    first = fused.masked(q, keys, keys, 0.5, batch.mask, masks)
    second = fused.masked(q, keys, keys, 0.5, batch.mask, masks)
    assert len(masks) == 1
    torch.testing.assert_close(first[0], second[0])
    assert first[1].shape == (2, 2, 2)  # the padded log-sum-exp rows are cut back


def test_a_flash_op_without_gqa_falls_back_to_repeated_kv_heads():
    """A torch whose flash op wants as many KV heads as query heads: refused once, then repeated heads."""
    refused = []

    def strict_flash(q, k, v, *args, **kwargs):
        if q.shape[1] != k.shape[1]:
            refused.append(q.shape)
            raise RuntimeError("number of heads in key/value must equal query")
        return flash_stand_in(q, k, v, *args, **kwargs)

    fused = FusedKernels(True, flash_op=strict_flash, efficient_op=efficient_stand_in)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(shape, generator=gen) for shape in ((1, 2, 4, 5, 8), (1, 2, 7, 8), (1, 2, 7, 8)))
    got = fused.causal(q, k, v, 0.4, {})
    want = TorchKernels().causal(q, k, v, 0.4, {})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(refused) == 1 and not fused.native_gqa
    fused.causal(q, k, v, 0.4, {})
    assert len(refused) == 1


def _held_ignored(self, q, k, v, scale, masks):
    r = q.shape[3]  # q [B, Hkv, g, r, D]: only the rows' own keys, as if nothing were held
    return TorchKernels().causal(q, k[:, :, -r:], v[:, :, -r:], scale, masks)


def _alone_not_causal(self, q, k, v, scale):
    hkv, g, r, dim = q.shape
    out, _ = self._heads(q.reshape(1, hkv * g, r, dim), k.unsqueeze(0), v.unsqueeze(0), scale, causal=False,
                         widen=False)
    return out.view(hkv, g, r, dim)


@pytest.mark.parametrize("bug", ["none", "held tokens ignored", "causal flag dropped", "a prompt alone not causal"])
def test_the_start_up_check_judges_the_fused_kernels(bug, monkeypatch):
    """The self-check runs a model through the CUDA kernels' code (stand-in ops here): it passes
    them as they are and refuses them broken."""
    from prefixcache.errors import UnsupportedModelError
    from prefixcache.model import cascade
    from prefixcache.model.hf_cache import check_cascade, enable_cascade_attention, probe_layout
    from tests.conftest import build_tiny

    model = build_tiny("llama-gqa")
    layout = probe_layout(model)
    enable_cascade_attention(model)
    fused = FusedKernels(True, flash_op=flash_stand_in, efficient_op=efficient_stand_in)
    monkeypatch.setattr(cascade, "kernels_for", lambda device, dtype, head_dim: fused)
    real_call = FusedKernels._call
    if bug == "held tokens ignored":
        monkeypatch.setattr(FusedKernels, "causal", _held_ignored)
    elif bug == "causal flag dropped":
        monkeypatch.setattr(FusedKernels, "_call", lambda self, q, k, v, scale, causal, widen=True:
                            real_call(self, q, k, v, scale, False, widen))
    elif bug == "a prompt alone not causal":
        monkeypatch.setattr(FusedKernels, "alone", _alone_not_causal)
    if bug == "none":
        check_cascade(model, layout)
    else:
        with pytest.raises(UnsupportedModelError):
            check_cascade(model, layout)
