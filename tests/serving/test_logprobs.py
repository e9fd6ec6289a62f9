"""Logprobs (``serving/logprobs.py``): each answer token's log-probability and its likeliest alternatives,
from the model's own logits, equal on both engines, cached or not, streamed or not."""
from __future__ import annotations

import threading

import pytest
import torch

from prefixcache import InvalidRequestError
from prefixcache.serving.logprobs import token_logprobs
from tests.conftest import untouched

SYSTEM = "Answer in one short sentence. " * 12
TOL = 1e-4


def direct(reference, prompt: list[int], answer: tuple[int, ...]) -> torch.Tensor:
    """[len(answer), V] log_softmax of the model's own logits at each answer token's step, in float32."""
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + list(answer)])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(answer)]


def check_against(reference, prompt: list[int], result, top: int) -> None:
    """Every entry equals the directly computed log_softmax: the chosen token's and the top ``top``'s."""
    assert len(result.logprobs) == len(result.token_ids)
    want = direct(reference, prompt, result.token_ids)
    for step, entry in enumerate(result.logprobs):
        assert entry.token == result.token_ids[step]
        assert abs(entry.logprob - float(want[step, entry.token])) <= TOL
        assert len(entry.top) == top
        values, index = torch.topk(want[step], top)
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)
        assert all(abs(v - float(want[step, t])) <= TOL for t, v in entry.top)
        assert [t for t, _ in entry.top] == index.tolist()


@pytest.fixture
def ids(chat_llama, tokenizer, new_cache):
    cache = new_cache(chat_llama, tokenizer, batching=False, start_sweeper=False)
    return cache.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}])


