"""Several choices for one prompt (``n``) through a live proxy with the official ``openai`` client, on both
engines: greedy choices equal, seeded ones reproducible per choice and different across choices, streamed
as not streamed, the prompt counted once and prefilled once, the server's limit and the key's places, and a
request that fails whole when one of its choices fails."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch
from prefixcache_api import create_app
from prefixcache_api.jobs import choice_seed
from proxy_support import ALPHA, MODEL, auth, live, make_cache, metric_samples, settings, wait_until

from prefixcache import CacheConfig, PrefixCache
from tests.api.test_proxy_abnormal_ends import CHAT, SERVED, WORD, assert_idle_and_exact, errors, totals
from tests.api.test_proxy_tool_calls import ASK, WEATHER, strict
from tests.step_hooks import HOLD_LIMIT, hold_until_cancelled
from tests.support.tool_templates import BROKEN, family_tokenizer, scripted_model

MESSAGES = [{"role": "user", "content": "Write three words about the sea, then stop. Keep it short please."}]


@pytest.fixture(scope="module", params=[True, False], ids=["batched", "serial"])
def proxy(request, tiny_model, tokenizer):
    """A live server on the tiny model, with the batching engine (batched) or without it (serial)."""
    cache = PrefixCache(tiny_model, tokenizer, CacheConfig(max_bytes=256 << 20), batching=request.param)
    with live(create_app(settings(workers=4), cache=cache)) as srv:
        yield srv
    cache.close()


def chat(client, max_tokens=12, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, **kwargs)


def streamed_chat(client, n, **kwargs):
    """(content by choice, finish_reason by choice, usage) of a streamed chat."""
    texts, finishes, usage = [""] * n, [None] * n, None
    for chunk in chat(client, n=n, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                assert finishes[c.index] is None  # one finish per choice
                finishes[c.index] = c.finish_reason
    return texts, finishes, usage


def cached_read(srv) -> int:
    """The cached tokens every generation of the key read so far (the cache's stats)."""
    return srv.client(ALPHA).get("/v1/cache/stats").json()["cached_tokens"]


def generated(srv) -> int:
    """The tokens every generation of the key produced so far, those cut short included (the cache's stats)."""
    return srv.client(ALPHA).get("/v1/cache/stats").json()["completion_tokens"]


def test_greedy_choices_are_equal_and_the_prompt_is_counted_and_prefilled_once(proxy):
    client = proxy.openai(ALPHA)
    proxy.cache.flush()
    before = cached_read(proxy)
    many = chat(client, n=3, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.message.content for c in many.choices}) == 1
    assert all(c.finish_reason in ("stop", "length") for c in many.choices)
    one = chat(client, temperature=0)
    assert many.choices[0].message.content == one.choices[0].message.content
    prompt = one.usage.prompt_tokens
    assert many.usage.prompt_tokens == prompt  # counted once, as OpenAI does
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert many.usage.total_tokens == prompt + many.usage.completion_tokens
    assert many.usage.prompt_tokens_details.cached_tokens == 0  # a fresh prompt: its one prefill read nothing
    # Each choice counted by what the one prefill read (nothing), as one choice would be; the n=1 call read it.
    assert cached_read(proxy) - before == prompt - 1
    again = chat(client, n=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert [c.message.content for c in again.choices] == [c.message.content for c in many.choices]


COUNTS = ("queries", "hits", "partial_hits", "misses", "prompt_tokens", "cached_tokens")


def counts(srv) -> dict[str, int]:
    """The key's generation counters (the cache's stats)."""
    stats = srv.client(ALPHA).get("/v1/cache/stats").json()
    return {name: stats[name] for name in COUNTS}


def counted(srv, **kwargs) -> tuple[dict[str, int], object]:
    """(how far the counters moved, the answer) of one chat on a prompt the cache does not hold."""
    srv.cache.flush()
    before = counts(srv)
    answer = chat(srv.openai(ALPHA), temperature=0, **kwargs)
    after = counts(srv)
    return {name: after[name] - before[name] for name in COUNTS}, answer


def test_the_cache_stats_count_each_choice_as_one_choice_would_be(proxy):
    """/v1/cache/stats (and ``prefixcache_hit_ratio``) count each choice a generation, by what the prompt's one
    prefill ahead read: a fresh prompt's three choices are three misses, as three requests of one choice would
    be, not hits on the prompt that prefill stored; a prompt held before, three hits."""
    one, _ = counted(proxy)
    assert one["queries"] == 1 and one["misses"] == 1
    many, answer = counted(proxy, n=3)
    assert many == {name: 3 * value for name, value in one.items()}
    assert many["hits"] == many["cached_tokens"] == 0
    before = counts(proxy)
    chat(proxy.openai(ALPHA), n=3, temperature=0)
    moved = {name: value - before[name] for name, value in counts(proxy).items()}
    assert moved == {"queries": 3, "hits": 3, "partial_hits": 0, "misses": 0, "prompt_tokens": 3 * answer.usage.prompt_tokens,
                     "cached_tokens": 3 * (answer.usage.prompt_tokens - 1)}


def test_seeded_choices_are_reproducible_and_differ(proxy):
    client = proxy.openai(ALPHA)
    first = [c.message.content for c in chat(client, n=3, temperature=1.0, seed=11).choices]
    assert len(set(first)) == 3
    assert [c.message.content for c in chat(client, n=3, temperature=1.0, seed=11).choices] == first
    # Choice 0 samples with the seed itself: as the request without n.
    assert chat(client, temperature=1.0, seed=11).choices[0].message.content == first[0]
    assert [c.message.content for c in chat(client, n=3, temperature=1.0, seed=12).choices] != first
    unseeded = [c.message.content for c in chat(client, n=3, temperature=1.0).choices]
    assert len(set(unseeded)) == 3  # independent draws


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_streamed_equals_not_streamed(proxy, sampling):
    client = proxy.openai(ALPHA)
    whole = chat(client, n=3, **sampling)
    texts, finishes, usage = streamed_chat(client, 3, **sampling)
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_streamed_usage_rides_on_the_last_finish_without_include_usage(proxy):
    chunks = list(chat(proxy.openai(ALPHA), n=2, temperature=0, stream=True))
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert sorted(c.choices[0].index for c in finishing) == [0, 1]
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert finishing[-1] is chunks[-1]


def test_completions_choices_streamed_and_not(proxy):
    client = proxy.openai(ALPHA)
    kwargs = dict(model=MODEL, prompt="The sea is", max_tokens=10, n=3, temperature=1.0, seed=9, echo=True)
    whole = client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.text.startswith("The sea is") for c in whole.choices)
    assert len({c.text for c in whole.choices}) == 3
    one = client.completions.create(**{**kwargs, "n": 1})
    assert whole.usage.prompt_tokens == one.usage.prompt_tokens
    texts = [""] * 3
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]


