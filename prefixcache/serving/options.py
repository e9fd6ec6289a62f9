"""A call's options: one table of ``generate()`` options, and one validated OpenAI-shaped request.

``OPTIONS`` says, for every ``generate()`` option the engines treat specially, whether the
serial engine can still reuse cached KV at a value (``cached``; else the call runs as plain
``generate()``, a bypass) and whether the batching engine reproduces the call at that value
(``batched``: it reads the option, or the value changes nothing). A config field absent from
the table is served by the serial engine unless None.

``AnswerOptions`` is what ``PrefixCache.chat``/``complete``/``answer`` take, parsed and
checked once: the batching engine reads its ``SamplingParams`` straight from it, and only a
call the batching engine cannot serve turns it into ``generate()`` keyword arguments.
"""
from __future__ import annotations

import difflib
import inspect
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import GenerationConfig, GenerationMixin

from prefixcache.errors import InvalidRequestError
from prefixcache.serving.canonicalize import check_text
from prefixcache.serving.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from prefixcache.serving.request import SamplingParams
from prefixcache.serving.sampling import GREEDY_BELOW, as_id_set, openai_params, penalty_params
from prefixcache.serving.structured import Constraint, ResponseFormat, ToolCallGrammar, parse_response_format


def _always(_value: Any) -> bool:
    return True


def _never(_value: Any) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Rule:
    """What one ``generate()`` option means to the engines, at a given (non-None) value."""

    batched: Callable[[Any], bool] = _never  # the batching engine reproduces the call
    cached: Callable[[Any], bool] = _always  # the serial engine may reuse cached KV (else: a bypass)
    kwarg: bool = False  # a ``generate()`` keyword argument, not a ``GenerationConfig`` field


#: What ``generate()`` takes besides ``GenerationConfig`` fields: its parameters, and the keyword arguments it
#: reads itself (a tokenizer for stop strings; the prompt's mask).
_GENERATE_PARAMETERS = frozenset(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"} | {
    "tokenizer", "assistant_tokenizer", "attention_mask"}
_CONFIG_FIELDS = GenerationConfig()
#: The values generate() gives options neither the call nor the model's config sets (transformers 5).
_GENERATE_DEFAULTS: dict[str, Any] = getattr(GenerationConfig, "_get_default_generation_params", dict)()

_READ = Rule(batched=_always)  # the batching engine reads it (``sampling.batch_params``)
_INERT = Rule(batched=_always)  # describes the model, or matters only for beam search, speculation, compilation

#: Every generate() option either engine treats specially.
OPTIONS: dict[str, Rule] = {
    **dict.fromkeys(("max_new_tokens", "max_length", "min_new_tokens", "min_length", "do_sample", "temperature",
                     "top_k", "top_p", "repetition_penalty", "eos_token_id", "stop_strings"), _READ),
    **dict.fromkeys(("pad_token_id", "bos_token_id", "decoder_start_token_id", "length_penalty", "early_stopping",
                     "num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold",
                     "assistant_lookbehind", "target_lookbehind", "max_matching_ngram_size", "compile_config",
                     "disable_compile", "cache_config", "max_cache_len", "_from_model_config",
                     "transformers_version"), _INERT),
    # Neutral at these values for one greedy or sampled sequence; some also keep the cache from serving.
    "num_beams": Rule(lambda v: v == 1, lambda v: v in (None, 1)),
    "num_return_sequences": Rule(lambda v: v == 1, lambda v: v in (None, 1)),
    "use_cache": Rule(lambda v: v is True, lambda v: v is not False),
    "output_attentions": Rule(lambda v: v is False, lambda v: not v),
    "output_hidden_states": Rule(lambda v: v is False, lambda v: not v),
    "return_dict_in_generate": Rule(lambda v: v is False),
    "output_scores": Rule(lambda v: v is False),
    "output_logits": Rule(lambda v: v is False),
    "renormalize_logits": Rule(lambda v: v is False),
    "remove_invalid_values": Rule(lambda v: v is False),
    "low_memory": Rule(lambda v: v is False),
    "num_beam_groups": Rule(lambda v: v == 1),
    "diversity_penalty": Rule(lambda v: v == 0.0),
    "typical_p": Rule(lambda v: v == 1.0),
    "encoder_repetition_penalty": Rule(lambda v: v == 1.0),
    "guidance_scale": Rule(lambda v: v == 1.0),
    "is_assistant": Rule(lambda v: v is False),
    "prompt_lookup_num_tokens": Rule(cached=lambda v: v is None),
    "cache_implementation": Rule(cached=lambda v: v is None),
    # generate() keyword arguments.
    **dict.fromkeys(("streamer", "tokenizer", "seed"), Rule(batched=_always, kwarg=True)),
    **dict.fromkeys(("assistant_model", "past_key_values", "assistant_tokenizer"),
                    Rule(cached=lambda v: v is None, kwarg=True)),
}


