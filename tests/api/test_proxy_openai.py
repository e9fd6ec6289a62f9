"""The official ``openai`` client against a live proxy: chat, streaming, completions, models, tenancy."""
from __future__ import annotations

import openai
import pytest
from proxy_support import ADMIN, ALPHA, BETA, MODEL, auth

SYSTEM = "You are a meticulous assistant for a shipping company. " * 24  # ~250 tokens shared by every call


def chat(client, question: str, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=6, temperature=0, **kwargs)


def test_models_list_and_retrieve(server):
    client = server.openai(ALPHA)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_reports_cached_tokens_on_the_second_call(server):
    client = server.openai(ALPHA)
    server.cache.flush("alpha")
    first = chat(client, "Where is parcel 1?")
    second = chat(client, "Where is parcel 2?")
    assert first.object == "chat.completion" and first.model == MODEL
    assert first.choices[0].message.role == "assistant" and first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 200
    assert second.usage.total_tokens == second.usage.prompt_tokens + second.usage.completion_tokens
    assert second.usage.completion_tokens <= 6


def test_another_tenant_never_sees_the_prefix_and_body_fields_cannot_pick_one(server):
    alpha, beta = server.openai(ALPHA), server.openai(BETA)
    server.cache.flush()
    chat(alpha, "Prime the cache")
    assert chat(alpha, "Same prefix").usage.prompt_tokens_details.cached_tokens > 0
    # Beta sends alpha's exact prefix: its own namespace, so nothing cached.
    assert chat(beta, "Same prefix").usage.prompt_tokens_details.cached_tokens == 0
    server.cache.flush("beta")
    # OpenAI's `user` field is metadata only: naming alpha does not reach alpha's namespace.
    forged = chat(beta, "Same prefix", user="alpha")
    assert forged.usage.prompt_tokens_details.cached_tokens == 0
    # A made-up tenant field is refused outright, never honoured.
    for extra in ({"tenant": "alpha"}, {"namespace": "alpha"}):
        with pytest.raises(openai.BadRequestError) as err:
            chat(beta, "Same prefix", extra_body=extra)
        assert err.value.body["code"] == "unrecognized_argument"
    # vLLM's cache_salt only ever splits the key's own namespace further: it reaches nobody else's.
    salted = chat(beta, "Same prefix", extra_body={"cache_salt": "alpha"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert server.cache.stats("alpha")["queries"] >= 2
    assert chat(alpha, "Same prefix").usage.prompt_tokens_details.cached_tokens > 0


def test_admin_key_has_its_own_namespace(server):
    server.cache.flush()
    chat(server.openai(ALPHA), "warm alpha")
    assert chat(server.openai(ADMIN), "warm alpha").usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_include_usage(server):
    client = server.openai(ALPHA)
    chat(client, "prime")
    chunks = list(chat(client, "stream me", stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"] or finish == ["stop"]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens_details.cached_tokens > 0
    assert last.usage.completion_tokens >= 1 and len({c.id for c in chunks}) == 1
    # Streaming and non-streaming give the same greedy text.
    assert text == chat(client, "stream me").choices[0].message.content


def test_chat_stream_without_include_usage_still_reports_cached_tokens(server):
    client = server.openai(ALPHA)
    server.cache.flush("alpha")
    primed = chat(client, "prime the system prompt")
    chunks = list(chat(client, "no usage asked", stream=True))
    assert all(c.choices for c in chunks)  # no extra choice-less chunk an app did not ask for
    assert chunks[-1].choices[0].finish_reason is not None
    usage = chunks[-1].usage
    assert primed.usage.prompt_tokens_details.cached_tokens == 0
    assert 200 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens  # the shared system prompt
    assert usage.prompt_tokens == chat(client, "no usage asked").usage.prompt_tokens


def test_completions_plain_echo_and_stream(server):
    client = server.openai(ALPHA)
    prompt = "Once upon a time, in a quiet harbour town, "
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert done.object == "text_completion" and done.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + done.choices[0].text
    assert echoed.usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_sampling_parameters_are_honoured(server, tokenizer):
    client = server.openai(ALPHA)
    kwargs = dict(model=MODEL, prompt="The weather today is", max_tokens=8)
    # seed: the same seed gives the same sample.
    a = client.completions.create(temperature=1.0, top_p=0.9, seed=7, **kwargs).choices[0].text
    b = client.completions.create(temperature=1.0, top_p=0.9, seed=7, **kwargs).choices[0].text
    assert a == b
    # A vanishing temperature is greedy decoding (its limit), not a numeric failure.
    greedy = client.completions.create(temperature=0, **kwargs).choices[0].text
    for tiny in (1e-300, 5e-324, 1e-5):
        assert client.completions.create(temperature=tiny, **kwargs).choices[0].text == greedy
    # logit_bias: +100 on one token makes greedy decoding emit only it.
    token = tokenizer.encode(" ship", add_special_tokens=False)[0]
    forced = client.completions.create(temperature=0, logit_bias={str(token): 100}, **kwargs)
    assert forced.choices[0].text == " ship" * 8
    # frequency_penalty: the forced token loses after repeating.
    free = client.completions.create(temperature=0, logit_bias={str(token): 5}, frequency_penalty=2.0, **kwargs)
    assert free.choices[0].text != " ship" * 8
    # stop: the text ends before the stop string, finish_reason "stop".
    stopped = client.completions.create(temperature=0, logit_bias={str(token): 100}, stop=["ship ship"], **kwargs)
    assert stopped.choices[0].text == " " and stopped.choices[0].finish_reason == "stop"
    # ignore_eos (vLLM's extension): the end-of-sequence token no longer ends the answer.
    eos = {str(tokenizer.eos_token_id): 100}
    ended = client.completions.create(temperature=0, logit_bias=eos, **kwargs).choices[0]
    assert ended.finish_reason == "stop" and ended.text == ""
    full = client.completions.create(temperature=0, logit_bias=eos, extra_body={"ignore_eos": True}, **kwargs)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    # max_completion_tokens is max_tokens' newer name.
    short = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                           max_completion_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3


def test_unsupported_openai_parameters_are_refused_not_ignored(server):
    client = server.openai(ALPHA)
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs, param in (({"n": 9}, "n"),
                          ({"tool_choice": "required", "tools": [
                              {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
                           "tool_choice")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, **kwargs)
        assert err.value.body["param"] == param, kwargs
    for kwargs, param in (({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix")):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
        assert err.value.body["param"] == param, kwargs


def test_an_earlier_turn_the_prompt_would_lose_is_refused(server):
    """An earlier assistant turn's deprecated function_call, its audio or its refusal text is a 400 naming it,
    never dropped from the prompt (strict tool schemas: test_proxy_tool_calls)."""
    client = server.openai(ALPHA)
    asked, answer, again = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                            {"role": "user", "content": "x"})
    for extra, param in (({"function_call": {"name": "f", "arguments": "{}"}}, "messages[1].function_call"),
                         ({"audio": {"id": "audio_1"}}, "messages[1].audio"),
                         ({"refusal": "I cannot help with that."}, "messages[1].refusal")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=[asked, {**answer, **extra}, again], max_tokens=2)
        assert err.value.body["param"] == param
    echoed = {**answer, "content": "hello", "refusal": None}  # as a client sends back this server's answer
    ok = client.chat.completions.create(model=MODEL, messages=[asked, echoed, again], max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_tools_the_template_cannot_render_are_refused(server):
    """SmolLM2's template has no tools section: the tools are refused, never dropped in silence."""
    parameters = {"type": "object", "properties": {"id": {"type": "string"}}}
    tools = [{"type": "function",
              "function": {"name": "track", "description": "Track a parcel", "parameters": parameters}}]
    client = server.openai(ALPHA)
    msgs = [{"role": "user", "content": "track 9"}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=2)
    assert err.value.body["param"] == "tools"
    # tool_choice "none": the model must not call tools, so they are not rendered at all.
    ok = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="none", max_tokens=2)
    assert ok.choices[0].message.content is not None


def test_local_mode_needs_no_key(tiny_model, tokenizer):
    from prefixcache_api import Settings, create_app
    from proxy_support import live, make_cache

    cache = make_cache(tiny_model, tokenizer)
    with live(create_app(Settings(served_model_name=MODEL, default_max_tokens=3), cache=cache)) as srv:
        with srv.client() as http:
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
            # Not admin unless --local-admin: its own tenant's stats and flush, no /metrics.
            assert http.get("/metrics").status_code == 403
            assert http.get("/v1/cache/stats").json()["tenant"] == "default"
            assert http.delete("/v1/cache").json()["tenant"] == "default"
            assert http.get("/v1/cache/stats", params={"tenant": "other"}).status_code == 403
            assert cache.stats("default")["queries"] == 1
        # Any key (or none) is the same single tenant.
        with srv.client("anything") as http:
            assert http.get("/v1/models").status_code == 200
    with live(create_app(Settings(served_model_name=MODEL, local_admin=True), cache=cache)) as srv:
        with srv.client() as http:
            assert http.get("/metrics").status_code == 200  # --local-admin: the one caller is admin
            assert http.get("/v1/cache/stats").json()["tenant"] is None
    cache.close()


def test_health_and_readiness(server):
    with server.client() as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        assert http.get("/readyz").json() == {"status": "ready", "batching": True, "detail": None}
    with server.client(ALPHA) as http:
        assert http.get("/v1/models", headers=auth(ALPHA)).status_code == 200


def test_the_example_client_shows_cached_tokens_on_the_second_call(server):
    """examples/openai_client.py as a script, pointed at the live proxy by its environment variables."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "openai_client.py"
    server.cache.flush("alpha")
    env = {**os.environ, "PREFIXCACHE_BASE_URL": f"{server.url}/v1", "PREFIXCACHE_API_KEY": ALPHA}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    calls = [(int(p), int(c)) for p, c in re.findall(r"prompt (\d+) tokens, cached (\d+)", proc.stdout)]
    streamed = [(int(p), int(c)) for c, p in re.findall(r"streamed; cached (\d+) of (\d+) prompt", proc.stdout)]
    assert len(calls) == 2 and len(streamed) == 1, proc.stdout
    (_, first), (second_prompt, second) = calls
    assert first == 0 and 100 < second < second_prompt
    assert 100 < streamed[0][1] < streamed[0][0]


def test_the_example_client_without_a_server_says_to_start_one():
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = Path(__file__).resolve().parents[2] / "examples" / "openai_client.py"
    env = {**os.environ, "PREFIXCACHE_BASE_URL": f"http://127.0.0.1:{port}/v1"}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"no server answers at http://127.0.0.1:{port}: start one with `prefixcache serve` "
                                   "in another terminal (or set PREFIXCACHE_BASE_URL to where it listens)")
