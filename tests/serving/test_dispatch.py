"""Dispatch (``serving/dispatch.py``): ``PrefixCache`` sends every call the batching engine reproduces there,
the rest to the serial engine, and both give what ``model.generate()`` gives."""
from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from transformers import LogitsProcessorList, TextIteratorStreamer

from prefixcache import CacheConfig, PrefixCache
from tests.conftest import build_tiny

PROMPT = list(range(10, 40))


@pytest.fixture
def pair():
    """A tiny Llama behind the cache, and an untouched copy for reference answers."""
    model = build_tiny("llama-gqa")
    ref = copy.deepcopy(model)
    cache = PrefixCache(model, None, CacheConfig(block_size=4, ttl_seconds=None), start_sweeper=False)
    yield cache, ref
    cache.close()


def _plain(ref, prompt, **kwargs):
    return ref.generate(torch.tensor([prompt]), **kwargs)


@pytest.mark.parametrize("options", [
    {"max_new_tokens": 7, "do_sample": False},
    {"max_length": len(PROMPT) + 5, "do_sample": False},
    {"max_new_tokens": 8, "min_new_tokens": 6, "do_sample": False, "eos_token_id": 3},
    {"max_new_tokens": 8, "repetition_penalty": 1.7, "do_sample": False},
    {"max_new_tokens": 6, "do_sample": False, "eos_token_id": [5, 9], "pad_token_id": 0},
], ids=["max_new", "max_length", "min_new", "repetition", "eos_list"])
def test_generate_options_run_batched_and_match_generate(pair, options):
    cache, ref = pair
    steps = cache.batcher.steps
    got = cache.generate(torch.tensor([PROMPT]), **options)
    assert cache.last_call.executor == "batched" and cache.batcher.steps > steps
    assert got.tolist() == _plain(ref, PROMPT, **options).tolist()
    again = cache.generate(torch.tensor([PROMPT]), **options)  # now a hit: same answer
    assert cache.last_call.cached_tokens == len(PROMPT) - 1 and again.tolist() == got.tolist()


def test_a_greedy_repetition_penalty_changes_the_answer_as_in_generate(pair):
    """The penalty is applied, not ignored: it changes the tokens exactly as generate() does."""
    cache, ref = pair
    plain = _plain(ref, PROMPT, max_new_tokens=12, do_sample=False)
    penal = _plain(ref, PROMPT, max_new_tokens=12, do_sample=False, repetition_penalty=5.0)
    assert plain.tolist() != penal.tolist()  # the model repeats itself without it
    assert cache.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                          repetition_penalty=5.0).tolist() == penal.tolist()


def test_min_new_tokens_masks_eos_on_the_batched_path(pair):
    cache, ref = pair
    free = _plain(ref, PROMPT, max_new_tokens=10, do_sample=False)[0, len(PROMPT):].tolist()
    eos = free[2]  # a token the model says third: with it as EOS, generation stops there
    short = cache.generate(torch.tensor([PROMPT]), max_new_tokens=10, do_sample=False, eos_token_id=eos)
    assert short[0, len(PROMPT):].tolist() == free[:3]
    held = cache.generate(torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=5, do_sample=False,
                          eos_token_id=eos)
    assert cache.last_call.executor == "batched"
    assert held.tolist() == _plain(ref, PROMPT, max_new_tokens=10, min_new_tokens=5, do_sample=False,
                                   eos_token_id=eos).tolist()
    assert held.shape[1] - len(PROMPT) >= 5


def test_padded_batch_rows_run_together_and_match_generate(pair):
    cache, ref = pair
    rows = [PROMPT, PROMPT[:20] + [77, 78]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    got = cache.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert cache.last_call.executor == "batched"
    for i, r in enumerate(rows):
        assert got[i, width:].tolist() == _plain(ref, r, max_new_tokens=5, do_sample=False)[0, len(r):].tolist()


def test_seeded_sampling_is_reproducible_and_honours_top_k(pair):
    cache, _ = pair
    draw = [cache.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=True, temperature=1.5, seed=s)
            [0, len(PROMPT):].tolist() for s in (1, 1, 2)]
    assert cache.last_call.executor == "batched"
    assert draw[0] == draw[1] and draw[0] != draw[2]
    greedy = cache.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):].tolist()
    top1 = cache.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=True, top_k=1, seed=3)
    assert top1[0, len(PROMPT):].tolist() == greedy  # top_k=1 leaves only the argmax


