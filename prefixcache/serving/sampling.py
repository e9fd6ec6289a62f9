"""Choosing tokens: one mapping from the caller's options to ``SamplingParams``, and one sampler.

``batch_params`` reads an effective ``GenerationConfig`` plus ``generate()`` keyword
arguments and says whether the batching engine reproduces them exactly (else why not).
``Sampler`` applies what ``generate()`` applies, in its order: repetition penalty,
min-new-tokens, then the OpenAI penalties and logit bias (a caller's processor), then
temperature, top-k and top-p when sampling. The serial engine gets the same OpenAI
penalties as a ``LogitsProcessor`` (``OpenAIPenalties``), so both executors compute the same.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import (
    GenerationConfig,
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

#: GenerationConfig fields the batching engine reads (see ``batch_params``).
_READ = {"max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature", "top_k",
         "top_p", "repetition_penalty", "eos_token_id", "stop_strings"}
#: Fields that change nothing for one greedy or sampled sequence at these values (None is always neutral).
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "num_beams": lambda v: v == 1, "num_return_sequences": lambda v: v == 1, "use_cache": lambda v: v is True,
    "return_dict_in_generate": lambda v: v is False, "output_attentions": lambda v: v is False,
    "output_hidden_states": lambda v: v is False, "output_scores": lambda v: v is False,
    "output_logits": lambda v: v is False, "renormalize_logits": lambda v: v is False,
    "remove_invalid_values": lambda v: v is False, "low_memory": lambda v: v is False,
    "num_beam_groups": lambda v: v == 1, "diversity_penalty": lambda v: v == 0.0,
    "typical_p": lambda v: v == 1.0, "encoder_repetition_penalty": lambda v: v == 1.0,
    "guidance_scale": lambda v: v == 1.0, "is_assistant": lambda v: v is False,
}
#: Fields that only describe the model or matter for beam search, speculation or compilation.
_INERT = {"pad_token_id", "bos_token_id", "decoder_start_token_id", "length_penalty", "early_stopping",
          "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
          "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size", "compile_config",
          "disable_compile", "cache_config", "max_cache_len", "_from_model_config", "transformers_version"}
#: generate() keyword arguments the batching engine takes (others go to the serial engine).
_KWARGS = {"streamer", "tokenizer", "seed"}


def batch_params(config: GenerationConfig, kwargs: Mapping[str, Any], prompt_len: int,
                 extra: Mapping[str, Any] | None = None) -> tuple[SamplingParams | None, str | None]:
    """``SamplingParams`` reproducing ``generate(**kwargs)`` under ``config`` (the effective one:
    model default, caller's config, kwargs), or (None, the first option only the serial engine serves).

    ``extra``: ``SamplingParams`` fields that ``generate()`` has no option for (OpenAI penalties).
    """
    for name, value in kwargs.items():
        if name in ("logits_processor", "stopping_criteria") and not value:
            continue
        if name not in _KWARGS and not hasattr(config, name):
            return None, f"option {name} is served by the serial engine"
    for name, value in config.to_dict().items():
        if value is None or name in _READ or name in _INERT:
            continue
        if not _NEUTRAL.get(name, lambda _v: False)(value):
            return None, f"option {name}={value!r} is served by the serial engine"
    sample = bool(config.do_sample)
    temperature = config.temperature if config.temperature is not None else 1.0
    if sample and temperature < GREEDY_BELOW:
        return None, f"temperature={temperature!r} with do_sample is served by the serial engine"
    max_new = config.max_new_tokens
    if max_new is None:
        max_new = max((config.max_length if config.max_length is not None else 20) - prompt_len, 1)
    min_new = config.min_new_tokens or max((config.min_length or 0) - prompt_len, 0)
    stops = config.stop_strings
    if stops is not None and kwargs.get("tokenizer") is None:
        return None, "stop_strings without a tokenizer (generate() raises): served by the serial engine"
    params = SamplingParams(
        max_new_tokens=int(max_new), min_new_tokens=int(min_new),
        temperature=float(temperature) if sample else None,
        top_p=config.top_p if sample else None, top_k=config.top_k if sample else None,
        repetition_penalty=config.repetition_penalty, seed=kwargs.get("seed"),
        eos_token_ids=frozenset(as_id_set(config.eos_token_id)),
        stop_strings=(stops,) if isinstance(stops, str) else tuple(stops or ()), **dict(extra or {}))
    return params, None


def openai_params(temperature: float | None, top_p: float | None, top_k: int | None,
                  do_sample: bool | None) -> dict[str, Any]:
    """OpenAI-style sampling as ``generate()`` kwargs; temperature 0 (< GREEDY_BELOW) or unset means greedy."""
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or temperature < 0):
        raise InvalidRequestError("temperature must be a number >= 0", param="temperature")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 0):
        raise InvalidRequestError("top_k must be an integer >= 0", param="top_k")
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
    """The logits processors of one request, built once; ``next_token`` picks its next token."""

    def __init__(self, params: SamplingParams, prompt_len: int):
        processors = LogitsProcessorList()
        if params.repetition_penalty not in (None, 1.0):
            processors.append(RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty)))
        if params.min_new_tokens > 0 and params.eos_token_ids:
            processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens,
                                                                sorted(params.eos_token_ids)))
        if has_openai_penalties(params):
            processors.append(OpenAIPenalties(params, prompt_len))
        if not params.greedy:
            if float(params.temperature) != 1.0:
                processors.append(TemperatureLogitsWarper(float(params.temperature)))
            if params.top_k:
                processors.append(TopKLogitsWarper(int(params.top_k)))
            if params.top_p is not None and params.top_p < 1.0:
                processors.append(TopPLogitsWarper(float(params.top_p)))
        self.processors, self.greedy = processors, params.greedy

    @property
    def argmax_only(self) -> bool:
        """Greedy with nothing that changes the logits: the token is the row's first argmax."""
        return self.greedy and not self.processors

    def next_token(self, logits: torch.Tensor, context: Sequence[int], generator: torch.Generator | None) -> int:
        """logits: [V] of one request; context: its prompt and output so far. Greedy = first argmax."""
        # [1, V], as generate() scores in float32. On the host: the processors' own tensors (EOS ids)
        # and the request's generator live there, and the token is read there anyway.
        scores = logits.float().cpu().unsqueeze(0)
        if self.processors:
            scores = self.processors(torch.tensor([list(context)]), scores)
        if self.greedy:
            return int(torch.argmax(scores[0]))
        assert generator is not None, "a sampled request draws from its own generator, never the global RNG"
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs[0], 1, generator=generator))


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
