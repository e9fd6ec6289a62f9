"""SDK options each with a test that fails if the option is ignored: batching, on_evict,
namespace_extra, cache_generated, default and absent TTLs."""
from __future__ import annotations

import math
import re

import pytest
import torch
from transformers import GenerationConfig

from prefixcache import CacheConfig, InvalidRequestError, PrefixCache
from prefixcache.cache.handles import EvictedSnapshot
from prefixcache.cache.scope import Scope
from tests.conftest import build_tiny, untouched

PROMPT = list(range(10, 50))


def greedy(model, prompt: list[int], new: int) -> list[int]:
    return model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()


@pytest.mark.parametrize("batching", [False, True])
def test_answers_match_the_untouched_model_with_and_without_batching(chat_llama, tokenizer, batching, new_cache):
    reference = untouched(chat_llama)  # copied before any cache switched the model's attention
    cache = new_cache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
    ids = cache.encode_chat([{"role": "system", "content": "Be brief. " * 20}, {"role": "user", "content": "hi"}])
    want = greedy(reference, ids, 6)
    first = cache.answer(ids, max_new_tokens=6, ignore_eos=True)
    second = cache.answer(ids, max_new_tokens=6, ignore_eos=True)
    assert list(first.token_ids) == want and list(second.token_ids) == want
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == len(ids) - 1
    assert cache.stats()["queries"] == 2 and cache.stats()["hits"] == 1
    cache.check_integrity()


def test_on_evict_receives_every_snapshot_with_its_tokens_and_kv(new_cache):
    model = build_tiny("llama-gqa")
    seen: list[EvictedSnapshot] = []
    cache = new_cache(model, None, CacheConfig(block_size=8), on_evict=seen.append, start_sweeper=False)
    out = cache.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)[0].tolist()
    stored = out[:-1]  # prompt + answer; the last token's KV was never computed
    held = cache.stats()["bytes"]
    assert cache.flush() == held > 0
    assert seen and all(s.reason == "flush" and s.tenant == "default" for s in seen)
    assert all(s.namespace == cache.namespace("default") for s in seen)
    by_start = sorted(seen, key=lambda s: s.start)
    for snap in by_start:
        assert tuple(snap.tokens) == tuple(stored[: len(snap.tokens)])  # the whole prefix from the root
        n = len(snap.tokens) - snap.start
        assert n > 0 and snap.kv.shape[3] == n  # [L, 2, H, n, D]: KV of tokens[start:] exactly
        assert snap.kv.nbytes == n * cache.bytes_per_token
    # the snapshots tile the stored sequence once, and their bytes are what was freed
    assert [s.start for s in by_start] == [0] + [len(s.tokens) for s in by_start[:-1]]
    assert len(by_start[-1].tokens) == len(stored)
    assert sum(s.kv.nbytes for s in seen) == held


