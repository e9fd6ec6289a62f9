"""Answers after a tier restore equal uncached ``generate()`` token for token (fp32), on every tiny
architecture and the default model: after an eviction, and after a restart on the same disk tier."""
from __future__ import annotations

import pytest
import torch

from prefixcache import PrefixCache
from prefixcache.config import CacheConfig
from tests.conftest import untouched

BLOCK = 8


def config(tmp_path, per_token: int, **kw) -> CacheConfig:
    return CacheConfig(block_size=BLOCK, max_bytes=per_token * 64, tier_disk=str(tmp_path), **kw)


def prompts(seed: int, n: int, length: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 300, (1, length), generator=g) for _ in range(n)]


def test_restored_prefix_answers_equal_uncached_generate(tiny_model, tmp_path):
    check_restore_parity(tiny_model, tmp_path, batching=True)


def test_restored_prefix_on_the_serial_engine(llama, tmp_path):
    check_restore_parity(llama, tmp_path, batching=False)


def check_restore_parity(tiny_model, tmp_path, batching: bool) -> None:
    ref = untouched(tiny_model)
    main, *others = prompts(1, 3, 45)
    want = ref.generate(main, max_new_tokens=6, do_sample=False)
    probe = PrefixCache(tiny_model, None, CacheConfig(block_size=BLOCK), start_sweeper=False, batching=False)
    per_token = probe.bytes_per_token
    probe.close()
    cache = PrefixCache(tiny_model, None, config(tmp_path, per_token), start_sweeper=False, batching=batching)
    assert torch.equal(cache.generate(main, max_new_tokens=6, do_sample=False), want)
    for other in others:  # evict the main prompt's blocks from the device (64-token budget)
        cache.generate(other, max_new_tokens=6, do_sample=False)
    cache.tiers.flush_writes(10)
    out = cache.generate(main, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, want)
    assert cache.last_call.cached_tokens == 40  # 5 full blocks restored from disk
    disk = cache.stats()["tiers"]["disk"]
    assert disk["restores"] >= 1 and disk["corrupt_entries"] == 0
    cache.check_integrity()
    cache.close()

    # A restart on the same disk tier: the first call is a hit, with the same answer.
    again = PrefixCache(tiny_model, None, config(tmp_path, per_token), start_sweeper=False, batching=batching)
    assert torch.equal(again.generate(main, max_new_tokens=6, do_sample=False), want)
    assert again.last_call.cached_tokens == 40  # kept at shutdown: every full block the prompt can reuse
    again.close()


def test_another_model_on_the_same_tier_never_hits(tmp_path):
    from tests.conftest import build_tiny

    first, second = build_tiny("llama-gqa", seed=0), build_tiny("llama-gqa", seed=1)
    (main,) = prompts(2, 1, 45)
    a = PrefixCache(first, None, CacheConfig(block_size=BLOCK, tier_disk=str(tmp_path)), start_sweeper=False)
    a.generate(main, max_new_tokens=4, do_sample=False)
    a.close()
    b = PrefixCache(second, None, CacheConfig(block_size=BLOCK, tier_disk=str(tmp_path)), start_sweeper=False)
    out = b.generate(main, max_new_tokens=4, do_sample=False)
    assert b.last_call.cached_tokens == 0
    assert torch.equal(out, untouched(second).generate(main, max_new_tokens=4, do_sample=False))
    b.close()


@pytest.mark.slow
def test_default_model_restart_parity(default_model, tmp_path):
    model, tokenizer = default_model
    ref = untouched(model)
    messages = [{"role": "system", "content": "You are a terse assistant for a hardware store. " * 12},
                {"role": "user", "content": "Which screws hold best in drywall?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    want = ref.generate(ids, max_new_tokens=12, do_sample=False)
    cfg = CacheConfig(tier_disk=str(tmp_path), block_size=32)
    cache = PrefixCache(model, tokenizer, cfg, start_sweeper=False)
    assert torch.equal(cache.generate(ids, max_new_tokens=12, do_sample=False), want)
    cache.close()
    again = PrefixCache(model, tokenizer, cfg, start_sweeper=False)
    assert torch.equal(again.generate(ids, max_new_tokens=12, do_sample=False), want)
    assert again.last_call.cached_tokens >= ids.shape[1] - 32
    assert again.stats()["tiers"]["disk"]["restores"] == 1
    again.close()
