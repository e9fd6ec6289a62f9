"""The batching engine's sampler: an unseeded draw inverts the distribution (``draw_inverse``), a seeded
one draws as ``generate()`` does, and the processors read the request's ids grown in place."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TopKLogitsWarper, TopPLogitsWarper

from prefixcache.serving.request import SamplingParams
from prefixcache.serving.sampling import FiniteTopP, Sampler, draw_inverse, draw_rows, draw_seeded


def test_inverse_draws_follow_the_distribution_and_never_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.5, 0.2, 0.0, 0.25, 0.05, 0.0])
    gen = torch.Generator().manual_seed(0)
    n = 40_000
    counts = torch.zeros(7)
    for _ in range(n):
        counts[draw_inverse(probs, float(torch.rand((), dtype=torch.float64, generator=gen)))] += 1
    assert counts[probs == 0].sum() == 0
    for p, c in zip(probs.tolist(), counts.tolist(), strict=True):
        if p:  # within 4.5 standard deviations of the expected count (the seed fixes the draws)
            assert abs(c - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)), (p, c)


def test_inverse_draws_at_the_ends_of_the_unit_interval_pick_likely_tokens():
    probs = torch.tensor([0.0, 0.0, 0.3, 0.7, 0.0, 0.0])
    assert draw_inverse(probs, 0.0) == 2
    assert draw_inverse(probs, 1.0 - 2.0 ** -53) == 3
    assert draw_inverse(probs, 0.3 - 1e-12) == 2 and draw_inverse(probs, 0.3 + 1e-7) == 3
    assert draw_inverse(torch.tensor([1e-30, 0.0]), 0.999999) == 0  # unnormalised: the total is what counts


@pytest.mark.parametrize("bad", [[0.0, 0.0], [float("nan"), 1.0], [float("inf"), 1.0]])
def test_a_distribution_that_is_not_one_is_refused(bad):
    with pytest.raises(RuntimeError, match="probability"):
        draw_inverse(torch.tensor(bad), 0.5)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(1, 20), temperature=st.floats(0.2, 3.0))
def test_an_unseeded_sampled_token_is_among_the_top_k(seed, k, temperature):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(seed))
    sampler = Sampler(SamplingParams(temperature=temperature, top_k=k), prompt_len=3)
    token = sampler.next_token(logits, [1, 2, 3], [], torch.Generator().manual_seed(seed))
    assert token in set(torch.topk(logits, k).indices.tolist())


def test_a_seeded_sampler_draws_what_multinomial_draws_with_the_same_generator():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    sampler = Sampler(SamplingParams(temperature=0.7, top_k=10, seed=5), prompt_len=2)
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(20):
        want = int(torch.multinomial(torch.softmax(sampler.processors(torch.tensor([[1, 2]]), logits[None])[0], -1),
                                     1, generator=theirs))
        assert sampler.next_token(logits, [1, 2], [], ours) == want


@settings(max_examples=40, deadline=None)
@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=80) | st.integers(60, 300).map(lambda n: [7] * n),
       steps=st.lists(st.lists(st.integers(0, 99), max_size=3) | st.integers(60, 300).map(lambda n: [n % 100] * n),
                      max_size=40))
def test_the_processors_read_prompt_and_output_as_one_list_would(prompt, steps):
    """Output grows by none, one or a few tokens a step, or by more than the ids held so far (past the buffer)."""
    seen: list[list[int]] = []

    def record(input_ids, scores):
        seen.append(input_ids[0].tolist())
        return scores
    sampler = Sampler(SamplingParams(temperature=1.0), prompt_len=len(prompt))
    sampler.processors.append(record)
    output: list[int] = []
    gen = torch.Generator().manual_seed(0)
    for new in steps:
        output.extend(new)  # the sampler appends whatever it has not seen
        sampler.next_token(torch.zeros(100), prompt, output, gen)
        assert seen[-1] == prompt + output


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), k=st.integers(1, 60), top_p=st.floats(0.05, 0.99), vocab=st.integers(61, 400))
def test_the_nucleus_of_the_top_k_is_the_warpers_own(seed, k, top_p, vocab):
    scores = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    after_k = TopKLogitsWarper(k)(None, scores)
    ids = torch.tensor([[1, 2]])
    want = TopPLogitsWarper(top_p)(ids, after_k)
    got = FiniteTopP(TopPLogitsWarper(top_p))(ids, after_k)
    assert torch.equal(torch.isfinite(got), torch.isfinite(want))
    assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_an_unseeded_sampler_sorts_only_the_top_k_and_a_seeded_one_is_generates():
    unseeded = Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.9), prompt_len=1)
    seeded = Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1), prompt_len=1)
    no_top_k = Sampler(SamplingParams(temperature=0.8, top_p=0.9), prompt_len=1)
    assert isinstance(unseeded.processors[-1], FiniteTopP) and isinstance(no_top_k.processors[-1], FiniteTopP)
    assert type(seeded.processors[-1]) is TopPLogitsWarper


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), warp=st.tuples(st.sampled_from([0.5, 0.8, 1.0, 1.7]),
                                                  st.sampled_from([0, 1, 5, 40, 500]),
                                                  st.sampled_from([1.0, 0.9, 0.5, 0.05])),
       others=st.lists(st.tuples(st.sampled_from([0.7, 1.0]), st.sampled_from([0, 3]), st.sampled_from([1.0, 0.8])),
                       max_size=3))
def test_rows_drawn_together_follow_each_samplers_distribution(seed, warp, others):
    """Drawn at n evenly spaced uniforms, a row gives each token n times its probability under the row's own
    warpers (transformers'), to within the rounding of the grid: the distribution itself, whatever rows
    share the step."""
    vocab, n = 300, 4000
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=gen) * 4
    t, k, p = warp
    sampler = Sampler(SamplingParams(temperature=t, top_k=k or None, top_p=None if p == 1.0 else p), prompt_len=1)
    assert sampler.warp == warp
    want = torch.softmax(sampler.processors(torch.tensor([[0]]), row[None].clone())[0], -1)
    rows = torch.cat([row.expand(n, vocab), torch.randn(len(others), vocab, generator=gen)])
    grid = [(i + 0.5) / n for i in range(n)]
    got = draw_rows(rows, [warp] * n + others, grid + [0.5] * len(others))[:n]
    counts = torch.bincount(torch.tensor(got), minlength=vocab).double() / n
    assert torch.all(counts[want == 0] == 0)
    assert torch.allclose(counts, want.double(), atol=1.5 / n + 1e-6), (counts - want).abs().max()


def test_rows_drawn_together_keep_the_tokens_tied_with_the_k_th():
    scores = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0]])
    kept = {draw_rows(scores, [(1.0, 2, 1.0)], [u])[0] for u in (0.0, 0.5, 0.8, 0.9, 0.95, 0.999)}
    assert kept <= {0, 1, 2, 3} and kept & {1, 2, 3}  # as TopKLogitsWarper: scores below the 2nd largest go


def test_a_row_that_cannot_be_drawn_is_refused_with_the_others():
    with pytest.raises(RuntimeError, match="probability"):
        draw_rows(torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]), [(1.0, 0, 1.0)] * 2, [0.5, 0.5])


def test_only_unseeded_rows_that_read_nothing_but_their_logits_are_drawn_together():
    assert Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.9), prompt_len=1).warp == (0.8, 50, 0.9)
    for params in (SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, repetition_penalty=1.2),
                   SamplingParams(temperature=0.8, frequency_penalty=0.5), SamplingParams(),
                   SamplingParams(temperature=0.8, min_new_tokens=3, eos_token_ids=frozenset({2}))):
        assert Sampler(params, prompt_len=1).warp is None


def test_rows_drawn_together_keep_the_nucleus_the_warper_keeps_at_its_rounded_threshold():
    """TopPLogitsWarper drops the tail whose mass is at most 1 - top_p rounded to float32 (0.1 for 0.9),
    not 1 minus top_p rounded (0.10000002): a tail of 0.1000000164 stays."""
    scores = torch.tensor([[2.1972243785858154, 0.0]])
    assert torch.isfinite(TopPLogitsWarper(0.9)(None, scores.clone())).all()  # transformers keeps both
    assert draw_rows(scores, [(1.0, 0, 0.9)], [0.95]) == [1]
    assert draw_rows(scores, [(1.0, 2, 0.9)], [0.95]) == [1]


_SCORE = st.sampled_from([-3.0, -1.0, 0.0, 0.0, 0.5, 2.0, 2.0, float("-inf")])


@settings(max_examples=60, deadline=None)
@given(row=st.lists(_SCORE, min_size=1, max_size=24).filter(lambda r: any(math.isfinite(x) for x in r)),
       warp=st.tuples(st.sampled_from([0.3, 1.0, 2.0]), st.sampled_from([0, 1, 2, 5, 24, 25, 10_000]),
                      st.sampled_from([1.0, 0.999999, 0.6, 0.3, 1e-8])),
       others=st.lists(st.tuples(st.sampled_from([0.7, 1.0]), st.sampled_from([0, 1, 30]),
                                 st.sampled_from([1.0, 0.5, 1e-8])), max_size=2))
def test_rows_drawn_together_match_the_warpers_with_ties_masked_tokens_and_extreme_options(row, warp, others):
    """Scores with many ties (as half-precision logits have) and tokens the model masked already, top-k
    beyond the vocabulary or of 1, top-p tiny or almost 1, beside rows of other kinds: each group of tied
    scores gets the warpers' mass (which of the tied tokens a nucleus keeps is the sort's choice, in the
    warper as here), and no token below the warpers' last kept score is ever drawn."""
    n, vocab = 2000, len(row)
    scores = torch.tensor(row)
    t, k, p = warp
    sampler = Sampler(SamplingParams(temperature=t, top_k=k or None, top_p=None if p == 1.0 else p), prompt_len=1)
    assert sampler.warp == warp
    want = torch.softmax(sampler.processors(torch.tensor([[0]]), scores[None].clone())[0], -1).double()
    rows = torch.cat([scores.expand(n, vocab), torch.randn(len(others), vocab, generator=torch.Generator())])
    got = torch.tensor(draw_rows(rows, [warp] * n + others, [(i + 0.5) / n for i in range(n)] + [0.5] * len(others)))
    counts = torch.bincount(got[:n], minlength=vocab).double() / n
    assert scores[got[:n]].min() >= scores[want > 0].min()
    for value in scores.unique():  # each token's share of the grid is its probability to within 1 / n
        tied = scores == value
        assert abs(counts[tied].sum() - want[tied].sum()) <= (int(tied.sum()) + 0.5) / n, (float(value), counts, want)