def test_on_evict_sees_lru_evictions_and_the_kv_is_the_model_s(new_cache):
    """An evicted snapshot's KV equals the KV the model computes for its tokens (what a tier would restore)."""
    model = build_tiny("llama-gqa")
    reference = untouched(model)
    per_token = new_cache(model, None, start_sweeper=False).bytes_per_token
    seen: list[EvictedSnapshot] = []
    cache = new_cache(model, None, CacheConfig(block_size=8, max_bytes=per_token * 40), on_evict=seen.append,
                        start_sweeper=False)
    cache.generate(torch.tensor([PROMPT[:30]]), max_new_tokens=1, do_sample=False)
    assert not seen
    cache.generate(torch.tensor([list(range(100, 130))]), max_new_tokens=1, do_sample=False)
    assert seen and {s.reason for s in seen} == {"lru"}
    snap = seen[0]
    assert snap.tokens == tuple(PROMPT[: len(snap.tokens)])
    past = reference(torch.tensor([list(snap.tokens)]), use_cache=True).past_key_values
    for layer in range(reference.config.num_hidden_layers):
        keys, values = past.layers[layer].keys[0], past.layers[layer].values[0]  # [H, T, D]
        torch.testing.assert_close(snap.kv[layer, 0], keys[:, snap.start:], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(snap.kv[layer, 1], values[:, snap.start:], rtol=1e-4, atol=1e-5)


def _lease_tokens(cache: PrefixCache, namespace: tuple[str, ...], tokens: list[int]) -> int:
    lease = cache.store.acquire(Scope(namespace, "default"), tokens, len(tokens) - 1)
    try:
        return lease.cached_tokens
    finally:
        cache.store.release(lease)


def test_namespace_extra_separates_deployments_and_equal_extras_share(llama, new_cache):
    blue = new_cache(llama, None, CacheConfig(namespace_extra=("blue",)), start_sweeper=False)
    blue_again = new_cache(llama, None, CacheConfig(namespace_extra=("blue",)), start_sweeper=False)
    green = new_cache(llama, None, CacheConfig(namespace_extra=("green",)), start_sweeper=False)
    plain = new_cache(llama, None, start_sweeper=False)
    assert blue.namespace("default")[-1] == "blue"
    blue.warm(PROMPT)
    assert _lease_tokens(blue, blue_again.namespace("default"), PROMPT) == len(PROMPT) - 1
    assert _lease_tokens(blue, green.namespace("default"), PROMPT) == 0
    assert _lease_tokens(blue, plain.namespace("default"), PROMPT) == 0


def _second_turn_cached(cache: PrefixCache, via: str) -> tuple[int, int]:
    """Turn 1 answers ``PROMPT``; turn 2 sends prompt + answer + a question. Returns (cached, answer length)."""
    if via == "generate":
        out = cache.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None)
        answer = out[0, len(PROMPT):].tolist()
        cache.generate(torch.tensor([PROMPT + answer + [200, 201]]), max_new_tokens=1, do_sample=False)
        return cache.last_call.cached_tokens, len(answer)
    answer = list(cache.answer(PROMPT, max_new_tokens=6, ignore_eos=True).token_ids)
    return cache.answer(PROMPT + answer + [200, 201], max_new_tokens=1).usage.cached_tokens, len(answer)


@pytest.mark.parametrize("via", ["generate", "answer"])
def test_cache_generated_false_stores_only_the_prompt(tokenizer, via, new_cache):
    model = build_tiny("llama-gqa")
    model.generation_config.eos_token_id = None  # the answer always has its 6 tokens
    on = new_cache(model, tokenizer, start_sweeper=False)
    cached, answer = _second_turn_cached(on, via)
    assert answer == 6 and cached >= len(PROMPT) + answer - 1  # control: the answer is reused by default
    off = new_cache(model, tokenizer, CacheConfig(cache_generated=False), start_sweeper=False)
    cached, _ = _second_turn_cached(off, via)
    assert cached == len(PROMPT)


def test_default_ttl_expires_idle_prefixes_and_reads_refresh_them(llama, clock, new_cache):
    cache = new_cache(llama, None, clock=clock, start_sweeper=False)
    ttl = cache.config.ttl_seconds
    assert ttl == CacheConfig().ttl_seconds is not None
    prompt = torch.tensor([PROMPT])
    cache.generate(prompt, max_new_tokens=1, do_sample=False)
    for _ in range(3):  # each read inside the TTL keeps the prefix for another TTL
        clock.advance(ttl * 0.9)
        cache.generate(prompt, max_new_tokens=1, do_sample=False)
        assert cache.last_call.cached_tokens == len(PROMPT) - 1
    clock.advance(ttl * 1.1)
    cache.generate(prompt, max_new_tokens=1, do_sample=False)
    assert cache.last_call.cached_tokens == 0


@pytest.mark.parametrize("how", ["config", "call"])
def test_no_ttl_never_expires(llama, clock, how, new_cache):
    config = CacheConfig(ttl_seconds=None) if how == "config" else CacheConfig()
    call = {} if how == "config" else {"ttl_seconds": math.inf}
    cache = new_cache(llama, None, config, clock=clock, start_sweeper=False)
    prompt = torch.tensor([PROMPT])
    cache.generate(prompt, max_new_tokens=1, do_sample=False, **call)
    clock.advance(10 * 365 * 24 * 3600.0)
    assert cache.sweep() == 0 and cache.stats()["bytes"] > 0
    cache.generate(prompt, max_new_tokens=1, do_sample=False)
    assert cache.last_call.cached_tokens == len(PROMPT) - 1


