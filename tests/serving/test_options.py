"""A call's options parsed once: the batching engine's params straight from ``AnswerOptions`` equal what
the ``generate()`` path reads back from the same call as keyword arguments; one table decides both engines."""
from __future__ import annotations

import copy
import dataclasses

import pytest
from transformers import GenerationConfig

from prefixcache.errors import InvalidRequestError
from prefixcache.serving.options import OPTIONS, AnswerOptions, batch_params, bypass_reason, unbatchable

MODEL_DEFAULT = GenerationConfig(eos_token_id=[2, 7], repetition_penalty=1.1, min_length=0)

CALLS = [
    {},
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 0.9, "seed": 3},
    {"temperature": 1.2, "top_k": 5, "max_new_tokens": 9},
    {"do_sample": True},
    {"temperature": 0.5, "presence_penalty": 0.5, "logit_bias": {4: -3.0}},
    {"ignore_eos": True, "max_new_tokens": 4},
    {"min_new_tokens": 2},  # a generate() option beside the OpenAI ones
]


def effective(kwargs: dict) -> GenerationConfig:
    config = copy.deepcopy(MODEL_DEFAULT)
    config.update(**{k: v for k, v in kwargs.items() if hasattr(config, k)})
    return config


@pytest.mark.parametrize("call", CALLS, ids=lambda c: ",".join(c) or "defaults")
def test_params_from_the_parsed_call_equal_the_generate_path(call):
    options = AnswerOptions.parse(**call)
    params, reason = options.batch_params(effective(dict(options.extra)), prompt_len=6)
    gen = options.generate_kwargs()
    via_generate, why = batch_params(effective(gen), gen, prompt_len=6)
    assert reason is None and why is None
    # OpenAI's penalties have no generate() option: the serial engine applies them as a processor.
    assert params == dataclasses.replace(via_generate, **options.penalties())


def test_a_bad_option_is_refused_once_with_its_parameter():
    for call, param in (({"max_new_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
                        ({"stop": [""]}, "stop"), ({"frequency_penalty": 3}, "frequency_penalty"),
                        ({"timeout_seconds": 0}, "timeout_seconds")):
        with pytest.raises(InvalidRequestError) as err:
            AnswerOptions.parse(**call)
        assert err.value.param == param


def test_one_table_decides_bypass_and_batching():
    beams = effective({"num_beams": 2})
    assert bypass_reason(beams, {}) == "option num_beams=2 is served uncached"
    assert unbatchable(beams, {}) == "option num_beams=2 is served by the serial engine"
    assert bypass_reason(effective({}), {"past_key_values": object()}) == "option past_key_values is served uncached"
    assert unbatchable(effective({}), {"streamer": object(), "seed": 1}) is None
    scores = effective({"output_scores": True})  # served by the serial engine, still from the cache
    assert bypass_reason(scores, {}) is None and unbatchable(scores, {}) is not None
    assert {"num_beams", "use_cache", "past_key_values", "streamer"} <= set(OPTIONS)


@pytest.mark.parametrize("max_length", [3, 7])
def test_a_max_length_not_above_the_prompt_goes_where_generate_raises(max_length):
    """generate() refuses a prompt of at least max_length tokens (no max_new_tokens); the batching engine must
    not make up a token for it: the call goes to the serial engine, which raises as generate() does."""
    params, reason = batch_params(GenerationConfig(max_length=max_length, do_sample=False), {}, 7)
    assert params is None and "max_length" in reason and "generate() raises" in reason
    params, reason = batch_params(GenerationConfig(max_length=9, do_sample=False), {}, 7)
    assert reason is None and params.max_new_tokens == 2
