"""Randomness is per request: no call reads or moves the process's global RNG, on either engine,
and a seeded request draws the same tokens alone and among concurrent sampled requests."""
from __future__ import annotations

import copy
import threading

import pytest
import torch

from prefixcache import CacheConfig, PrefixCache
from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.store import KVStore
from prefixcache.errors import EngineFaultError
from prefixcache.serving.engine import BatchConfig, BatchEngine
from prefixcache.serving.request import SamplingParams
from prefixcache.serving.serial import SerialEngine
from tests.conftest import FakeClock, build_tiny
from tests.serving.test_batching import SCOPE

PROMPT = list(range(10, 40))
# min_new_tokens: an unseeded draw may pick EOS early (a few % of runs), and the length is asserted.
SAMPLED = dict(max_new_tokens=10, min_new_tokens=10, do_sample=True, temperature=1.5, top_k=0)


@pytest.fixture(params=["batched", "serial"])
def cache(request):
    model = build_tiny("llama-gqa")
    cache = PrefixCache(model, None, CacheConfig(block_size=8, ttl_seconds=None), start_sweeper=False,
                        batching=request.param == "batched")
    cache.executor = request.param
    yield cache
    cache.close()


def _new(cache, prompt=PROMPT, **options):
    out = cache.generate(torch.tensor([prompt]), **SAMPLED, **options)
    return out[0, len(prompt):].tolist()


def test_seeded_and_unseeded_requests_leave_the_global_rng_state_alone(cache):
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    seeded, unseeded = _new(cache, seed=5), _new(cache)
    assert cache.last_call.executor == cache.executor
    assert torch.equal(torch.get_rng_state(), before)
    assert _new(cache, seed=5) == seeded and len(unseeded) == SAMPLED["max_new_tokens"]
    assert torch.equal(torch.get_rng_state(), before)


def test_a_seeded_request_draws_the_same_alone_and_among_concurrent_sampled_requests(cache):
    alone = _new(cache, seed=11)
    results: dict[int, list[int]] = {}
    start = threading.Barrier(4)

    def call(i: int) -> None:
        start.wait()
        # Other tenants sample at the same time, unseeded or with other seeds, on other prompts.
        options = {"seed": 11} if i == 0 else ({} if i % 2 else {"seed": 100 + i})
        results[i] = _new(cache, PROMPT[: 20 + i] + [60 + i], **options) if i else _new(cache, **options)
    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 4 and results[0] == alone


@pytest.mark.parametrize("batching", [False, True], ids=["serial", "batched"])
def test_a_seeded_call_draws_what_a_seeded_generate_draws(batching):
    model = build_tiny("llama-gqa")
    ref = copy.deepcopy(model)
    with PrefixCache(model, None, CacheConfig(block_size=8, ttl_seconds=None), start_sweeper=False,
                     batching=batching) as cache:
        got = _new(cache, seed=3)
    torch.manual_seed(3)
    want = ref.generate(torch.tensor([PROMPT]), **SAMPLED)[0, len(PROMPT):].tolist()
    assert got == want


@pytest.mark.parametrize("batching", [False, True], ids=["serial", "batched"])
def test_a_seeded_call_with_top_k_none_draws_what_generate_draws_with_it(batching):
    """generate(top_k=None) samples without a top-k (the call's None comes after transformers' default of 50); the
    batching engine draws those tokens too, as the serial engine does, and 50 where the call leaves top_k out."""
    model = build_tiny("llama-gqa")
    ref = copy.deepcopy(model)
    options = dict(max_new_tokens=10, do_sample=True, temperature=1.0)
    want = {}
    for name, extra in (("none", {"top_k": None}), ("unset", {})):
        torch.manual_seed(3)
        want[name] = ref.generate(torch.tensor([PROMPT]), **options, **extra)[0, len(PROMPT):].tolist()
    assert want["none"] != want["unset"]
    with PrefixCache(model, None, CacheConfig(block_size=8, ttl_seconds=None), start_sweeper=False,
                     batching=batching) as cache:
        for name, extra in (("none", {"top_k": None}), ("unset", {})):
            got = cache.generate(torch.tensor([PROMPT]), **options, **extra, seed=3)[0, len(PROMPT):].tolist()
            assert cache.last_call.executor == ("batched" if batching else "serial")
            assert got == want[name]