@pytest.mark.parametrize("batching", [False, True])
def test_a_pad_id_in_the_prompt_is_masked_as_generate_masks_it(new_cache, batching):
    """generate() masks the pad id when no mask is given (and the pad id is no EOS id); a mask of ones keeps it.
    Both ways, on the cached path and on a call served uncached (beams), the answer is generate()'s."""
    model = build_tiny("llama-gqa")
    ref = untouched(model)
    ids = torch.tensor([[62, 17, 43, 5, 59, 0, 23, 8]])  # 0 is the pad id, inside the prompt
    ones = torch.ones_like(ids)
    cache = new_cache(model, None, CacheConfig(block_size=4), batching=batching, start_sweeper=False)
    for options in ({"do_sample": False}, {"do_sample": False, "num_beams": 2}):
        for mask in (None, ones):
            want = ref.generate(ids, attention_mask=mask, max_new_tokens=4, **options)
            for _ in range(2):  # cold, then from the cache
                got = cache.generate(ids, attention_mask=mask, max_new_tokens=4, **options)
                assert torch.equal(got, want), (options, mask)
    masked = ref.generate(ids, max_new_tokens=4, do_sample=False)
    kept = ref.generate(ids, attention_mask=ones, max_new_tokens=4, do_sample=False)
    assert not torch.equal(masked, kept)  # the two readings differ: the test tells them apart
    same = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1)  # pad id = EOS id: nothing masked
    assert torch.equal(cache.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=1), same)


@pytest.mark.parametrize("batching", [False, True])
def test_a_passed_config_without_special_ids_takes_the_model_s_as_generate_does(new_cache, batching):
    """generate() fills each field a passed GenerationConfig leaves unset from the model's config: the model's EOS
    id ends the answer and its pad id is masked in the prompt, on both engines, cold and from the cache."""
    model = build_tiny("llama-gqa")
    ref = untouched(model)
    ids = torch.tensor([[62, 17, 43, 5, 59, 0, 23, 8]])  # 0 is the model's pad id, inside the prompt
    free = ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, 8:].tolist()
    stop = free[2]
    assert stop not in free[:2]
    for m in (model, ref):
        m.generation_config.eos_token_id = stop
    passed = GenerationConfig(max_new_tokens=8, do_sample=False)
    assert passed.pad_token_id is None and passed.eos_token_id is None
    want = ref.generate(ids, generation_config=passed)
    assert want[0, 8:].tolist() == free[:3]  # stopped at the model's EOS id
    kept = ref.generate(ids, attention_mask=torch.ones_like(ids), generation_config=passed)
    assert not torch.equal(want, kept)  # the pad id was masked: the test tells the two readings apart
    cache = new_cache(model, None, CacheConfig(block_size=4), batching=batching, start_sweeper=False)
    for _ in range(2):  # cold, then from the cache
        assert torch.equal(cache.generate(ids, generation_config=passed), want)
    assert cache.last_call.cached_tokens > 0


@pytest.mark.parametrize("batching", [False, True])
def test_a_passed_config_without_do_sample_samples_if_the_model_s_does(new_cache, batching):
    model = build_tiny("llama-gqa")
    ref = untouched(model)
    for m in (model, ref):
        m.generation_config.do_sample, m.generation_config.temperature = True, 1.5
    ids, passed = torch.tensor([[62, 17, 43, 5, 59, 3, 23, 8]]), GenerationConfig(max_new_tokens=8)
    cache = new_cache(model, None, CacheConfig(block_size=4), batching=batching, start_sweeper=False)
    for _ in range(2):  # cold, then from the cache
        torch.manual_seed(5)
        want = ref.generate(ids, generation_config=passed)
        assert torch.equal(cache.generate(ids, generation_config=passed, seed=5), want)
    assert not torch.equal(want, ref.generate(ids, generation_config=passed, do_sample=False))


