"""Choosing tokens: OpenAI's sampling options checked, and one sampler.

``openai_params`` and ``penalty_params`` check OpenAI-style options (``options`` maps a
call's options to ``SamplingParams``). ``Sampler`` applies what ``generate()`` applies, in its
order: repetition penalty, min-new-tokens, then the OpenAI penalties and logit bias and a
response format's grammar (a caller's processors), then temperature, top-k and top-p when
sampling. The serial engine gets the same OpenAI penalties and grammar as ``LogitsProcessor``s
(``OpenAIPenalties``, ``structured.GrammarLogits``), so both executors compute the same.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from prefixcache.errors import InvalidRequestError
from prefixcache.serving.request import SamplingParams


def fresh_seed() -> int:
    """A seed for a sampled call that gave none, from the OS: never from the process's global RNG."""
    return secrets.randbits(63)


#: Temperatures below this are served greedily: their limit is argmax, and dividing logits
#: by e.g. 1e-300 overflows to inf and breaks sampling.
GREEDY_BELOW = 1e-4


def openai_params(temperature: float | None, top_p: float | None, top_k: int | None,
                  do_sample: bool | None) -> dict[str, Any]:
    """OpenAI-style sampling as ``generate()`` kwargs; temperature 0 (< GREEDY_BELOW) or unset means greedy."""
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not math.isfinite(temperature) or temperature < 0):
        raise InvalidRequestError("temperature must be a number >= 0", param="temperature")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    if top_k is not None and not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0):
        raise InvalidRequestError("top_k must be an integer >= 0", param="top_k")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise InvalidRequestError("do_sample must be true or false", param="do_sample")
    if temperature is not None and temperature < GREEDY_BELOW:
        temperature, do_sample = 0.0, False
    sample = do_sample if do_sample is not None else bool(temperature)
    if not sample:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    out: dict[str, Any] = {"do_sample": True, "temperature": float(temperature) if temperature else None,
                           "top_p": None if top_p is None else float(top_p),
                           "top_k": None if top_k is None else int(top_k)}
    return out


def penalty_params(presence_penalty: float | None, frequency_penalty: float | None,
                   logit_bias: Mapping[int, float] | None) -> dict[str, Any]:
    """OpenAI's penalties and logit bias as ``SamplingParams`` fields (validated)."""
    out: dict[str, Any] = {}
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
            raise InvalidRequestError(f"{name} must be a number in [-2, 2]", param=name)
        if value:
            out[name] = float(value)
    if logit_bias is not None and not isinstance(logit_bias, Mapping):
        raise InvalidRequestError("logit_bias must map token ids to biases", param="logit_bias")
    if logit_bias:
        pairs = []
        for token, bias in logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise InvalidRequestError("logit_bias values must be numbers in [-100, 100]", param="logit_bias")
            if bias:
                pairs.append((token, float(bias)))
        if pairs:
            out["logit_bias"] = tuple(sorted(pairs))
    return out


class OpenAIPenalties(LogitsProcessor):
    """presence/frequency penalties and logit_bias, as OpenAI defines them.

    Penalties count generated tokens only (after ``prompt_len``). scores: [B, V]; input_ids: [B, S].
    """

    def __init__(self, params: SamplingParams, prompt_len: int):
        self.presence, self.frequency, self.prompt_len = params.presence_penalty, params.frequency_penalty, prompt_len
        self.bias = dict(params.logit_bias)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        if self.bias:
            ids = torch.tensor(list(self.bias), dtype=torch.long, device=scores.device)
            scores[:, ids] += torch.tensor(list(self.bias.values()), dtype=scores.dtype, device=scores.device)
        generated = input_ids[:, self.prompt_len :]
        if generated.numel() and (self.presence or self.frequency):
            counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
            scores -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def has_openai_penalties(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias)