def test_n_over_the_server_limit_is_a_400_naming_n(proxy):
    client = proxy.openai(ALPHA)
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, n=9)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", n=9)
    assert info.value.body["param"] == "n"


def test_choices_take_the_keys_places(tiny_model, tokenizer):
    """A key with two places in flight: n=2 is served (one worker: the choices one after the other, streamed
    too), n=3 could never be (400 naming n, not a 429 to retry)."""
    cache = PrefixCache(tiny_model, tokenizer, CacheConfig(max_bytes=256 << 20))
    try:
        with live(create_app(settings(tenant_max_in_flight=2, max_n=8, workers=1), cache=cache)) as srv:
            client = srv.openai(ALPHA)
            texts = [c.message.content for c in chat(client, n=2, temperature=1.0, seed=4).choices]
            assert streamed_chat(client, 2, temperature=1.0, seed=4)[0] == texts
            with pytest.raises(openai.BadRequestError) as info:
                chat(client, n=3)
            assert info.value.body["param"] == "n"
            assert srv.app.state.serving.admission.in_flight("alpha") == 0  # every place given back
    finally:
        cache.close()


@pytest.fixture
def own(tiny_model, tokenizer):
    """A batching server of its own (its counters and queue move only with the test)."""
    cache = make_cache(tiny_model, tokenizer)
    with live(create_app(settings(workers=4), cache=cache)) as srv:
        yield srv
    cache.close()