@pytest.mark.parametrize("batching", [False, True])
def test_a_right_padded_batch_is_refused_and_a_left_padded_one_answers_as_generate(new_cache, batching):
    """generate() continues every row after its last column: a right-padded row's first new token would come off
    a pad, so no answer is both generate()'s and right. Such a call is refused (an explicit mask or one inferred
    from the pad id), nothing stored; padded on the left, the same rows answer as generate() answers them."""
    model = build_tiny("llama-gqa")
    ref = untouched(model)
    a, b = [62, 17, 43, 5, 59, 23, 8], [31, 44, 9]
    gap = [0] * (len(a) - len(b))  # 0 is the pad id
    right, left = torch.tensor([a, b + gap]), torch.tensor([a, gap + b])
    cache = new_cache(model, None, CacheConfig(block_size=4), batching=batching, start_sweeper=False)
    for mask in ((right != 0).long(), None):
        with pytest.raises(InvalidRequestError, match=r"row\(s\) \[1\] are right-padded") as err:
            cache.generate(right, attention_mask=mask, max_new_tokens=4, do_sample=False)
        assert err.value.param == "attention_mask"
    assert cache.stats()["bytes"] == 0 and cache.stats()["queries"] == 0
    want = ref.generate(left, attention_mask=(left != 0).long(), max_new_tokens=4, do_sample=False)
    assert torch.equal(cache.generate(left, attention_mask=(left != 0).long(), max_new_tokens=4, do_sample=False), want)
    wrong = ref.generate(right, attention_mask=(right != 0).long(), max_new_tokens=4, do_sample=False)
    assert wrong[1, -4:].tolist() != want[1, -4:].tolist()  # generate() itself answers the two paddings otherwise


@pytest.mark.parametrize("batching", [False, True])
def test_a_max_length_the_prompt_already_reaches_raises_as_generate_does(new_cache, batching):
    model = build_tiny("llama-gqa")
    ids = torch.arange(5, 12).unsqueeze(0)  # 7 tokens
    with pytest.raises(ValueError, match="max_length"):
        untouched(model).generate(ids, max_length=3, do_sample=False)
    cache = new_cache(model, None, CacheConfig(block_size=4), batching=batching, start_sweeper=False)
    with pytest.raises(ValueError, match="max_length"):
        cache.generate(ids, max_length=7, do_sample=False)
    want = untouched(model).generate(ids, max_length=9, do_sample=False)
    assert torch.equal(cache.generate(ids, max_length=9, do_sample=False), want)


def test_a_bad_option_fails_its_own_call_before_any_work(new_cache, chat_llama, tokenizer):
    """Checked before the call reaches the batching engine: one caller's mistake never fails a shared step."""
    from prefixcache.errors import InvalidRequestError

    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    vocab = chat_llama.get_input_embeddings().num_embeddings
    ask = [{"role": "user", "content": "Hi"}]
    bad = {"logit_bias": dict(logit_bias={vocab + 5: 1.0}), "seed": dict(seed="abc"),
           "cancel": dict(cancel=True), "on_text": dict(on_text=5), "do_sample": dict(do_sample="no"),
           "temperature": dict(temperature=float("nan")), "max_tokens": dict(max_tokens=5)}
    for param, options in bad.items():
        with pytest.raises(InvalidRequestError) as caught:
            cache.chat(ask, max_new_tokens=2, **options)
        assert caught.value.param == param, (param, caught.value)
    # Names from OpenAI's API, and typos, say what this API calls them.
    for option, hint in (("max_tokens", "max_new_tokens is"), ("stream", "on_text="),
                         ("max_new_token", "did you mean max_new_tokens?"), ("temprature", "did you mean temperature?")):
        with pytest.raises(InvalidRequestError, match=f"unknown option '{option}' \\(.*{re.escape(hint)}"):
            cache.chat(ask, **{option: 2})
    # A string or a bare message is named as such, not as characters or keys of it.
    for messages, said in (("Hi", "got a string"), (ask[0], "got one message")):
        for call in (lambda m: cache.chat(m, max_new_tokens=2), cache.encode_chat, cache.encode_chat_prompt):
            with pytest.raises(InvalidRequestError, match=f"messages must be a list .*{said}"):
                call(messages)
    for prompt in ([vocab], [-1], "text", [1.5]):
        with pytest.raises(InvalidRequestError) as caught:
            cache.answer(prompt, max_new_tokens=2)
        assert caught.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="seed"):
        cache.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, do_sample=True, seed=2**70)
    with pytest.raises(InvalidRequestError, match="cancel"):
        cache.warm(ask, cancel=True)
    assert not cache.engine_faulting and cache.batcher.failure is None
    assert cache.chat(ask, max_new_tokens=2).usage.completion_tokens == 2  # the engine serves on


