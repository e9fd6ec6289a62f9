"""What a router in front of replicas needs: SGLang's health and info routes, and the fields it adds.

The bodies below are what ``sglang-router`` forwards (captured from it): chat bodies get
``max_completion_tokens`` instead of ``max_tokens`` and SGLang's fields with their default
values; completion bodies keep their fields and get the defaults too.
"""
from __future__ import annotations

import httpx
import pytest
from fastapi.testclient import TestClient
from prefixcache_api import create_app
from proxy_support import ALPHA, MODEL, auth, settings

MESSAGES = [{"role": "system", "content": "You answer briefly. " * 20}, {"role": "user", "content": "Where?"}]
#: What sglang-router 0.3.2 adds to a chat body (defaults), and to a completion body.
CHAT_DEFAULTS = {"logprobs": False, "stream": False, "no_stop_trim": False, "ignore_eos": False,
                 "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                 "stream_reasoning": True, "return_hidden_states": False}
COMPLETION_DEFAULTS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                       "skip_special_tokens": True, "return_hidden_states": False}
#: What it adds to a Responses body (SGLang's sampling defaults; temperature and top_p 1 where the client set none).
RESPONSES_DEFAULTS = {"store": True, "stream": None, "temperature": 1.0, "top_p": 1.0, "priority": 0, "top_k": -1,
                      "min_p": 0.0, "repetition_penalty": 1.0}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=auth(ALPHA), timeout=60)


def test_health_and_server_info_answer_without_a_key(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    for path in ("/server_info", "/get_server_info", "/model_info"):
        info = httpx.get(server.url + path).json()
        assert info["model_path"] == info["served_model_name"] == MODEL, path
    assert httpx.get(server.url + "/v1/models").status_code == 401  # the OpenAI routes still need one


def test_health_is_503_until_the_model_is_loaded(tiny_model, tokenizer):
    from proxy_support import make_cache

    cache = make_cache(tiny_model, tokenizer)
    app = create_app(settings(), cache=cache)
    try:
        loading = TestClient(app)  # no lifespan: the state of a server still loading its model
        assert loading.get("/health").status_code == 503
        assert loading.get("/server_info").status_code == 503
        with TestClient(app) as up:
            assert up.get("/health").status_code == 200
            up.app.state.serving.closing = True  # shutting down: the router must stop sending requests here
            assert up.get("/health").status_code == 503
            up.app.state.serving.closing = False
    finally:
        cache.close()


def test_the_routers_chat_body_gives_the_plain_requests_answer(server):
    plain = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 7,
                                                   "temperature": 0})
    routed = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                    "max_completion_tokens": 7, "temperature": 0, **CHAT_DEFAULTS})
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    assert routed.json()["usage"]["completion_tokens"] == plain.json()["usage"]["completion_tokens"]


def test_the_routers_completion_body_gives_the_plain_requests_answer(server):
    body = {"model": MODEL, "prompt": "The port of Rotterdam", "max_tokens": 5, "temperature": 0}
    plain, routed = _post(server, "/v1/completions", body), _post(server, "/v1/completions",
                                                                  {**body, **COMPLETION_DEFAULTS})
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]


def test_the_routers_responses_body_gives_the_plain_requests_answer(server):
    body = {"model": MODEL, "instructions": MESSAGES[0]["content"], "input": "Where?", "max_output_tokens": 5}
    plain = _post(server, "/v1/responses", {**body, "temperature": 0})
    routed = _post(server, "/v1/responses", {**body, **RESPONSES_DEFAULTS, "temperature": 0})
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["output"][0]["content"] == plain.json()["output"][0]["content"]
    # top_k is honoured as chat's: 1 is greedy whatever the temperature.
    top1 = _post(server, "/v1/responses", {**body, **RESPONSES_DEFAULTS, "top_k": 1})
    assert top1.json()["output"][0]["content"] == plain.json()["output"][0]["content"], top1.text