class Sampler:
    """The logits processors of one request, built once; ``next_token`` picks its next token.

    A seeded request draws as ``generate()`` does (``torch.multinomial``: one exponential variate per
    vocabulary entry), so a seed gives ``generate()``'s tokens. An unseeded one draws from the same
    distribution by inverting its cumulative sum with one uniform variate (``draw_inverse``): about a
    tenth of the host time for a vocabulary of tens of thousands, which a batched step pays per
    sampled row.
    """

    def __init__(self, params: SamplingParams, prompt_len: int):
        processors = LogitsProcessorList()
        if params.repetition_penalty not in (None, 1.0):
            processors.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
        if params.min_new_tokens > 0 and params.eos_token_ids:
            processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens,
                                                                sorted(params.eos_token_ids)))
        if has_openai_penalties(params):
            processors.append(OpenAIPenalties(params, prompt_len))
        if params.constraint is not None:  # a response format: the tokens its grammar allows (``structured``)
            processors.append(params.constraint.processor(prompt_len))
        if not params.greedy:
            if float(params.temperature) != 1.0:
                processors.append(TemperatureLogitsWarper(float(params.temperature)))
            if params.top_k:
                processors.append(TopKLogitsWarper(int(params.top_k)))
            if params.top_p is not None and params.top_p < 1.0:
                top_p = TopPLogitsWarper(float(params.top_p))
                # Unseeded: the same nucleus without sorting the whole vocabulary (seeded: generate()'s own).
                processors.append(top_p if params.seed is not None else FiniteTopP(top_p))
        self.processors, self.greedy = processors, params.greedy
        self.as_generate = params.seed is not None  # draw exactly as generate() would for this seed
        #: (temperature, top-k or 0, top-p) of an unseeded request that reads nothing but its logits: drawn
        #: together with the step's other such rows, on the logits' device (``draw_rows``); else None.
        self.warp: tuple[float, int, float] | None = None
        #: The same of a seeded request that reads nothing but its logits: it can draw where they are, as
        #: ``generate()`` draws there (``draw_seeded``), instead of on the host; else None.
        self.seeded_warps: tuple[float, int, float] | None = None
        if not params.greedy and all(
                isinstance(p, (TemperatureLogitsWarper, TopKLogitsWarper, FiniteTopP, TopPLogitsWarper))
                for p in processors):
            top_p = float(params.top_p) if params.top_p is not None and params.top_p < 1.0 else 1.0
            warps = (float(params.temperature), int(params.top_k or 0), top_p)
            if self.as_generate:
                self.seeded_warps = warps
            else:
                self.warp = warps
        # The processors' input_ids: prompt and output so far, grown in place (not rebuilt every step).
        self._ids = torch.empty((1, 0), dtype=torch.long)
        self._filled = 0

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that changes the logits: the token is the row's first argmax."""
        return self.greedy and not self.processors

    def next_token(self, scores: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
                   generator: torch.Generator | None) -> int:
        """scores: [V] float32 on the host (as generate() scores) of one request; prompt and output so far
        (the output only ever grows). Greedy = first argmax."""
        scores = scores.unsqueeze(0)
        if self.processors:
            scores = self.processors(self._context(prompt, output), scores)
        if self.greedy:
            return int(torch.argmax(scores[0]))
        assert generator is not None, "a sampled request draws from its own generator, never the global RNG"
        probs = torch.softmax(scores, dim=-1)[0]
        if self.as_generate:
            return int(torch.multinomial(probs, 1, generator=generator))
        return draw_inverse(probs, self.uniform(generator))

    @staticmethod
    def uniform(generator: torch.Generator) -> float:
        """The uniform variate in [0, 1) an unseeded draw inverts, from the request's own generator."""
        if generator is None:  # torch would draw from the process's global RNG, which other callers seed
            raise ValueError("a sampled request draws from its own generator, never the global RNG")
        return float(torch.rand((), dtype=torch.float64, generator=generator))

    def _context(self, prompt: Sequence[int], output: Sequence[int]) -> torch.Tensor:
        """[1, len(prompt) + len(output)] token ids: the tokens not yet copied are appended."""
        total = len(prompt) + len(output)
        if total > self._ids.shape[1]:
            grown = torch.empty((1, max(total, 2 * self._ids.shape[1], 64)), dtype=torch.long)
            grown[:, : self._filled] = self._ids[:, : self._filled]
            self._ids = grown
        if self._filled < len(prompt):
            self._ids[0, self._filled : len(prompt)] = torch.as_tensor(list(prompt[self._filled :]), dtype=torch.long)
            self._filled = len(prompt)
        if self._filled < total:
            self._ids[0, self._filled : total] = torch.as_tensor(list(output[self._filled - len(prompt) :]),
                                                               dtype=torch.long)
            self._filled = total
        return self._ids[:, :total]