@pytest.mark.parametrize("batching", [False, True])
def test_sampling_with_a_seed_draws_as_generate_does(new_cache, batching):
    """Unset in the model's config, top_k is transformers' default (50) in generate(): the same on both engines."""
    model = build_tiny("llama-gqa")
    assert model.generation_config.top_k is None or model.generation_config.top_k == 50
    ids = torch.tensor([[5, 9, 33, 41, 7]])
    cache = new_cache(model, None, CacheConfig(block_size=4), batching=batching, start_sweeper=False)
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        want = untouched(model).generate(ids, max_new_tokens=8, do_sample=True, temperature=1.5)
        assert torch.equal(cache.generate(ids, max_new_tokens=8, do_sample=True, temperature=1.5, seed=seed), want)


def test_finished_rows_are_padded_with_the_call_s_pad_id(new_cache):
    model = build_tiny("llama-gqa")
    ref = untouched(model)
    rows = [[5, 9, 33, 41, 7], [8, 21, 2, 77, 64]]
    first = ref.generate(torch.tensor([rows[0]]), max_new_tokens=6, do_sample=False)[0, 5:].tolist()
    other = ref.generate(torch.tensor([rows[1]]), max_new_tokens=6, do_sample=False)[0, 5:].tolist()
    stop = next(t for t in first[1:] if t not in other and t not in (0, 1))  # ends row 0 early, not row 1
    options = dict(max_new_tokens=6, do_sample=False, eos_token_id=stop, pad_token_id=3)  # 3: in no prompt
    want = ref.generate(torch.tensor(rows), **options)
    assert want[0].tolist()[-1] == 3  # row 0 finished and was padded
    cache = new_cache(model, None, CacheConfig(block_size=4), start_sweeper=False)
    assert torch.equal(cache.generate(torch.tensor(rows), **options), want)


def test_a_closed_cache_refuses_calls_and_arguments_are_typed(new_cache, chat_llama, tokenizer):
    from prefixcache.errors import CacheClosedError, ConfigError

    for batching in (0, None, "off"):
        with pytest.raises(ConfigError, match="batching"):
            PrefixCache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
    with pytest.raises(ConfigError, match="CacheConfig"):
        PrefixCache(chat_llama, tokenizer, {"max_bytes": 1}, start_sweeper=False)
    for batching in (False, True):
        cache = new_cache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
        cache.close()
        ask = [{"role": "user", "content": "Hi"}]
        for call in (lambda c=cache: c.chat(ask, max_new_tokens=2), lambda c=cache: c.warm(ask),
                     lambda c=cache: c.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)):
            with pytest.raises(CacheClosedError):
                call()
        cache.close()  # twice: a no-op


def test_flags_and_tenants_are_typed(new_cache, chat_llama, tokenizer):
    from prefixcache.errors import ConfigError, InvalidRequestError

    for name in ("cache_generated", "blend", "normalize_whitespace"):
        with pytest.raises(ConfigError, match=name):
            CacheConfig(**{name: "no"})
    with pytest.raises(ConfigError, match="namespace_extra"):
        CacheConfig(namespace_extra="abc")
    cache = new_cache(chat_llama, tokenizer, batching=False, start_sweeper=False)
    for tenant in (5, ""):
        with pytest.raises(InvalidRequestError, match="tenant"):
            cache.stats(tenant)
    with pytest.raises(InvalidRequestError, match="tiers"):
        cache.flush(tiers="no")


def test_a_pin_over_the_tenant_s_pin_quota_is_refused_before_it_evicts_anything(new_cache):
    """With what the tenant pinned already, the quota is checked before the prefill reserves memory (which
    may reclaim other tenants' entries): the refusal leaves everything as it was."""
    from prefixcache.errors import PinQuotaExceededError

    model = build_tiny("llama-gqa")
    per_token = new_cache(model, None, batching=False, start_sweeper=False).bytes_per_token
    config = CacheConfig(block_size=8, max_bytes=64 * per_token, tenant_pin_quota_bytes=32 * per_token,
                         max_kv_bytes_total=70 * per_token, ttl_seconds=None)
    cache = new_cache(model, None, config, batching=False, start_sweeper=False)
    cache.warm(list(range(10, 34)), tenant="a", pin=True)  # 24 tokens pinned of a's 32
    for i in range(5):  # b's entries, unpinned: 56 tokens stored in all, 14 below the KV total
        cache.warm(list(range(200 + 10 * i, 208 + 10 * i)), tenant="b")
    before = cache.stats("b")
    with pytest.raises(PinQuotaExceededError):
        cache.warm(list(range(200, 216)), tenant="a", pin=True)  # 16 more: over the quota
    after = cache.stats("b")
    assert after["bytes"] == before["bytes"] and after["evictions"] == before["evictions"]
    assert cache.stats("a")["pinned_bytes"] == 24 * per_token