def test_an_unseeded_request_is_seeded_from_the_engines_entropy_on_both_engines():
    """Unseeded draws come from a generator of their own, seeded by the injected entropy source."""
    model = build_tiny("llama-gqa")
    clock = FakeClock()
    store = KVStore(CacheConfig(block_size=8), BlockHasher(1), clock)
    params = SamplingParams(max_new_tokens=8, temperature=1.5)

    def batched(entropy: int) -> list[int]:
        batcher = BatchEngine(model, KVStore(CacheConfig(block_size=8), BlockHasher(1), clock), clock, BatchConfig(),
                              entropy=lambda: entropy)
        try:  # drawn by inverting the distribution (``draw_inverse``), not as a seeded generate() draws
            return batcher.generate(PROMPT, SCOPE, params, timeout=30).tokens
        finally:
            batcher.close()
    assert batched(7) == batched(7) != batched(8)
    serial = SerialEngine(model, store, clock, entropy=lambda: 7)
    ids = torch.tensor([PROMPT])

    def draw(**extra):
        out, _ = serial.generate(ids, SCOPE, None, dict(SAMPLED, **extra), True)
        return out[0, len(PROMPT):].tolist()
    assert draw() == draw(seed=7) != draw(seed=8)


def test_rows_drawn_together_leave_the_seeded_and_greedy_rows_of_their_step_as_they_are():
    """``BatchConfig.draw_together`` (on by default on accelerators): unseeded rows drawn at once with
    ``draw_rows``, seeded and greedy rows of the same steps as the host draws them."""
    model = build_tiny("llama-gqa")
    clock = FakeClock()
    plain = SamplingParams(max_new_tokens=8, temperature=1.5, top_k=5, top_p=0.9)
    seeded = SamplingParams(max_new_tokens=8, temperature=1.5, top_k=5, top_p=0.9, seed=3)
    greedy = SamplingParams(max_new_tokens=8)

    def served(together: bool, entropy: int) -> list[list[int]]:
        batcher = BatchEngine(model, KVStore(CacheConfig(block_size=8), BlockHasher(1), clock), clock,
                              BatchConfig(draw_together=together), entropy=lambda: entropy)
        try:
            reqs = [batcher.submit(PROMPT[:n], SCOPE, p) for n, p in ((30, plain), (28, seeded), (26, greedy), (24, plain))]
            return [batcher.wait(r, 30).tokens for r in reqs]
        finally:
            batcher.close()
    together, again, other, apart = served(True, 7), served(True, 7), served(True, 8), served(False, 7)
    assert together == again and together[0] != other[0]
    assert together[1:3] == apart[1:3] == other[1:3]  # the seeded and the greedy rows
    # The host draws in vocabulary order, ``draw_rows`` in order of score: the same uniforms, other tokens.
    assert (together[0], together[3]) != (apart[0], apart[3])
    assert all(0 <= t < model.config.vocab_size for t in together[0] + together[3])


@pytest.mark.parametrize("together", [True, False], ids=["where-the-logits-are", "host"])
def test_seeded_rows_draw_what_a_seeded_generate_draws_beside_other_rows(together):
    """A seeded row that only warps its logits draws as ``generate()`` after ``torch.manual_seed`` does, drawn
    where its logits are (``draw_together``: its own generator there; rows of the same warps warped at once) or
    on the host, alone or in steps shared with other seeded, unseeded (top-p) and greedy rows."""
    model = build_tiny("llama-gqa")
    ref = copy.deepcopy(model)
    clock = FakeClock()
    warps = dict(temperature=1.3, top_k=20, top_p=0.9)
    prompts = {9: PROMPT, 4: PROMPT[3:] + [7, 8]}
    want = {}
    for seed, prompt in prompts.items():
        torch.manual_seed(seed)
        want[seed] = ref.generate(torch.tensor([prompt]), max_new_tokens=10, eos_token_id=None, pad_token_id=0,
                                  do_sample=True, **warps)[0, len(prompt):].tolist()
    others = [SamplingParams(max_new_tokens=10, temperature=1.1, top_p=0.8), SamplingParams(max_new_tokens=10),
              SamplingParams(max_new_tokens=10, temperature=0.7, seed=4)]
    batcher = BatchEngine(model, KVStore(CacheConfig(block_size=8), BlockHasher(1), clock), clock,
                          BatchConfig(draw_together=together), entropy=lambda: 5)
    try:
        alone = batcher.submit(PROMPT, SCOPE, SamplingParams(max_new_tokens=10, seed=9, **warps))
        assert batcher.wait(alone, 30).tokens == want[9]
        shared = [batcher.submit(prompt, SCOPE, SamplingParams(max_new_tokens=10, seed=seed, **warps))
                  for seed, prompt in prompts.items()]
        shared += [batcher.submit(PROMPT[:20 + i], SCOPE, p) for i, p in enumerate(others)]
        assert [batcher.wait(r, 30).tokens for r in shared][:2] == [want[9], want[4]]
        # Where they drew: a generator on the logits' device, or the host's.
        assert all((r.device_generator is not None) == together for r in [alone, *shared[:2], shared[-1]])
    finally:
        batcher.close()