def test_greedy_logprobs_equal_the_model_s_on_both_engines_cached_or_not(chat_llama, tokenizer, new_cache, ids):
    reference = untouched(chat_llama)
    answers = []
    for batching in (True, False):
        cache = new_cache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
        first = cache.answer(ids, max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
        second = cache.answer(ids, max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=5)
        assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == len(ids) - 1
        assert first.stats.executor == ("batched" if batching else "serial")
        for result in (first, second):
            check_against(reference, ids, result, 5)
            assert all(e.top[0][0] == e.token for e in result.logprobs)  # greedy: the likeliest token
        answers += [first, second]
    for other in answers[1:]:
        assert other.token_ids == answers[0].token_ids
        for a, b in zip(answers[0].logprobs, other.logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= TOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    # Not asked: none.
    plain = new_cache(chat_llama, tokenizer, start_sweeper=False).answer(ids, max_new_tokens=3)
    assert plain.logprobs is None


@pytest.mark.parametrize("batching", [True, False])
@pytest.mark.parametrize("sampling", [dict(seed=7, temperature=1.7, top_k=40, frequency_penalty=1.5), {}],
                         ids=["sampled", "greedy"])
def test_logprobs_are_the_raw_distribution_s_whatever_changes_the_choice(chat_llama, tokenizer, new_cache, ids,
                                                                         batching, sampling):
    """Temperature, top-k, penalties and logit bias choose the tokens; the logprobs stay the model's own."""
    reference = untouched(chat_llama)
    cache = new_cache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
    biased = cache.answer(ids, max_new_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=2,
                          logit_bias={42: 100.0}, **sampling)
    assert biased.token_ids[0] == 42  # the bias decided it; the logprob is what the model thought of 42
    check_against(reference, ids, biased, 2)
    assert biased.logprobs[0].logprob < -1.0


@pytest.mark.parametrize("batching", [True, False])
def test_streamed_logprobs_come_with_their_text_and_add_up_to_the_answer_s(chat_llama, tokenizer, new_cache, ids,
                                                                           batching):
    cache = new_cache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
    events: list[tuple[str, object]] = []
    result = cache.answer(ids, max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=1,
                          on_text=lambda t: events.append(("text", t)),
                          on_logprobs=lambda e: events.append(("logprobs", e)))
    streamed = [e for kind, batch in events if kind == "logprobs" for e in batch]
    assert tuple(streamed) == result.logprobs and len(streamed) == 8
    assert events[0][0] == "logprobs"  # a token's logprobs come before its text
    assert "".join(t for kind, t in events if kind == "text") == result.text


@pytest.mark.parametrize("batching", [True, False])
def test_a_stopped_answer_reports_the_tokens_of_its_text_but_the_special_ones(chat_llama, tokenizer, new_cache, ids,
                                                                             batching):
    cache = new_cache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
    free = cache.answer(ids, max_new_tokens=8, ignore_eos=True)
    stop = tokenizer.decode(free.token_ids[3:5])  # two tokens long, at a token boundary
    got, texts = [], []
    cut = cache.answer(ids, max_new_tokens=8, ignore_eos=True, stop=[stop], logprobs=True, on_logprobs=got.extend,
                       on_text=texts.append)
    assert cut.finish_reason == "stop" and cut.text == tokenizer.decode(free.token_ids[:3])
    assert tuple(got) == cut.logprobs and "".join(texts) == cut.text
    assert [e.token for e in cut.logprobs] == list(free.token_ids[:3]) != list(cut.token_ids)
    inside = tokenizer.decode(free.token_ids[2:3])[1:] + stop  # begins inside the third token
    partly = cache.answer(ids, max_new_tokens=8, ignore_eos=True, stop=[inside], logprobs=True)
    assert partly.text == cut.text[: len(cut.text) - len(inside) + len(stop)]
    assert [e.token for e in partly.logprobs] == list(free.token_ids[:3])  # the third's text partly returned
    eos = tokenizer.eos_token_id
    ended = cache.answer(ids, max_new_tokens=3, logprobs=True, logit_bias={eos: 100.0})
    assert ended.token_ids == (eos,) and ended.logprobs == ()


def test_a_step_s_other_rows_are_untouched_by_a_row_that_asks(chat_llama, tokenizer, new_cache, ids):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    alone = cache.answer(ids, max_new_tokens=6, ignore_eos=True)
    out: dict[str, object] = {}
    calls = {"asks": dict(logprobs=True, top_logprobs=20), "plain": {}}
    threads = [threading.Thread(target=lambda k=k: out.__setitem__(k, cache.answer(ids, max_new_tokens=6,
                                                                                  ignore_eos=True, **calls[k])))
               for k in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out["asks"].token_ids == out["plain"].token_ids == alone.token_ids
    assert out["plain"].logprobs is None and len(out["asks"].logprobs[0].top) == 20


def test_rows_report_their_own_number_of_alternatives():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    first, second = token_logprobs(logits, [0, 0], [3, 0])
    lp = torch.log_softmax(logits, dim=-1)
    assert first.token == 0 and first.logprob == pytest.approx(float(lp[0, 0]))
    assert [t for t, _ in first.top] == [3, 2, 1] and second.top == ()
    assert second.logprob == pytest.approx(float(lp[1, 0]))


def test_equally_likely_alternatives_come_by_id_so_a_greedy_token_heads_them():
    logits = torch.zeros(2, 100)
    logits[0, [5, 7]] = 1.0
    logits[1, [3, 40, 60]] = 2.0
    greedy = logits.argmax(dim=-1).tolist()  # the first maximum: 5 and 3
    first, second = token_logprobs(logits, greedy, [2, 3])
    assert [t for t, _ in first.top] == [5, 7] and [t for t, _ in second.top] == [3, 40, 60]
    assert first.top[0][1] == first.top[1][1] == first.logprob


@pytest.mark.parametrize(("options", "param"), [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(logprobs=1), "logprobs"),
    (dict(logprobs=True, on_logprobs="print"), "on_logprobs"),
])
def test_bad_logprob_options_are_refused_naming_them(chat_llama, tokenizer, new_cache, options, param):
    cache = new_cache(chat_llama, tokenizer, start_sweeper=False)
    with pytest.raises(InvalidRequestError) as err:
        cache.complete("hi", max_new_tokens=2, **options)
    assert err.value.param == param


@pytest.mark.parametrize("batching", [True, False])
def test_a_response_format_s_grammar_does_not_change_the_logprobs(chat_llama, tokenizer, new_cache, ids, batching):
    reference = untouched(chat_llama)
    cache = new_cache(chat_llama, tokenizer, batching=batching, start_sweeper=False)
    result = cache.answer(ids, max_new_tokens=4, logprobs=True, top_logprobs=1,
                          response_format={"type": "json_object"})
    assert result.text.startswith("{")  # the grammar chose; the model alone would not have
    want = direct(reference, ids, result.token_ids)
    assert [e.token for e in result.logprobs] == list(result.token_ids)
    assert [e.logprob for e in result.logprobs] == pytest.approx(
        [float(want[i, t]) for i, t in enumerate(result.token_ids)], abs=TOL)
    assert result.logprobs[0].top[0][0] != result.token_ids[0]