def test_rows_drawn_together_end_the_nucleus_where_the_warper_ends_it_in_a_large_vocabulary():
    """A nucleus of thousands of tokens ends where TopPLogitsWarper's float32 sums end it (its softmax and
    cumulative sum in ascending order of score): the least likely token kept is the warper's, at the top of
    the unit interval, in every row."""
    vocab = 32_000
    scores = torch.cat([torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * 2 for seed in range(160)])
    for top_p in (0.8, 0.9):
        kept = TopPLogitsWarper(top_p)(None, scores.clone())
        least = torch.where(torch.isfinite(kept), scores, float("inf")).min(dim=1).values
        got = torch.tensor(draw_rows(scores, [(1.0, 0, top_p)] * len(scores), [1.0 - 2.0 ** -53] * len(scores)))
        assert torch.equal(scores.gather(1, got[:, None])[:, 0], least)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), top_p=st.floats(0.05, 0.999), vocab=st.integers(300, 5000),
       scale=st.sampled_from([0.5, 2.0, 6.0]))
def test_the_nucleus_of_a_whole_vocabulary_is_the_warpers_rule(seed, top_p, vocab, scale):
    """Without a top-k: the likeliest tokens whose preceding mass is under top_p, as TopPLogitsWarper keeps
    them, up to a token whose preceding mass is within rounding of top_p (summed in another order)."""
    scores = torch.randn(1, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    got = torch.isfinite(FiniteTopP(TopPLogitsWarper(top_p))(torch.tensor([[1]]), scores))[0]
    want = torch.isfinite(TopPLogitsWarper(top_p)(torch.tensor([[1]]), scores))[0]
    probs = torch.softmax(scores[0].double(), -1)
    order = torch.argsort(probs, descending=True)
    before = torch.zeros_like(probs)
    before[order] = torch.cumsum(probs[order], 0) - probs[order]
    differ = (got != want).nonzero()[:, 0]
    assert all(abs(float(before[t]) - top_p) < 1e-5 for t in differ.tolist()), differ
    assert got.sum() >= 1


def test_a_uniform_variate_never_comes_from_the_global_rng():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="own generator"):
        Sampler.uniform(None)
    assert torch.equal(torch.get_rng_state(), state)
    assert 0.0 <= Sampler.uniform(torch.Generator().manual_seed(1)) < 1.0


