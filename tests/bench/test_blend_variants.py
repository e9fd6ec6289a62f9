"""The development study of blend variants: every variant builds a prompt's KV; a full recompute is a full prefill."""
from __future__ import annotations

import time

import torch

from benchmarks.blend_variants import VARIANTS, Lab, Variant, mean_change, near_ties, shift_by
from prefixcache import PrefixCache
from prefixcache.bench import rag


def test_every_variant_builds_and_a_full_recompute_answers_as_a_full_prefill(chat_llama, tokenizer, new_cache, capsys):
    spec = rag.RagSpec(per_prompt=(2, 2))
    cache: PrefixCache = new_cache(chat_llama, tokenizer, start_sweeper=False, batching=False)
    prompt = rag.prompts(cache, rag.documents(tokenizer, spec, 0)[spec.documents : spec.documents + 3], 1, spec,
                         "dev")[0]
    lab = Lab(cache, tokenizer)
    with torch.no_grad():
        answer, _, logits = rag._generate(chat_llama, prompt.ids, 3, time.perf_counter)
        full = lab.build(prompt, Variant("all", share=1.0))
        assert lab.answer(full, prompt, 3) == answer
        assert abs(lab.loglik(full, prompt, answer) - rag._loglik(logits, answer)) < 1e-3
        none = lab.build(prompt, VARIANTS["share 0%"])
        assert not torch.allclose(none, full, atol=1e-4)  # documents computed alone do differ
        for variant in VARIANTS.values():
            kv = lab.build(prompt, variant)
            assert kv.shape == full.shape and torch.isfinite(kv).all(), variant.name
            # The system prompt before the first document is always a full prefill's.
            first = prompt.chunks[0][0]
            torch.testing.assert_close(kv[:, :, :, :first], full[:, :, :, :first], rtol=1e-4, atol=1e-5)
        # From a full recompute: the full prefill's answer, and its top-1 - top-2 logit at each step.
        got, margins = lab.margins(full, prompt, 3)
        top = logits.topk(2, dim=-1).values
        assert got == answer
        torch.testing.assert_close(torch.tensor(margins), top[:, 0] - top[:, 1], rtol=1e-3, atol=1e-3)
        # Switching to the exact KV before the first step is a full prefill's answer; never switching, the blend's.
        near_ties(lab, [prompt], [(answer, 0.0)], [float("inf"), 0.0], 3)
        blended = int(lab.answer(lab.build(prompt, VARIANTS["share 15%"]), prompt, 3) == answer)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| inf") or line.startswith("| 0 ")]
    assert rows == ["| inf | 1/1 | 1/1 | 0.0 |", f"| 0 | {blended}/1 | 0/1 | - |"]


def test_a_mean_change_shift_moves_the_mean_of_keys_before_rotation_exactly():
    generator = torch.Generator().manual_seed(0)
    layers, heads, n, dim = 2, 3, 9, 8
    angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.cat([torch.linspace(0.1, 1, dim // 2)] * 2)
    rotation = (angles.cos(), angles.sin())
    kv = torch.randn(layers, 2, heads, n, dim, generator=generator)
    target = torch.randn(layers, 2, heads, n, dim, generator=generator)
    positions = torch.arange(2, 7)
    change = mean_change(target[:, :, :, positions] - kv[:, :, :, positions], positions, rotation)
    before = kv.clone()
    shift_by(kv, positions, change, rotation, 1.0)
    after = mean_change(target[:, :, :, positions] - kv[:, :, :, positions], positions, rotation)
    torch.testing.assert_close(after, torch.zeros_like(after), atol=1e-5, rtol=0)
    # Tokens outside ``positions`` are left alone, and each moved key moved by the same change rotated to its place.
    outside = torch.ones(n, dtype=torch.bool)
    outside[positions] = False
    assert torch.equal(kv[:, :, :, outside], before[:, :, :, outside])
    moved = mean_change(kv[:, :, :, positions] - before[:, :, :, positions], positions, rotation)
    torch.testing.assert_close(moved, change, atol=1e-5, rtol=0)