class FiniteTopP(LogitsProcessor):
    """``TopPLogitsWarper`` for an unseeded row ([1, V]) without sorting the whole vocabulary. After a top-k,
    the warper applied to the row's finite scores only (the others' probability is zero either way, so the
    nucleus is the same up to the order of equal scores, which the warper's sort does not fix either).
    Without one, the likeliest tokens are taken 64, 256, ... at a time until their probability reaches
    ``top_p`` (the nucleus lies within them: every token after them follows at least that much mass) and a
    token is kept while the mass of the tokens before it is under ``top_p``, the warper's rule, summed in
    double instead of in its float32 order (so a token at the nucleus' edge may go the other way when the
    sums differ in the last bit); past a quarter of the vocabulary, the warper itself."""

    def __init__(self, warper: TopPLogitsWarper):
        self.warper = warper

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        kept = torch.isfinite(scores[0]).nonzero()[:, 0]
        vocab = scores.shape[1]
        if kept.numel() < vocab:
            out = scores.clone()
            out[:, kept] = self.warper(input_ids, scores[:, kept])
            return out
        top_p, probs, m = float(self.warper.top_p), torch.softmax(scores[0], dim=-1), 64
        while m < vocab // 4:
            mass, index = torch.topk(probs, m)
            mass = mass.to(torch.float64)
            if float(mass.sum()) > top_p:
                before = torch.cumsum(mass, 0) - mass  # the mass of the likelier tokens
                keep = index[before < top_p]
                out = torch.full_like(scores, self.warper.filter_value)
                out[0, keep] = scores[0, keep]
                return out
            m *= 4
        return self.warper(input_ids, scores)


def draw_rows(scores: torch.Tensor, warps: Sequence[tuple[float, int, float]], uniforms: Sequence[float]) -> list[int]:
    """One token for each row of ``scores`` ([S, V] float32, on any device), all rows at once: the row's
    logits warped as ``Sampler`` warps them (temperature, then top-k, then top-p, as transformers' warpers
    define them: a top-k keeps the scores tied with its k-th) and drawn by inverting the cumulative sum of
    what is left, in descending order of score (in vocabulary order where no row of the call without a top-k
    has a top-p), at the row's uniform variate. Rows with a top-k work on the few tokens it keeps, the others
    on the whole vocabulary. One copy to the host (two with a top-k)."""
    device = scores.device
    temperature = torch.tensor([w[0] for w in warps], dtype=scores.dtype, device=device)
    scores = scores / temperature[:, None]
    # 1 - top_p in double, then rounded, as TopPLogitsWarper compares with it (not 1 minus a rounded top_p)
    drop = torch.tensor([1.0 - w[2] for w in warps], dtype=scores.dtype, device=device)
    u = torch.tensor(list(uniforms), dtype=torch.float64, device=device)
    out = torch.empty(len(warps), dtype=torch.long, device=device)
    limited = [i for i, w in enumerate(warps) if w[1] > 0]
    whole = [i for i, w in enumerate(warps) if w[1] <= 0]
    if limited:
        rows = torch.tensor(limited, device=device)
        sub = scores[rows]
        ks = [min(warps[i][1], sub.shape[1]) for i in limited]
        k = torch.tensor(ks, device=device)
        values, index = torch.topk(sub, max(ks), dim=1)
        kth = values.gather(1, (k - 1)[:, None])
        keep = int((sub >= kth).sum(dim=1).max())  # more than k where scores tie with the k-th
        if keep > values.shape[1]:
            values, index = torch.topk(sub, keep, dim=1)
        out[rows] = _draw_sorted(values.masked_fill(values < kth, float("-inf")), index, drop[rows], u[rows],
                                 any(warps[i][2] < 1.0 for i in limited))
    if whole:
        rows = torch.tensor(whole, device=device)
        sub = scores[rows]
        nucleus = any(warps[i][2] < 1.0 for i in whole)
        if nucleus:
            values, index = torch.sort(sub, dim=1, descending=True)
        else:  # no nucleus: the vocabulary's own order will do
            values, index = sub, torch.arange(sub.shape[1], device=device).expand_as(sub)
        out[rows] = _draw_sorted(values, index, drop[rows], u[rows], nucleus)
    tokens = out.tolist()
    if -1 in tokens:
        raise RuntimeError(NOT_A_DISTRIBUTION)
    return tokens


