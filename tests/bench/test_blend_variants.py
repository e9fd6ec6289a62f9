"""The development study of blend variants: every variant builds a prompt's KV; a full recompute is a full prefill."""
from __future__ import annotations

import time

import torch

from benchmarks.blend_variants import VARIANTS, Lab, Variant
from prefixcache import PrefixCache
from prefixcache.bench import rag


def test_every_variant_builds_and_a_full_recompute_answers_as_a_full_prefill(chat_llama, tokenizer, new_cache):
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