def test_a_client_gone_mid_stream_cancels_every_choice_and_counts_one_499(own):
    before, produced = totals(own), generated(own)
    closed = errors(own, CHAT, 499)
    with hold_until_cancelled(own.cache):  # all three still answering (1,500 tokens each) when the client leaves
        stream = chat(own.openai(ALPHA), n=3, max_tokens=1500, stream=True, logit_bias={str(WORD): 100})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        stream.close()
        assert_idle_and_exact(own)  # every choice stopped, all they held given back
    wait_until(lambda: errors(own, CHAT, 499) > closed, timeout=10)
    assert errors(own, CHAT, 499) == closed + 1
    after = totals(own)
    assert {name: after.get(name, 0.0) for name in SERVED} == {name: before.get(name, 0.0) for name in SERVED}
    assert own.serving.admission.in_flight("alpha") == 0
    assert generated(own) - produced < 1500  # each choice stopped: none ran on to its max_tokens


def test_a_failed_step_fails_the_request_and_leaves_nothing_running(own, monkeypatch):
    runner, raised = own.cache.batcher.runner, []
    real = runner.run

    def run_fails_once(plan):
        if not raised and len(plan) > 1:  # a step of the choices together
            raised.append(True)
            raise torch.OutOfMemoryError("alloc")
        return real(plan)
    monkeypatch.setattr(runner, "run", run_fails_once)
    client = own.openai(ALPHA)
    with pytest.raises(openai.InternalServerError) as info:
        chat(client, n=3)
    assert info.value.status_code == 503 and info.value.body["code"] == "engine_fault"
    assert_idle_and_exact(own)
    assert own.serving.admission.in_flight("alpha") == 0
    assert len(chat(client, n=3).choices) == 3


@pytest.fixture(scope="module", params=[True, False], ids=["batched", "serial"])
def scripted(request, tokenizer):
    """A live server on the scripted Hermes model (``tests/support/tool_templates.py``), on either engine."""
    tok = family_tokenizer(tokenizer, "hermes")
    cache = PrefixCache(scripted_model(tok, "hermes"), tok, CacheConfig(max_bytes=256 << 20), batching=request.param)
    with live(create_app(settings(workers=4), cache=cache)) as srv:
        yield tok, srv
    cache.close()


def test_a_choice_that_fails_fails_the_request_and_stops_the_others(scripted):
    """Two choices at temperature 1, the scripted model's broken call biased to be as likely as its call: with
    seed 0 choice 0 writes the broken call and choice 1 the call, with seed 5 the other way round. To a strict tool
    the broken call is the 500 tool_arguments_invalid, and the whole request fails, streamed (an error event ends
    it) or not, never an answer short of a choice, and all the choices held is given back."""
    tok, srv = scripted
    client = srv.openai(ALPHA)
    tie = {str(tok.convert_tokens_to_ids(BROKEN["hermes"][0])): 40}  # the call's first token's logit
    body = dict(model=MODEL, messages=ASK, n=2, temperature=1.0, max_tokens=16, logit_bias=tie)
    for seed, broken in ((0, 0), (5, 1)):
        loose = client.chat.completions.create(**body, seed=seed, tools=[WEATHER])  # a loose tool's: text
        assert [c.message.tool_calls is None for c in loose.choices] == [i == broken for i in range(2)]
        failed = errors(srv, CHAT, 500)
        with pytest.raises(openai.InternalServerError, match="strict tool 'get_weather' is not JSON") as err:
            client.chat.completions.create(**body, seed=seed, tools=[strict(WEATHER)])
        assert err.value.body["code"] == "tool_arguments_invalid"
        with pytest.raises(openai.APIError, match="strict tool 'get_weather' is not JSON"):
            list(client.chat.completions.create(**body, seed=seed, tools=[strict(WEATHER)], stream=True))
        assert_idle_and_exact(srv)
        assert srv.serving.admission.in_flight("alpha") == 0
        assert errors(srv, CHAT, 500) == failed + 2