@pytest.mark.parametrize(("field", "value"), [("min_p", 0.1), ("repetition_penalty", 1.2)])
def test_a_responses_sglang_field_that_would_change_the_answer_is_refused(server, field, value):
    response = _post(server, "/v1/responses", {"model": MODEL, "input": "Hi", **RESPONSES_DEFAULTS, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "not supported" in error["message"], error


def test_ignore_eos_and_max_completion_tokens_are_honoured_in_the_routers_shape(server, tokenizer):
    eos = {str(tokenizer.eos_token_id): 100}  # EOS first: the answer would end at once
    body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 6, "temperature": 0, "logit_bias": eos,
            **CHAT_DEFAULTS}
    ended = _post(server, "/v1/chat/completions", body).json()
    assert ended["usage"]["completion_tokens"] <= 1 and ended["choices"][0]["finish_reason"] == "stop"
    full = _post(server, "/v1/chat/completions", {**body, "ignore_eos": True}).json()
    assert full["usage"]["completion_tokens"] == 6 and full["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("field", "value", "routes"), [
    ("no_stop_trim", True, ("chat", "completions")),
    ("skip_special_tokens", False, ("chat", "completions")),
    ("return_hidden_states", True, ("chat", "completions")),
])
def test_a_non_default_value_that_would_change_the_answer_is_refused(server, field, value, routes):
    for route in routes:
        if route == "chat":
            body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 2, **CHAT_DEFAULTS}
        else:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **COMPLETION_DEFAULTS}
        response = _post(server, f"/v1/{'chat/completions' if route == 'chat' else 'completions'}",
                         {**body, field: value})
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error["param"] == field and "not supported" in error["message"], error


def test_continue_final_message_continues_the_last_assistant_turn(server):
    """SGLang's continue_final_message: the prompt ends inside the last assistant message and the answer extends
    it; the same conversation without it gets a new assistant turn."""
    conversation = [*MESSAGES, {"role": "assistant", "content": "My answer is"}]
    base = {"model": MODEL, "messages": conversation, "max_completion_tokens": 3, "temperature": 0, **CHAT_DEFAULTS}
    continued = _post(server, "/v1/chat/completions", {**base, "continue_final_message": True})
    assert continued.status_code == 200, continued.text
    ids = server.cache.encode_chat_prompt(conversation, continue_final=True).token_ids
    assert server.cache.tokenizer.decode(ids).endswith("<|im_start|>assistant\nMy answer is")
    assert continued.json()["usage"]["prompt_tokens"] == len(ids)
    with_breakpoints = _post(server, "/v1/chat/completions", {**base, "continue_final_message": True,
                                                              "prompt_cache_options": {"mode": "implicit"}})
    assert with_breakpoints.json()["usage"]["prompt_tokens"] == len(ids)  # OpenAI's breakpoints path, the same ids
    closed = _post(server, "/v1/chat/completions", base).json()
    assert closed["usage"]["prompt_tokens"] > len(ids)  # the turn closed and a new one opened
    spaced = [*MESSAGES, {"role": "assistant", "content": "My answer is "}]
    refused = _post(server, "/v1/chat/completions", {**base, "messages": spaced, "continue_final_message": True})
    assert refused.status_code == 400 and "whitespace" in refused.json()["error"]["message"]


def test_reasoning_switches_are_accepted_either_way(server):
    # No reasoning parser: the whole answer is content whatever they say.
    base = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 4, "temperature": 0, **CHAT_DEFAULTS}
    answers = {_post(server, "/v1/chat/completions", {**base, "separate_reasoning": sep, "stream_reasoning": st})
               .json()["choices"][0]["message"]["content"] for sep in (True, False) for st in (True, False)}
    assert len(answers) == 1


def test_sglang_fields_are_chat_or_shared_as_sglang_has_them(server):
    # continue_final_message only exists for chat: a completion body with it is an unknown argument.
    response = _post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "continue_final_message": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "continue_final_message"