def bypass_reason(config: GenerationConfig, kwargs: Mapping[str, Any]) -> str | None:
    """The first option at which the cache cannot serve the call (it runs as plain ``generate()``), or None."""
    for name, rule in OPTIONS.items():
        if rule.kwarg and not rule.cached(kwargs.get(name)):
            return f"option {name} is served uncached"
    for name, rule in OPTIONS.items():
        if not rule.kwarg and not rule.cached(value := getattr(config, name, None)):
            return f"option {name}={value!r} is served uncached"
    return None


def unbatchable(config: GenerationConfig, kwargs: Mapping[str, Any]) -> str | None:
    """The first option (of ``kwargs``, then of the effective ``config``) only the serial engine serves, or None."""
    for name, value in kwargs.items():
        if name in ("logits_processor", "stopping_criteria") and not value:
            continue
        rule = OPTIONS.get(name)
        served = rule.batched(value) if rule is not None and rule.kwarg else hasattr(config, name)
        if not served:
            return f"option {name} is served by the serial engine"
    for name, value in config.to_dict().items():
        rule = OPTIONS.get(name)
        if value is not None and (rule is None or rule.kwarg or not rule.batched(value)):
            return f"option {name}={value!r} is served by the serial engine"
    return None


def batch_params(config: GenerationConfig, kwargs: Mapping[str, Any],
                 prompt_len: int) -> tuple[SamplingParams | None, str | None]:
    """``SamplingParams`` reproducing ``generate(**kwargs)`` under ``config`` (the effective one:
    model default, caller's config, kwargs), or (None, the first option only the serial engine serves)."""
    reason = unbatchable(config, kwargs)
    sample = bool(config.do_sample)
    temperature = config.temperature if config.temperature is not None else 1.0
    if reason is None and sample and temperature < GREEDY_BELOW:
        reason = f"temperature={temperature!r} with do_sample is served by the serial engine"
    reason = reason or _stop_strings_reason(config, kwargs)
    if reason is not None:
        return None, reason
    max_new = config.max_new_tokens
    if max_new is None:
        max_length = config.max_length if config.max_length is not None else 20
        if max_length <= prompt_len:
            return None, f"max_length={max_length} not above the prompt's {prompt_len} tokens (generate() raises): " \
                         "served by the serial engine"
        max_new = max_length - prompt_len
    # What generate() uses where neither the call nor the model sets it: transformers' defaults (top_k 50). A
    # call's own top_k=None is set: generate() applies it after those defaults (no top-k), as the serial engine does.
    top_k = config.top_k if config.top_k is not None or "top_k" in kwargs else _GENERATE_DEFAULTS.get("top_k")
    return _params(config, prompt_len, max_new=int(max_new), temperature=float(temperature) if sample else None,
                   top_p=config.top_p if sample else None, top_k=top_k if sample else None,
                   seed=kwargs.get("seed"), eos=frozenset(as_id_set(config.eos_token_id))), None


def _stop_strings_reason(config: GenerationConfig, kwargs: Mapping[str, Any]) -> str | None:
    if config.stop_strings is not None and kwargs.get("tokenizer") is None:
        return "stop_strings without a tokenizer (generate() raises): served by the serial engine"
    return None


def _params(config: GenerationConfig, prompt_len: int, *, max_new: int, temperature: float | None,
            top_p: float | None, top_k: int | None, seed: int | None, eos: frozenset[int],
            constraint: Constraint | None = None, logprobs: int | None = None, **penalties: Any) -> SamplingParams:
    """``SamplingParams`` of a call: what it sets, and from ``config`` what it leaves to the model."""
    min_new = config.min_new_tokens or max((config.min_length or 0) - prompt_len, 0)
    stops = config.stop_strings
    return SamplingParams(max_new_tokens=max_new, min_new_tokens=int(min_new), temperature=temperature,
                          top_p=top_p, top_k=top_k, repetition_penalty=config.repetition_penalty, seed=seed,
                          eos_token_ids=eos, stop_strings=(stops,) if isinstance(stops, str) else tuple(stops or ()),
                          constraint=constraint, logprobs=logprobs, **penalties)


