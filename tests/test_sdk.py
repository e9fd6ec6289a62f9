"""The SDK surface: chat, completions, streaming, stop, cancel, warm/pin, TTL, limits."""
from __future__ import annotations

import copy
import threading

import numpy as np
import pytest
import torch

from prefixcache import (
    CacheConfig,
    CapacityError,
    ContextLengthExceededError,
    InvalidRequestError,
    PrefixCache,
)
from prefixcache.sdk import _list_ids
from tests.conftest import untouched

SYSTEM = {"role": "system", "content": "You are a terse assistant. " + "Always answer briefly. " * 40}


def test_second_chat_turn_reuses_prompt_and_answer(default_model, new_cache):
    model, tokenizer = default_model
    cache = new_cache(model, tokenizer, start_sweeper=False)
    turn1 = [SYSTEM, {"role": "user", "content": "What is the capital of France?"}]
    first = cache.chat(turn1, max_new_tokens=12)
    prompt1 = cache.encode_chat(turn1)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    second = cache.chat(turn2, max_new_tokens=8)
    answer_tokens = len(first.token_ids) - 1  # the final token's KV was never computed
    assert second.usage.cached_tokens >= len(prompt1) + answer_tokens - 1, (second.usage, len(prompt1))
    # and the answer is what an uncached model says
    ids = torch.tensor([cache.encode_chat(turn2)])
    ref = untouched(model).generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert list(second.token_ids) == ref.tolist()