def test_a_choice_whose_generation_raises_fails_the_request_and_leaves_nothing_held(scripted, monkeypatch):
    """The model's forward raises once its input holds the broken call's first token (an injected fault): with
    seed 0 only choice 0 writes it. On the serial engine each choice runs on its own, so choice 0 alone fails, a
    500; on the batching engine the step holding both fails, the 503 engine_fault. The request fails whole,
    counted once as its error and never as served, and nothing stays held."""
    tok, srv = scripted
    model, token = srv.cache.model, tok.convert_tokens_to_ids(BROKEN["hermes"][0])
    forward = model.forward

    def faulty(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and bool((ids == token).any()):
            raise RuntimeError("injected fault")
        return forward(*args, **kwargs)
    monkeypatch.setattr(model, "forward", faulty)
    client, before = srv.openai(ALPHA).with_options(max_retries=0), totals(srv)
    status = 503 if srv.cache.batcher is not None else 500
    failed = errors(srv, CHAT, status)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, n=2, temperature=1.0, max_tokens=16, seed=0,
                                       logit_bias={str(token): 40})
    assert err.value.status_code == status
    assert err.value.body["code"] == ("engine_fault" if status == 503 else "internal_error")
    assert_idle_and_exact(srv)
    assert srv.serving.admission.in_flight("alpha") == 0
    wait_until(lambda: errors(srv, CHAT, status) > failed, timeout=10)
    assert errors(srv, CHAT, status) == failed + 1
    after = totals(srv)
    assert {name: after.get(name, 0.0) for name in SERVED} == {name: before.get(name, 0.0) for name in SERVED}


def test_a_prompt_that_cannot_be_prefilled_ahead_is_computed_by_the_choices(tiny_model, tokenizer):
    """A prompt over the prewarm limit is not prefilled ahead: each choice computes what the cache lacks, the
    answers as when it is, and cached_tokens the least any choice read."""
    cache = make_cache(tiny_model, tokenizer, max_prewarm_tokens=8)
    try:
        with live(create_app(settings(workers=4), cache=cache)) as srv:
            client = srv.openai(ALPHA)
            many = chat(client, n=3, temperature=0)
            one = chat(client, temperature=0)
            assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 3
            assert many.usage.prompt_tokens == one.usage.prompt_tokens
            assert many.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        cache.close()