@dataclass(frozen=True, slots=True)
class AnswerOptions:
    """One OpenAI-shaped call's options, checked (``parse``). ``top_k`` 0: none (sampling without top-k).

    ``extra``: any other ``generate()`` keyword argument, passed as given (it may send the call to
    the serial engine). ``on_text`` receives text deltas; a set ``cancel`` ends the call at the next
    token; ``timeout_seconds`` bounds a call the batching engine serves. ``chunks``, ``blend`` and
    ``unplaced``: the prompt's marked chunks and how to reuse them (``blend.blend_plan`` checks them
    against the prompt). ``response_format``: the answer's JSON format (``structured``; None: text);
    ``tool_grammar``: the answer as a forced call to strict tools (``structured.tool_call_grammar``; set by
    ``chat``, ``messages`` and the proxy); ``constraint`` either grammar bound to the model's vocabulary
    (``PrefixCache.run`` binds it). ``counted_cached_tokens``: the cached tokens the engine's counters
    (``PrefixCache.stats``) record for the call (None: what it read), as the proxy records each of a
    request's choices by what the prompt's one prefill ahead read; the call's own stats and usage keep
    what it read.
    """

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    timeout_seconds: float | None = None
    on_text: Callable[[str], None] | None = None
    cancel: threading.Event | None = None
    chunks: Sequence[tuple[int, int]] | None = None
    blend: bool | float | None = None
    unplaced: int = 0
    response_format: ResponseFormat | None = None
    tool_grammar: ToolCallGrammar | None = None
    constraint: Constraint | None = None
    logprobs: int | None = None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None
    counted_cached_tokens: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, *, max_new_tokens: int = 256, temperature: float | None = None, top_p: float | None = None,
              top_k: int | None = None, do_sample: bool | None = None, seed: int | None = None,
              stop: Sequence[str] | str | None = None, presence_penalty: float | None = None,
              frequency_penalty: float | None = None, logit_bias: Mapping[int, float] | None = None,
              on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None,
              ignore_eos: bool = False, timeout_seconds: float | None = None,
              chunks: Sequence[tuple[int, int]] | None = None, blend: bool | float | None = None, unplaced: int = 0,
              response_format: Mapping[str, Any] | ResponseFormat | None = None,
              tool_grammar: ToolCallGrammar | None = None, logprobs: bool | None = None,
              top_logprobs: int | None = None, on_logprobs: Callable[[list[TokenLogprob]], None] | None = None,
              **extra: Any) -> AnswerOptions:
        """Check every option once; a bad one raises ``InvalidRequestError`` naming its parameter."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidRequestError("max_new_tokens must be an integer >= 1", param="max_tokens")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise InvalidRequestError("stop must be a non-empty string or a list of them", param="stop")
        for s in stops:
            check_text(s, "stop")
        timeout = None if timeout_seconds is None else seconds(timeout_seconds, "timeout_seconds")
        check_seed(seed)
        if not isinstance(ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be true or false", param="ignore_eos")
        if on_text is not None and not callable(on_text):
            raise InvalidRequestError("on_text must be a function of the text delta", param="on_text")
        check_cancel(cancel)
        if tool_grammar is not None and not isinstance(tool_grammar, ToolCallGrammar):
            raise InvalidRequestError("tool_grammar must be a structured.ToolCallGrammar", param="tool_grammar")
        if on_logprobs is not None and not callable(on_logprobs):
            raise InvalidRequestError("on_logprobs must be a function of the tokens' logprobs", param="on_logprobs")
        for name in extra:  # anything else goes to generate(): a name it does not know would fail only there
            if not generate_option(name):
                raise InvalidRequestError(f"unknown option {name!r}{_option_hint(name)}", param=name)
        sampling = openai_params(temperature, top_p, top_k, do_sample)
        if sampling["do_sample"] and sampling["top_k"] is None:
            sampling["top_k"] = 0  # OpenAI semantics: no top-k unless asked (generate() would default to 50)
        penalties = penalty_params(presence_penalty, frequency_penalty, logit_bias)
        return cls(max_new_tokens, **sampling, seed=seed, stop=tuple(stops), **penalties,
                   ignore_eos=bool(ignore_eos), timeout_seconds=timeout, on_text=on_text, cancel=cancel, chunks=chunks,
                   blend=blend, unplaced=unplaced, response_format=parse_response_format(response_format),
                   tool_grammar=tool_grammar, logprobs=logprob_count(logprobs, top_logprobs), on_logprobs=on_logprobs,
                   extra=extra)

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def penalties(self) -> dict[str, Any]:
        """OpenAI's penalties and logit bias as ``SamplingParams`` fields (only those set)."""
        out = {"presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
               "logit_bias": self.logit_bias}
        return {k: v for k, v in out.items() if v}

    def eos_ids(self, config: GenerationConfig) -> frozenset[int]:
        """End-of-sequence ids under the effective ``config``; none with ``ignore_eos``."""
        return frozenset() if self.ignore_eos else frozenset(as_id_set(config.eos_token_id))

    def batch_params(self, config: GenerationConfig, prompt_len: int) -> tuple[SamplingParams | None, str | None]:
        """The batching engine's ``SamplingParams``, or (None, why only the serial engine serves the call).

        ``config``: the model's generation config updated by ``extra``; it gives what the call does
        not set (repetition penalty, minimum length, end-of-sequence ids, stop strings).
        """
        reason = unbatchable(config, self.extra) or _stop_strings_reason(config, self.extra)
        if reason is not None:
            return None, reason
        sample = self.do_sample
        return _params(config, prompt_len, max_new=self.max_new_tokens,
                       temperature=(1.0 if self.temperature is None else self.temperature) if sample else None,
                       top_p=self.top_p if sample else None, top_k=self.top_k if sample else None,
                       seed=self.seed, eos=self.eos_ids(config), constraint=self.constraint, logprobs=self.logprobs,
                       **self.penalties()), None

    def generate_kwargs(self) -> dict[str, Any]:
        """The call as ``generate()`` keyword arguments, for the serial engine."""
        gen = dict(self.extra, max_new_tokens=self.max_new_tokens, do_sample=self.do_sample,
                   temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        if self.ignore_eos:
            gen["eos_token_id"] = None  # generate() then stops only at max_new_tokens
        if self.seed is not None:
            gen["seed"] = self.seed
        return gen


def logprob_count(logprobs: Any, top_logprobs: Any) -> int | None:
    """OpenAI's ``logprobs`` (true: report them) and ``top_logprobs`` (alternatives per token, 0-20, only with
    ``logprobs``; 0 alone asks for nothing) as the alternatives to report, or None where none are asked for."""
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequestError("logprobs must be true or false", param="logprobs")
    if top_logprobs is not None and (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                                     or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
        raise InvalidRequestError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
    if top_logprobs and not logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def check_seed(seed: Any) -> None:
    """A sampling seed is an integer torch can take (what the proxy's schema allows too)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
        raise InvalidRequestError("seed must be an integer in [-2**63, 2**64)", param="seed")


def check_cancel(cancel: Any) -> None:
    """A cancel signal is a ``threading.Event`` or anything with ``is_set()`` (None: none)."""
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise InvalidRequestError("cancel must be a threading.Event (or have is_set())", param="cancel")


#: Names callers of OpenAI's and Anthropic's APIs reach for, and what this API calls them.
_RENAMED = {"max_tokens": "max_new_tokens is the answer's length here",
            "stream": "on_text=callback receives the text as it is generated"}
#: The options of ``chat``/``complete``/``answer`` besides ``parse``'s own: a close one is suggested for a typo.
_CALL_OPTIONS = ("tenant", "ttl_seconds", "cache_salt")


def _option_hint(name: str) -> str:
    """`` (...)`` for an unknown option: its name here, or the known option it nearly spells."""
    if name in _RENAMED:
        return f" ({_RENAMED[name]})"
    known = [*inspect.signature(AnswerOptions.parse).parameters, *_CALL_OPTIONS]
    near = difflib.get_close_matches(name, [k for k in known if k not in ("cls", "extra")], n=1, cutoff=0.8)
    return f" (did you mean {near[0]}?)" if near else ""


def generate_option(name: str) -> bool:
    """Whether ``generate()`` takes ``name``: a ``GenerationConfig`` field or one of its own parameters."""
    return hasattr(_CONFIG_FIELDS, name) or name in _GENERATE_PARAMETERS


def seconds(value: Any, param: str, hint: str = "") -> float | None:
    """A caller's duration: a number > 0; math.inf means none (None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequestError(f"{param} must be a number > 0{hint}", param=param)
    return None if math.isinf(value) else float(value)