def test_streaming_deltas_add_up_to_the_text(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    deltas: list[str] = []
    res = cache.chat([{"role": "user", "content": "hi"}], max_new_tokens=12, on_text=deltas.append)
    assert "".join(deltas) == res.text and res.usage.completion_tokens == len(res.token_ids)
    assert res.finish_reason in ("stop", "length")


def test_stop_strings_cut_the_text_and_the_stream(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    free = cache.chat([{"role": "user", "content": "go"}], max_new_tokens=16)
    if len(free.text) < 4:
        pytest.skip("model produced too little text to cut")
    stop = free.text[2:4]
    deltas: list[str] = []
    res = cache.chat([{"role": "user", "content": "go"}], max_new_tokens=16, stop=[stop], on_text=deltas.append)
    assert res.text == free.text[: free.text.find(stop)] and res.finish_reason == "stop"
    assert "".join(deltas) == res.text


def test_cancel_stops_generation(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    cancel = threading.Event()
    seen: list[str] = []

    def on_text(delta: str) -> None:
        seen.append(delta)
        cancel.set()

    res = cache.chat([{"role": "user", "content": "go on"}], max_new_tokens=200, on_text=on_text, cancel=cancel)
    assert res.finish_reason == "cancelled" and len(res.token_ids) < 20
    assert all(n.refcount == 0 for n in cache.store.trie.iter_nodes())


def test_context_length_is_checked(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    with pytest.raises(ContextLengthExceededError, match="context of 2048"):
        cache.complete("word " * 2000, max_new_tokens=100)


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"max_new_tokens": 0},
                                    {"ttl_seconds": -5}, {"tenant": ""}])
def test_bad_options_raise(chat_llama, tokenizer, kwargs, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    with pytest.raises(InvalidRequestError):
        cache.complete("hello", **{"max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize("ids", [[5, 6, 7], [[5, 6, 7]], [[5, 6], [7, 8]], ((1, 2),), [True, 3],
                                 [np.int64(4), 9], [[1, 2], [3]], [[2.0, 3.0]], [], [[]], [2 ** 70], [["a"]]])
def test_list_input_ids_read_as_torch_reads_them(ids):
    """Lists of ints take a faster path than ``torch.tensor``; every input reads the same, or fails cleanly."""
    try:
        expected = torch.tensor(ids, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        expected = None
    if expected is None:
        with pytest.raises((TypeError, ValueError, OverflowError)):
            _list_ids(ids)
    else:
        got = _list_ids(ids)
        assert got.dtype == torch.long and torch.equal(got, expected)


def test_input_ids_out_of_range_or_not_ints_are_clear_errors(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    for bad in ([[2 ** 70]], [["a"]], [[1, 2], [3]], [[]]):
        with pytest.raises(InvalidRequestError, match="input_ids|token ids"):
            cache.generate(bad, max_new_tokens=1)


def test_answering_without_a_tokenizer_is_a_clear_error_before_any_work(chat_llama, new_cache):
    """generate() takes ids without a tokenizer; answer() (text out) says it needs one, and computes nothing."""
    cache = new_cache(chat_llama, start_sweeper=False)
    with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
        cache.answer([5, 6, 7], max_new_tokens=2)
    assert cache.stats()["queries"] == 0 and cache.stats()["bytes"] == 0
    assert cache.generate([[5, 6, 7]], max_new_tokens=2, do_sample=False).shape == (1, 5)


WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "ocean", "candle")


def test_warm_then_chat_hits_and_pin_survives_pressure(chat_llama, tokenizer, clock, new_cache):
    """Unpinned traffic larger than the budget forces LRU evictions; the pinned prefix stays.

    The clock never moves, so only memory pressure can evict: without the pin, the
    warmed prefix is the least recently used entry and would go first.
    """
    probe = new_cache(chat_llama, tokenizer, start_sweeper=False)
    per_token = probe.bytes_per_token
    budget = per_token * 700
    cache = new_cache(chat_llama, tokenizer, CacheConfig(max_bytes=budget), clock=clock, start_sweeper=False)
    warmed = cache.warm([SYSTEM], pin=True, privileged=True)  # the operator: no pin quota, no pin TTL
    assert warmed.stored_tokens == warmed.prompt_tokens and warmed.pinned
    pinned = cache.stats()["pinned_bytes"]
    assert pinned == warmed.prompt_tokens * per_token
    fillers = [f"{word} " * 150 for word in WORDS]  # ~150 tokens each, sharing nothing with SYSTEM
    assert sum(len(cache.encode_text(f)) for f in fillers) * per_token > 2 * budget
    for text in fillers:
        cache.complete(text, max_new_tokens=2)
        assert cache.stats()["bytes"] <= budget
    stats = cache.stats()
    assert stats["evictions"]["lru"] > 0 and stats["pinned_bytes"] == pinned
    # the oldest unpinned entry was evicted, the pinned one was not
    assert cache.complete(fillers[0], max_new_tokens=1).usage.cached_tokens < 5
    res = cache.chat([SYSTEM, {"role": "user", "content": "hello"}], max_new_tokens=2)
    assert res.usage.cached_tokens >= warmed.prompt_tokens - 1
    assert not cache.unpin([SYSTEM]), "the operator's pin is not the tenant's to undo"
    assert cache.unpin([SYSTEM], privileged=True) and cache.stats()["pinned_bytes"] == 0
    cache.check_integrity()


def test_pin_without_ttl_outlives_the_default_ttl(chat_llama, tokenizer, clock, new_cache):
    cache = new_cache(chat_llama, tokenizer, clock=clock, start_sweeper=False)
    warmed = cache.warm([SYSTEM], pin=True)
    cache.complete("unpinned traffic " * 20, max_new_tokens=2)
    clock.advance(cache.config.ttl_seconds * 10)
    freed = cache.sweep()
    assert freed > 0 and cache.stats()["evictions"]["ttl"] > 0  # the unpinned entry expired
    assert cache.stats()["bytes"] == cache.stats()["pinned_bytes"] > 0
    res = cache.chat([SYSTEM, {"role": "user", "content": "hello"}], max_new_tokens=2)
    assert res.usage.cached_tokens >= warmed.prompt_tokens - 1


def test_pin_that_cannot_fit_is_refused(chat_llama, tokenizer, new_cache):
    per_token = new_cache(chat_llama, tokenizer, start_sweeper=False).bytes_per_token
    cache = new_cache(chat_llama, tokenizer, CacheConfig(max_bytes=per_token * 50), start_sweeper=False)
    with pytest.raises(CapacityError, match="cannot pin"):
        cache.warm([SYSTEM], pin=True)
    # and ordinary requests still succeed, uncached, under the same pressure
    res = cache.chat([SYSTEM, {"role": "user", "content": "hi"}], max_new_tokens=2)
    assert res.usage.completion_tokens >= 1


def test_pin_errors_report_only_the_callers_own_figures(chat_llama, tokenizer, new_cache):
    per_token = new_cache(chat_llama, tokenizer, start_sweeper=False).bytes_per_token
    budget = per_token * 400
    cache = new_cache(chat_llama, tokenizer, CacheConfig(max_bytes=budget, tenant_pin_quota_bytes=budget),
                        start_sweeper=False)
    other = cache.warm([{"role": "system", "content": "Another tenant's prompt. " * 30}], tenant="t2", pin=True)
    theirs = cache.stats("t2")["pinned_bytes"]
    assert other.pinned and theirs > 0
    with pytest.raises(CapacityError, match="cannot pin") as info:
        cache.warm([SYSTEM] * 2, tenant="t1", pin=True)  # larger than what is left of the budget
    assert str(theirs) not in str(info.value) and "0 of them pinned" in str(info.value)


def test_a_tenants_pin_is_bounded_by_the_pin_quota_and_the_pin_ttl(chat_llama, tokenizer, clock, new_cache):
    import math

    from prefixcache import PinQuotaExceededError

    per_token = new_cache(chat_llama, tokenizer, start_sweeper=False).bytes_per_token
    cache = new_cache(chat_llama, tokenizer, CacheConfig(max_bytes=per_token * 4000, pin_ttl_seconds=100),
                        clock=clock, start_sweeper=False)
    with pytest.raises(PinQuotaExceededError):  # the default quota: 500 tokens here
        cache.warm([SYSTEM] * 3, tenant="t1", pin=True)
    assert cache.stats("t1")["bytes"] == 0  # refused whole, nothing stored
    msgs = [SYSTEM, {"role": "user", "content": "hello"}]
    cache.warm([SYSTEM], tenant="t1", pin=True, ttl_seconds=math.inf)  # no TTL asked: the pin TTL applies
    cache.warm([SYSTEM], tenant="t2", pin=True, privileged=True)  # the operator's pin has none
    clock.advance(101)
    assert cache.chat(msgs, max_new_tokens=2, tenant="t1").usage.cached_tokens == 0
    assert cache.chat(msgs, max_new_tokens=2, tenant="t2").usage.cached_tokens > 0
    cache.check_integrity()


def test_ttl_override_expires_with_injected_clock(chat_llama, tokenizer, clock, new_cache):
    cache = new_cache(chat_llama, tokenizer, clock=clock, start_sweeper=False)
    msgs = [SYSTEM, {"role": "user", "content": "hello"}]
    cache.chat(msgs, max_new_tokens=2, ttl_seconds=10)
    clock.advance(11)
    assert cache.chat(msgs, max_new_tokens=2, ttl_seconds=10).usage.cached_tokens == 0
    held = cache.stats()["bytes"]  # the second call stored the prompt again, with the same TTL
    assert held > 0
    clock.advance(11)
    assert cache.sweep() == held
    assert cache.stats()["bytes"] == 0 and cache.stats()["entries"] == 0 and cache.stats()["evictions"]["ttl"] > 0


def test_stats_and_flush(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    msgs = [SYSTEM, {"role": "user", "content": "hello"}]
    cache.chat(msgs, max_new_tokens=2, tenant="t1")
    cache.chat(msgs, max_new_tokens=2, tenant="t1")
    s = cache.stats("t1")
    assert s["queries"] == 2 and s["hits"] == 1 and s["misses"] == 1 and s["hit_rate"] == 0.5
    assert s["bytes"] > 0 and s["entries"] > 0 and s["cached_tokens"] > 0
    assert cache.stats("t2")["queries"] == 0 and cache.stats("t2")["bytes"] == 0
    assert cache.flush("t1") == s["bytes"]
    assert cache.stats()["bytes"] == 0 and cache.stats()["evictions"]["flush"] > 0


SAMPLE_PROMPT = [{"role": "user", "content": "tell me"}]


def _draws(cache: PrefixCache, seeds, **sampling) -> list[tuple[int, ...]]:
    return [cache.chat(SAMPLE_PROMPT, max_new_tokens=8, ignore_eos=True, seed=s, **sampling).token_ids for s in seeds]


def test_sampling_with_seed_is_reproducible_and_the_seed_matters(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    a, b = _draws(cache, [7, 7], temperature=0.9)
    assert a == b and cache.last_call.cached_tokens > 0
    # The random model is nearly uniform over ~49k tokens: other seeds give other answers.
    assert len(set(_draws(cache, range(4), temperature=0.9))) == 4


def test_tiny_top_p_is_greedy(chat_llama, tokenizer, new_cache):
    """top_p keeps only the most likely token when tiny: if it were ignored, T=1 would sample widely."""
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    greedy = cache.chat(SAMPLE_PROMPT, max_new_tokens=8, ignore_eos=True).token_ids
    assert set(_draws(cache, range(3), temperature=1.0, top_p=1e-6)) == {greedy}
    assert greedy not in _draws(cache, range(3), temperature=1.0, top_p=1.0)


def test_top_k_one_is_greedy(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    greedy = cache.chat(SAMPLE_PROMPT, max_new_tokens=8, ignore_eos=True).token_ids
    assert set(_draws(cache, range(3), temperature=1.0, top_k=1)) == {greedy}


def test_temperature_shapes_the_distribution(chat_llama, tokenizer, new_cache):
    """Same seeds, low vs high temperature: low keeps the greedy first token, high spreads out.

    Were temperature ignored, the same seeds would draw the same tokens at both settings
    (and the random model's nearly flat distribution would not stay on the greedy token).
    """
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    top = cache.chat(SAMPLE_PROMPT, max_new_tokens=1).token_ids[0]
    seeds = range(8)
    first = lambda t: [cache.chat(SAMPLE_PROMPT, max_new_tokens=1, seed=s, temperature=t).token_ids[0]  # noqa: E731
                       for s in seeds]
    cold, hot = first(0.002), first(2.0)
    assert cold == [top] * len(seeds)
    assert hot.count(top) <= 1 and len(set(hot)) >= len(seeds) - 1, hot


def test_invalid_unicode_and_stop_are_clear_errors(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    with pytest.raises(InvalidRequestError, match="UTF-8"):
        cache.chat([{"role": "user", "content": "bad \ud800 text"}], max_new_tokens=2)
    with pytest.raises(InvalidRequestError, match="UTF-8"):
        cache.complete("fine", max_new_tokens=2, stop=["\udfff"])
    with pytest.raises(InvalidRequestError, match="stop"):
        cache.complete("fine", max_new_tokens=2, stop=[""])


def test_tiny_temperature_is_greedy(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    msgs = [{"role": "user", "content": "count"}]
    assert cache.chat(msgs, max_new_tokens=6, temperature=1e-300).token_ids == cache.chat(msgs, max_new_tokens=6).token_ids


def test_answer_takes_encoded_ids_and_stats_are_per_tenant(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    ids = cache.encode_chat([SYSTEM, {"role": "user", "content": "hello"}])
    res = cache.answer(ids, max_new_tokens=3, tenant="t1")
    assert res.usage.prompt_tokens == len(ids)
    cache.answer(ids, max_new_tokens=3, tenant="t2")
    one, all_ = cache.stats("t1"), cache.stats()
    assert 0 < one["entries"] < all_["entries"] and one["bytes"] < all_["bytes"]
    assert one["tenant_bytes"] == {"t1": one["bytes"]} and one["leased_entries"] == 0


@pytest.mark.parametrize("path", ["batched", "plain"])
def test_ignore_eos_generates_up_to_max_new_tokens(chat_llama, tokenizer, path, new_cache):
    reference = untouched(chat_llama)
    model = copy.deepcopy(reference)
    ids = new_cache(model, tokenizer, start_sweeper=False).encode_text("count to ten")
    want = reference.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    model.generation_config.eos_token_id = want[0]  # the first greedy token now ends the answer
    cache = new_cache(model, tokenizer, start_sweeper=False)
    extra = {} if path == "batched" else {"repetition_penalty": 1.0}  # any generate() kwarg: the plain engine
    stopped = cache.answer(ids, max_new_tokens=6, **extra)
    assert list(stopped.token_ids) == want[:1] and stopped.finish_reason == "stop"
    full = cache.answer(ids, max_new_tokens=6, ignore_eos=True, **extra)
    assert list(full.token_ids) == want and full.finish_reason == "length"