def test_the_choices_decode_in_the_same_steps_and_none_prefills_the_prompt(own, monkeypatch):
    """On the batching engine: the choices' steps hold all three together, and no choice feeds more than one
    prompt token (the last; the rest is read from the cache, where the one prefill ahead stored it)."""
    engine, plans, joined = own.cache.batcher, [], []
    real = engine.runner.run

    def run(plan):
        # The first steps wait (at most HOLD_LIMIT s) until the three choices have reached the engine: they
        # were submitted together, so it is never long; a choice that could not join would time the hold out.
        deadline = time.monotonic() + HOLD_LIMIT
        while not joined and time.monotonic() < deadline:
            if len(engine.scheduler.running) + len(engine.scheduler.waiting) >= 3:
                joined.append(True)
            time.sleep(0.005)
        plans.append([(len(req.output), fed) for req, fed in plan])
        return real(plan)
    monkeypatch.setattr(engine.runner, "run", run)
    many = chat(own.openai(ALPHA), n=3, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    assert many.usage.completion_tokens == 18
    assert max(len(plan) for plan in plans) == 3
    assert all(fed == 1 for plan in plans for _, fed in plan)  # the prompt's last token, then one per decode


def test_a_client_gone_before_the_answer_cancels_every_choice(own):
    """Not streamed: the client hangs up while the three choices run (held until one is cancelled); all stop,
    everything they held is given back, and the request counts as one 499."""
    closed, produced = errors(own, CHAT, 499), generated(own)
    body = {"model": MODEL, "messages": MESSAGES, "n": 3, "max_tokens": 1500, "logit_bias": {str(WORD): 100}}
    with hold_until_cancelled(own.cache):
        with pytest.raises(httpx.ReadTimeout):  # held: no answer comes before the client leaves
            httpx.post(f"{own.url}{CHAT}", json=body, headers=auth(ALPHA), timeout=httpx.Timeout(30, read=0.5))
        assert_idle_and_exact(own)
    wait_until(lambda: errors(own, CHAT, 499) > closed, timeout=10)
    assert errors(own, CHAT, 499) == closed + 1
    assert own.serving.admission.in_flight("alpha") == 0
    assert generated(own) - produced < 1500  # each choice stopped: none ran on to its max_tokens


def test_choices_need_as_many_free_places_of_the_key(tiny_model, tokenizer):
    """A key with three places, one held by a running answer: n=3 is a 429 (the key's places, not a way past
    them), and it gives back the places it reserved."""
    cache = make_cache(tiny_model, tokenizer)
    try:
        with live(create_app(settings(tenant_max_in_flight=3), cache=cache)) as srv, hold_until_cancelled(cache):
            client = srv.openai(ALPHA)
            stream = chat(client, max_tokens=1500, stream=True, logit_bias={str(WORD): 100})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break  # it runs, held, in one of the key's places
            assert srv.serving.admission.in_flight("alpha") == 1
            with pytest.raises(openai.RateLimitError) as info:
                chat(client, n=3)
            assert info.value.body["code"] == "tenant_busy"
            assert srv.serving.admission.in_flight("alpha") == 1
            stream.close()
            wait_until(lambda: srv.serving.admission.in_flight("alpha") == 0, timeout=10)
    finally:
        cache.close()


def test_the_request_counters_count_the_choices_as_one_request(own):
    """/metrics' request counters: a request of three choices on a fresh prompt is one request, a miss (its one
    prefill ahead read nothing), its prompt counted once and the choices' completions summed, as its usage."""
    before = totals(own)
    many = chat(own.openai(ALPHA), n=3, temperature=0)
    after = totals(own)
    moved = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SERVED}
    assert moved == {"prefixcache_requests_total": 1, "prefixcache_prompt_tokens_total": many.usage.prompt_tokens,
                     "prefixcache_cached_tokens_total": 0,
                     "prefixcache_completion_tokens_total": many.usage.completion_tokens,
                     "prefixcache_executor_requests_total": 1}
    assert metric_samples(own)[("prefixcache_requests_total",
                                (("endpoint", "chat"), ("outcome", "miss"), ("tenant", "alpha")))] == 1


def test_a_request_timed_out_after_one_choice_was_served_counts_once_as_its_504(tiny_model, tokenizer):
    """One worker: choice 0 is served, then choice 1 is held mid-answer until the timeout cancels it. The request
    is a 504, counted once as that: none of /metrics' served counters moves."""
    cache = make_cache(tiny_model, tokenizer)
    runner, held_seed = cache.batcher.runner, choice_seed(7, 1)
    run = runner.run

    def held(plan):  # choice 1's steps, once it has its first token, wait for its cancel
        deadline = time.monotonic() + HOLD_LIMIT
        while any(req.params.seed == held_seed and req.output for req, _ in plan) \
                and not any(req.cancelled for req, _ in plan) and time.monotonic() < deadline:
            time.sleep(0.005)
        return run(plan)
    runner.run = held
    try:
        with live(create_app(settings(workers=1, request_timeout_seconds=2.0), cache=cache)) as srv:
            before = totals(srv)
            with pytest.raises(openai.InternalServerError) as info:
                chat(srv.openai(ALPHA).with_options(max_retries=0), n=2, max_tokens=30, seed=7, temperature=1.0)
            assert info.value.status_code == 504
            wait_until(lambda: srv.serving.queue() == (0, 0), timeout=10)
            after = totals(srv)
            assert {name: after.get(name, 0.0) for name in SERVED} == {name: before.get(name, 0.0) for name in SERVED}
            assert errors(srv, CHAT, 504) == 1
    finally:
        del runner.run
        cache.close()