def draw_seeded(scores: torch.Tensor, samplers: Sequence[Sampler], generators: Sequence[torch.Generator]) -> list[int]:
    """One token for each row of ``scores`` ([S, V] float32, on any device) as a seeded ``generate()`` draws it
    on that device: the row's warpers (``Sampler.seeded_warps``: they read no token ids; applied at once to the
    rows that have the same), a softmax, then ``torch.multinomial``'s draw of one sample: the argmax of the
    probabilities over exponential variates drawn from the row's own generator (on that device, seeded with
    the request's seed) into a row of the probabilities' shape, as that function draws them. Only the variates
    are drawn row by row; ``torch.multinomial`` itself would also wait for the device twice a row to check its
    input. A row that is no distribution raises ``RuntimeError`` (its draw ran on a stand-in: a device never
    sees it). The tokens and the rows' validity come back in one copy."""
    none = torch.empty((1, 0), dtype=torch.long, device=scores.device)
    groups: dict[tuple, list[int]] = {}
    for i, sampler in enumerate(samplers):
        groups.setdefault(sampler.seeded_warps, []).append(i)
    warped = scores.clone()
    for rows in groups.values():
        index = torch.tensor(rows, device=scores.device)
        warped[index] = samplers[rows[0]].processors(none, scores[index])
    probs = torch.softmax(warped, dim=-1)
    valid = torch.isfinite(probs).all(dim=1) & (probs.sum(dim=1) > 0)
    probs = torch.where(valid[:, None], probs, 1.0)
    variates = torch.empty_like(probs)
    for i, generator in enumerate(generators):
        variates[i : i + 1].exponential_(1, generator=generator)
    drawn = torch.cat([torch.argmax(probs / variates, dim=-1), valid.long()]).tolist()
    if not all(drawn[len(samplers):]):
        raise RuntimeError(NOT_A_DISTRIBUTION)
    return drawn[: len(samplers)]


def _draw_sorted(values: torch.Tensor, index: torch.Tensor, drop: torch.Tensor, u: torch.Tensor,
                 nucleus: bool) -> torch.Tensor:
    """values: [R, m] scores in descending order (-inf: gone) of tokens ``index``; drop (1 - top_p), u: [R];
    ``nucleus``: whether any row has a top-p. The token each row draws, or -1 where its scores are no
    distribution."""
    if nucleus:  # TopPLogitsWarper: from the least likely up, mass within 1 - top_p goes
        # Softmax and sums in the warper's ascending order round as its do: the nucleus ends where it ends.
        gone = values.flip(1).softmax(dim=1).cumsum(dim=1).flip(1) <= drop[:, None]
        gone[:, 0] = False  # the likeliest token always stays
        values = values.masked_fill(gone, float("-inf"))
    at = _invert(values.softmax(dim=1), u)
    return torch.where(at >= 0, index.gather(1, at.clamp(min=0)[:, None])[:, 0], -1)


#: What a draw from scores that are no distribution raises (as ``torch.multinomial`` says it).
NOT_A_DISTRIBUTION = "probability tensor contains either inf, nan or element < 0, or sums to zero"


def _invert(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [R, m] non-negative; u: [R] in [0, 1). Per row, the position whose cumulative-probability interval
    holds ``u`` of the row's total, never one of probability zero; -1 where the row sums to no finite positive
    total."""
    cdf = probs.to(torch.float64).cumsum(dim=1)
    total = cdf[:, -1:].contiguous()
    last = probs.shape[1] - 1
    at = torch.searchsorted(cdf, u[:, None] * total, right=True).clamp(max=last)
    # u * total rounded up to the total: the last position with any probability instead
    at = torch.where(probs.gather(1, at) > 0, at, torch.searchsorted(cdf, total).clamp(max=last))[:, 0]
    return torch.where(torch.isfinite(total[:, 0]) & (total[:, 0] > 0), at, -1)


def draw_inverse(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative-probability interval holds ``u`` (in [0, 1)) of the total: a draw from
    ``probs`` ([V], non-negative, not all zero), never a token of probability zero."""
    token = int(_invert(probs[None], torch.tensor([u], dtype=torch.float64))[0])
    if token < 0:
        raise RuntimeError(NOT_A_DISTRIBUTION)
    return token


def stop_string_check(stops: Sequence[str], tokenizer: Any) -> Callable[[list[int]], bool]:
    """After each token: whether the sequence now ends in a stop string, exactly as
    ``generate(stop_strings=...)`` decides it (transformers' own criterion)."""
    criterion = StopStringCriteria(tokenizer, list(stops))

    def stopped(tokens: list[int]) -> bool:
        ids = torch.tensor([tokens])
        return bool(criterion(ids, None)[0])
    return stopped


def as_id_set(value: Any) -> set[int]:
    """Token ids given as None, one id, a list or a tensor, as a set."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, torch.Tensor):
        return {int(v) for v in value.reshape(-1).tolist()}
    return {int(v) for v in value}