def test_streamer_gets_the_prompt_then_every_token(pair):
    cache, ref = pair

    class Collect:
        def __init__(self):
            self.puts, self.ended = [], False

        def put(self, value):
            self.puts.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    stream = Collect()
    got = cache.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False, streamer=stream)
    assert cache.last_call.executor == "batched" and stream.ended
    assert stream.puts[0] == PROMPT and sum(stream.puts[1:], []) == got[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("options", [
    {"num_beams": 2, "max_new_tokens": 4, "do_sample": False},
    {"max_new_tokens": 4, "do_sample": False, "logits_processor": LogitsProcessorList([lambda ids, s: s])},
    {"max_new_tokens": 3, "do_sample": False, "no_repeat_ngram_size": 2},
], ids=["beams", "logits_processor", "no_repeat_ngram"])
def test_what_batching_cannot_reproduce_runs_serially_and_matches_generate(pair, options):
    cache, ref = pair
    steps = cache.batcher.steps
    got = cache.generate(torch.tensor([PROMPT]), **options)
    assert cache.last_call.executor == "serial" and cache.batcher.steps == steps
    assert got.tolist() == _plain(ref, PROMPT, **options).tolist()


def test_return_dict_in_generate_runs_serially(pair):
    cache, ref = pair
    out = cache.generate(torch.tensor([PROMPT]), max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                         output_scores=True)
    assert cache.last_call.executor == "serial" and len(out.scores) == 3


def test_concurrent_generate_calls_share_forward_steps(pair):
    """Four threads calling generate() at once are decoded in shared steps: the first caller's streamer
    holds the engine's loop (it runs there) until the other three are queued, so they all join."""
    cache, ref = pair
    prompts = [PROMPT + [50 + i] * (i + 1) for i in range(4)]
    queued = threading.Event()

    class Hold:
        def put(self, value):
            if value.dim() == 1 and not queued.is_set():  # a generated token: on the loop's thread
                deadline = time.monotonic() + 30
                while len(cache.batcher.scheduler.waiting) < 3 and time.monotonic() < deadline:
                    time.sleep(0.005)
                queued.set()

        def end(self):
            pass

    outs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def call(i):
        try:
            kw = {"streamer": Hold()} if i == 0 else {}
            outs[i] = cache.generate(torch.tensor([prompts[i]]), max_new_tokens=10, do_sample=False, **kw)[0].tolist()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    steps = cache.batcher.steps
    first = threading.Thread(target=call, args=(0,))
    first.start()
    while cache.batcher.steps == steps and first.is_alive():
        time.sleep(0.002)  # the first request is running before the others arrive
    others = [threading.Thread(target=call, args=(i,)) for i in range(1, 4)]
    for t in others:
        t.start()
    for t in [first, *others]:
        t.join(timeout=60)
    assert not errors and queued.is_set()
    for i, p in enumerate(prompts):
        assert outs[i] == _plain(ref, p, max_new_tokens=10, do_sample=False)[0].tolist()
    solo = sum(len(p) // 128 + 10 for p in prompts)  # steps of four calls made one after another
    assert cache.batcher.steps - steps < solo - 10, "the calls did not share forward steps"


def test_openai_penalties_and_logit_bias_run_batched_and_match_the_serial_engine(tokenizer, chat_llama):
    model = copy.deepcopy(chat_llama)
    batched = PrefixCache(model, tokenizer, CacheConfig(ttl_seconds=None), start_sweeper=False)
    serial = PrefixCache(copy.deepcopy(chat_llama), tokenizer, CacheConfig(ttl_seconds=None), start_sweeper=False,
                         batching=False)
    try:
        messages = [{"role": "user", "content": "Count the apples, please."}]
        plain = batched.chat(messages, max_new_tokens=12, ignore_eos=True).token_ids
        banned = plain[1]
        for options in ({"presence_penalty": 1.5}, {"frequency_penalty": 2.0}, {"logit_bias": {banned: -100.0}},
                        {"presence_penalty": -1.0, "frequency_penalty": 0.5, "logit_bias": {7: 3.0}}):
            got = batched.chat(messages, max_new_tokens=12, ignore_eos=True, **options)
            assert got.stats.executor == "batched"
            want = serial.chat(messages, max_new_tokens=12, ignore_eos=True, **options)
            assert want.stats.executor == "serial"
            assert got.token_ids == want.token_ids, options
        assert banned not in batched.chat(messages, max_new_tokens=12, ignore_eos=True,
                                          logit_bias={banned: -100.0}).token_ids
    finally:
        batched.close()
        serial.close()


def test_streaming_text_iterator_on_the_batched_path(tokenizer, chat_llama):
    cache = PrefixCache(copy.deepcopy(chat_llama), tokenizer, start_sweeper=False)
    try:
        ids = torch.tensor([cache.encode_text("Once upon a time")])
        stream = TextIteratorStreamer(tokenizer, skip_prompt=True)
        out = cache.generate(ids, max_new_tokens=6, do_sample=False, streamer=stream)
        assert cache.last_call.executor == "batched"
        assert "".join(stream) == tokenizer.decode(out[0, ids.shape[1]:])
    finally:
        cache.close()


@pytest.mark.parametrize("way", ["batched", "batching_off", "batching_disabled"])
def test_every_executor_honours_the_options_it_accepted(tokenizer, chat_llama, way):
    """ignore_eos, max_new_tokens, stop, penalties and seeds mean the same whichever engine serves."""
    model = copy.deepcopy(chat_llama)
    if way == "batching_disabled":
        model.set_attn_implementation("eager")  # the batching engine refuses it: every call is serial
    cache = PrefixCache(model, tokenizer, batching=way != "batching_off", start_sweeper=False)
    try:
        executor = "batched" if way == "batched" else "serial"
        messages = [{"role": "user", "content": "Tell me about apples."}]
        long = cache.chat(messages, max_new_tokens=48, ignore_eos=True, temperature=0)
        assert long.stats.executor == executor
        assert len(long.token_ids) == 48 and long.finish_reason == "length"
        stop = long.text[5:8]
        cut = cache.chat(messages, max_new_tokens=48, ignore_eos=True, temperature=0, stop=[stop])
        assert cut.finish_reason == "stop" and cut.text == long.text[: long.text.find(stop)]
        # It ends at the token whose text completes the stop string, and counts no more.
        ends = next(j for j in range(1, 49) if stop in tokenizer.decode(long.token_ids[:j], skip_special_tokens=True))
        assert cut.token_ids == long.token_ids[:ends] and cut.usage.completion_tokens == ends
        seeded = [cache.chat(messages, max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True).token_ids
                  for _ in range(2)]
        assert seeded[0] == seeded[1]
        biased = cache.chat(messages, max_new_tokens=4, ignore_eos=True, temperature=0, logit_bias={42: 100.0})
        assert biased.token_ids == (42, 42, 42, 42) and biased.stats.executor == executor
    finally:
        cache.close()