def seeded_against_multinomial(device: str) -> None:
    """``draw_seeded`` on ``device`` against ``torch.multinomial`` row by row after each row's warpers, from
    generators seeded alike, over many seeds and rows of three different warps: the same tokens, and the
    generators left in the same state."""
    vocab, seeds = 500, range(40)
    options = [SamplingParams(temperature=0.7, top_k=30, seed=1), SamplingParams(temperature=1.3, top_p=0.8, seed=1),
               SamplingParams(temperature=1.0, seed=1)]
    samplers = [Sampler(options[i % 3], 1) for i in range(6)]
    assert all(s.seeded_warps is not None for s in samplers)
    scores = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(device)
    for seed in seeds:
        ours = [torch.Generator(device=device).manual_seed(seed + i) for i in range(6)]
        theirs = [torch.Generator(device=device).manual_seed(seed + i) for i in range(6)]
        for _ in range(2):  # a second draw from the generators the first advanced
            got = draw_seeded(scores, samplers, ours)
            want = [int(torch.multinomial(torch.softmax(s.processors(None, scores[i:i + 1]), dim=-1), 1,
                                          generator=theirs[i])) for i, s in enumerate(samplers)]
            assert got == want
            assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, theirs, strict=True))


def test_seeded_rows_drawn_at_once_draw_what_multinomial_draws_row_by_row():
    seeded_against_multinomial("cpu")


def test_a_seeded_row_that_is_no_distribution_is_refused_and_the_others_drawn_on_a_stand_in():
    samplers = [Sampler(SamplingParams(temperature=1.0, seed=1), 1)] * 2
    scores = torch.zeros(2, 50)
    scores[1, 3] = float("nan")
    with pytest.raises(RuntimeError, match="probability tensor"):
        draw_seeded(scores, samplers, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