def test_a_tenant_s_pin_idles_out_even_when_reads_ask_for_longer(new_cache):
    """Reads of a pinned prefix renew its pin by pin_ttl_seconds: a tenant cannot keep a pin alive past that
    idle time by reading it with a longer (or no) TTL; the operator's pins keep no deadline."""
    import math

    from tests.conftest import FakeClock

    clock = FakeClock()
    model = build_tiny("llama-gqa")
    config = CacheConfig(block_size=8, pin_ttl_seconds=3600, cache_generated=False)  # reads store nothing new
    cache = new_cache(model, None, config, clock=clock, batching=False, start_sweeper=False)
    prefix = list(range(10, 42))
    cache.warm(prefix, tenant="a", pin=True)
    cache.warm(prefix, tenant="op", pin=True, privileged=True)
    for tenant in ("a", "op"):
        cache.generate(torch.tensor([prefix]), max_new_tokens=1, do_sample=False, tenant=tenant, ttl_seconds=math.inf)
    clock.advance(2 * 3600)
    cache.sweep()
    assert cache.stats("a")["pinned_bytes"] == 0  # idle past pin_ttl_seconds: gone
    assert cache.stats("op")["pinned_bytes"] > 0  # the operator's pin has no deadline


def test_a_pin_of_a_prefix_warmed_with_a_huge_ttl_still_lapses_after_pin_ttl_seconds(new_cache):
    """The pin has a deadline of its own: the block's earlier, longer TTL does not lengthen it. Once it
    lapses the prefix is an ordinary entry (still a hit, under its TTL) and no longer counts as pinned."""
    from tests.conftest import FakeClock

    clock = FakeClock()
    model = build_tiny("llama-gqa")
    config = CacheConfig(block_size=8, pin_ttl_seconds=3600, cache_generated=False)
    cache = new_cache(model, None, config, clock=clock, batching=False, start_sweeper=False)
    prefix = list(range(10, 42))
    cache.warm(prefix, tenant="a", ttl_seconds=1e9)
    cache.warm(prefix, tenant="a", pin=True)
    pinned = cache.stats("a")["pinned_bytes"]
    assert pinned > 0
    clock.advance(3601)
    cache.sweep()
    assert cache.stats("a")["pinned_bytes"] == 0 and not cache.unpin(prefix, tenant="a")
    assert cache.stats("a")["bytes"] == pinned  # an ordinary entry now, under its own TTL
    cache.generate(torch.tensor([prefix]), max_new_tokens=1, do_sample=False, tenant="a")
    assert cache.last_call.cached_tokens == len(prefix) - 1


def test_warm_over_max_prewarm_tokens_is_refused_before_any_work(new_cache):
    """``warm`` has the proxy's prewarm cap (``CacheConfig.max_prewarm_tokens``; unset: the model's context):
    a longer prefix raises before anything is prefilled, reserved or stored."""
    from prefixcache.errors import ContextLengthExceededError

    model = build_tiny("llama-gqa")
    cache = new_cache(model, None, CacheConfig(block_size=8, max_prewarm_tokens=24), batching=False,
                      start_sweeper=False)
    for pin in (False, True):
        with pytest.raises(ContextLengthExceededError, match="at most 24") as caught:
            cache.warm(list(range(10, 35)), pin=pin)
        assert caught.value.param == "prefix"
    stats = cache.stats()
    assert stats["bytes"] == stats["entries"] == 0 and stats["kv_bytes"]["prewarm"] == 0
    assert cache.warm(list(range(10, 34))).stored_tokens == 24  # at the cap: stored
    context = model.config.max_position_embeddings
    unset = new_cache(model, None, CacheConfig(block_size=8), batching=False, start_sweeper=False)
    assert unset.max_prewarm_tokens == context
    with pytest.raises(ContextLengthExceededError):
        unset.warm([10 + i % 300 for i in range(context + 1)])
    assert unset.stats()["entries"] == 0