def test_each_row_of_a_mixed_step_gets_its_own_token_while_other_prompts_prefill():
    """Greedy rows, rows drawn together, rows drawn on the host and seeded rows in the same steps, with
    prompts still prefilling beside them (small chunks): a top-k of 1 draws its own row's argmax wherever it
    is drawn, so each request gets what it gets alone; a row read from another's logits would not."""
    model = build_tiny("llama-gqa")
    clock = FakeClock()
    one = dict(max_new_tokens=6, temperature=1.5, top_k=1)
    jobs = [(PROMPT[:30], SamplingParams(max_new_tokens=6)),
            (PROMPT[3:27] + [77], SamplingParams(**one)),  # drawn together
            (list(range(50, 98)), SamplingParams(**one, top_p=0.5)),  # prefills while the others decode
            (PROMPT[5:25], SamplingParams(**one, repetition_penalty=1.3)),  # on the host
            (PROMPT[:17] + [90], SamplingParams(max_new_tokens=6, temperature=1.5, seed=4)),
            (PROMPT[8:30], SamplingParams(**one, top_p=0.9))]

    def served(batch: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
        batcher = BatchEngine(model, KVStore(CacheConfig(block_size=8), BlockHasher(1), clock), clock,
                              BatchConfig(draw_together=True, token_budget=16, prefill_chunk=8), entropy=lambda: 7)
        try:
            reqs = [batcher.submit(prompt, SCOPE, p) for prompt, p in batch]
            return [batcher.wait(r, 30).tokens for r in reqs]
        finally:
            batcher.close()
    alone = [served([job])[0] for job in jobs]
    assert served(jobs) == alone
    assert alone[3] == served([(jobs[3][0], SamplingParams(max_new_tokens=6, repetition_penalty=1.3))])[0]


@pytest.mark.parametrize("together", [True, False], ids=["together", "host"])
def test_logits_that_are_no_distribution_fail_the_step_drawn_together_or_not(together):
    """A NaN logit (here from a broken weight) fails the step's sampled requests with an EngineFaultError,
    never a token read off garbage; the engine serves the next request."""
    model = build_tiny("llama-gqa")
    clock = FakeClock()
    batcher = BatchEngine(model, KVStore(CacheConfig(block_size=8), BlockHasher(1), clock), clock,
                          BatchConfig(draw_together=together), entropy=lambda: 7)
    weight = model.lm_head.weight
    saved = weight[5].clone()
    try:
        for params in (SamplingParams(max_new_tokens=3, temperature=1.0),
                       SamplingParams(max_new_tokens=3, temperature=0.8, top_k=5, top_p=0.9),
                       SamplingParams(max_new_tokens=3, temperature=0.8, top_p=0.9, seed=2)):
            with torch.no_grad():
                weight[5] = float("nan")
            with pytest.raises(EngineFaultError, match="probability"):
                batcher.generate(PROMPT, SCOPE, params, timeout=30)
            with torch.no_grad():
                weight[5] = saved
            assert len(batcher.generate(PROMPT, SCOPE, params, timeout=30).tokens) == 3
    finally:
        batcher.close()
