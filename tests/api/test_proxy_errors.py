"""Every error a client can cause gets its status and OpenAI's error object; none is a 500."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from fastapi.testclient import TestClient
from prefixcache_api import create_app
from proxy_support import (
    ADMIN,
    ALPHA,
    BETA,
    MODEL,
    auth,
    counter_sum,
    leased_refs,
    live,
    make_cache,
    settings,
    wait_until,
)

from tests.step_hooks import hold_until_cancelled

CHAT = "/v1/chat/completions"
LONG = 1500  # tokens: seconds of generation on the tiny model, so it is still running when we look


def ok_chat(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **extra}


def assert_error(r: httpx.Response, status: int, *, code: str | None = None, param: str | None = None,
                 kind: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    if kind is not None:
        assert err["type"] == kind, err
    return err


@pytest.fixture()
def http(server):
    with server.client(ALPHA) as client:
        yield client


@pytest.mark.parametrize("content,headers,at", [
    (b"{not json", {"content-type": "application/json"}, 1),
    (b'{"model": "tiny-llama", "messages": [', {"content-type": "application/json"}, 37),
])
def test_malformed_json_is_400(http, content, headers, at):
    err = assert_error(http.post(CHAT, content=content, headers=headers), 400, code="invalid_json",
                       kind="invalid_request_error")
    assert err["message"].endswith(f" at character {at} of the body")  # where to look in a hand-written body


@pytest.mark.parametrize("body,param", [
    ([1, 2], None),
    ({"model": MODEL}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    (ok_chat(messages="hello"), "messages"),
    (ok_chat(messages=[]), "messages"),
    (ok_chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"),
    (ok_chat(temperature=3), "temperature"),
    (ok_chat(top_p=0), "top_p"),
    (ok_chat(max_tokens=0), "max_tokens"),
    (ok_chat(max_tokens="many"), "max_tokens"),
    (ok_chat(presence_penalty=-3), "presence_penalty"),
    (ok_chat(seed=2**70), "seed"),
    (ok_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (ok_chat(n=9), "n"),
    (ok_chat(logit_bias={"not-a-token": 1}), "logit_bias"),
    (ok_chat(logit_bias={"99999999": 1}), "logit_bias"),
    (ok_chat(stream_options={"include_usage": True}), None),
    (ok_chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),  # the part itself: its type should be text
    (ok_chat(messages=[{"role": "tool", "content": "42"}]), "messages[0].tool_call_id"),
    (ok_chat(n=0), "n"),
    (ok_chat(messages=[{"role": "user"}]), "messages[0].content"),
    (ok_chat(tenant="beta"), "tenant"),
])
def test_invalid_requests_are_400(http, body, param):
    err = assert_error(http.post(CHAT, json=body), 400, kind="invalid_request_error")
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": [1, 2, 3]}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": MODEL, "prompt": "x", "echo": "maybe"}, "echo"),
])
def test_invalid_completions_are_400(http, body, param):
    assert assert_error(http.post("/v1/completions", json=body), 400)["param"] == param


def test_non_json_content_type_is_400(http):
    r = http.post(CHAT, content=json.dumps(ok_chat()).encode(), headers={"content-type": "text/plain"})
    assert "application/json" in assert_error(r, 400)["message"]


def test_lone_surrogates_are_400_not_a_tokenizer_crash(http):
    raw = b'{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    assert_error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)
    raw = b'{"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "stop": ["\\udfff"]}'
    assert_error(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)


def test_context_length_exceeded_is_400(http):
    long_text = "word " * 2100  # > 2048 tokens of context
    assert_error(http.post(CHAT, json=ok_chat(messages=[{"role": "user", "content": long_text}], max_tokens=None)),
                 400, code="context_length_exceeded")
    fits_alone = [{"role": "user", "content": "word " * 100}]  # ~100 tokens + 1990 new > 2048
    assert_error(http.post(CHAT, json=ok_chat(messages=fits_alone, max_tokens=1990)), 400,
                 code="context_length_exceeded")
    # Streaming requests are checked before the stream starts: a plain 400, not an event.
    r = http.post(CHAT, json=ok_chat(messages=fits_alone, max_tokens=1990, stream=True))
    assert r.headers["content-type"].startswith("application/json")
    assert_error(r, 400, code="context_length_exceeded")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": long_text}), 400,
                 code="context_length_exceeded", param="prompt")


def test_max_tokens_over_the_server_limit_is_400(http):
    assert_error(http.post(CHAT, json=ok_chat(max_tokens=2001)), 400, param="max_tokens")


@pytest.mark.parametrize("headers", [{}, auth("sk-wrong"), {"Authorization": "Basic sk-alpha"},
                                     {"Authorization": "Bearer"}, auth("sk-alph"), auth("sk-alpha-")])
def test_bad_or_missing_key_is_401(server, headers):
    with httpx.Client(base_url=server.url, headers=headers) as client:
        for method, path in (("POST", CHAT), ("POST", "/v1/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/cache/stats"), ("DELETE", "/v1/cache"), ("GET", "/metrics"),
                             ("POST", "/v1/cache/prewarm")):
            body = ok_chat() if method == "POST" else None
            assert_error(client.request(method, path, json=body), 401, code="invalid_api_key")


def test_admin_only_actions_are_403_for_a_tenant(http):
    assert_error(http.get("/metrics"), 403, kind="permission_error")
    assert_error(http.get("/v1/cache/stats", params={"tenant": "beta"}), 403)
    assert_error(http.delete("/v1/cache", params={"tenant": "beta"}), 403)
    assert_error(http.post("/v1/cache/prewarm", params={"tenant": "beta"}, json={"prompt": "x"}), 403)
    assert http.get("/v1/cache/stats", params={"tenant": "alpha"}).status_code == 200  # one's own is fine


def test_unknown_model_and_route_are_404(http):
    assert_error(http.post(CHAT, json=ok_chat(model="gpt-4o")), 404, code="model_not_found", param="model")
    assert_error(http.post("/v1/completions", json={"model": "gpt-4o", "prompt": "x"}), 404, code="model_not_found")
    assert_error(http.post("/v1/cache/prewarm", json={"model": "gpt-4o", "prompt": "x"}), 404)
    assert_error(http.get("/v1/models/gpt-4o"), 404, code="model_not_found")
    assert_error(http.get("/v1/nothing-here"), 404, code="not_found")
    assert_error(http.get(CHAT), 405, code="method_not_allowed")


@pytest.mark.parametrize("path,route", [
    ("/chat/completions", CHAT),  # the openai client with base_url="http://HOST:PORT"
    ("/models", "/v1/models"),
    ("/v1/v1/messages", "/v1/messages"),  # the anthropic client with base_url="http://HOST:PORT/v1"
])
def test_a_route_missing_or_doubling_v1_is_a_404_naming_the_route(http, path, route):
    err = assert_error(http.post(path, json=ok_chat()), 404, code="not_found")
    assert f"did you mean {route}?" in err["message"] and "base_url" in err["message"]
    assert "did you mean" not in http.get("/v1/nothing-here").json()["error"]["message"]
    for page in ("/docs", "/openapi.json"):  # off unless --docs
        assert "served only with --docs" in assert_error(http.get(page), 404, code="not_found")["message"]


def test_body_over_the_limit_is_413(http):
    assert_error(http.post(CHAT, json=ok_chat(messages=[{"role": "user", "content": "x" * (5 << 20)}])), 413,
                 code="payload_too_large")


def test_prewarm_needs_exactly_one_source(http):
    assert_error(http.post("/v1/cache/prewarm", json={}), 400)
    assert_error(http.post("/v1/cache/prewarm", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
                 400)
    assert_error(http.post("/v1/cache/prewarm", json={"prompt": "a", "ttl_seconds": 0}), 400, param="ttl_seconds")


def test_not_ready_is_503_with_retry_after(tiny_model, tokenizer, new_proxy_cache):
    app = create_app(settings(), cache=new_proxy_cache(tiny_model, tokenizer))
    client = TestClient(app)  # not entered: the lifespan never ran, so no engine yet
    r = client.post(CHAT, json=ok_chat(), headers=auth(ALPHA))
    assert_error(r, 503, code="not_ready")
    assert r.headers["retry-after"] == "1"
    assert client.get("/healthz").status_code == 200
    assert_error(client.get("/readyz"), 503)


def test_an_unexpected_bug_is_a_500_in_openai_shape(tiny_model, tokenizer, new_proxy_cache):
    cache = new_proxy_cache(tiny_model, tokenizer)
    cache.encode_chat_prompt = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # a bug, not client input
    with live(create_app(settings(), cache=cache)) as srv, srv.client(ALPHA) as client:
        for _ in range(2):  # the keep-alive connection survives the first 500
            err = assert_error(client.post(CHAT, json=ok_chat()), 500, code="internal_error")
            assert "boom" not in err["message"]  # internals are logged, not sent
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.fixture(scope="module")
def tight(tiny_model, tokenizer):
    """One worker, no queue, a 1 s timeout and a 64 KiB cache: every limit is easy to hit."""
    cache = make_cache(tiny_model, tokenizer, max_bytes=64 << 10)
    with live(create_app(settings(workers=1, max_queue=0, request_timeout_seconds=1.0), cache=cache)) as srv:
        yield srv
    cache.close()


def long_job(tokenizer, **extra):
    return ok_chat(max_tokens=LONG, logit_bias={str(tokenizer.eos_token_id): -100}, **extra)


def test_queue_full_is_429_with_retry_after_and_a_timeout_ends_the_stream(tight, tokenizer):
    started, events = threading.Event(), []

    def hold_the_worker():
        with tight.client(ALPHA) as client, client.stream("POST", CHAT, json=long_job(tokenizer, stream=True)) as r:
            for line in r.iter_lines():
                started.set()
                if line.startswith("data: "):
                    events.append(line[6:])

    # The held answer is mid-stream when its 1 s timeout comes, however fast the machine.
    with hold_until_cancelled(tight.cache):
        thread = threading.Thread(target=hold_the_worker)
        thread.start()
        assert started.wait(10)
        with tight.client(ALPHA) as client:
            r = client.post(CHAT, json=ok_chat())
            assert_error(r, 429, code="queue_full", kind="rate_limit_error")
            assert int(r.headers["retry-after"]) >= 1
            assert client.get("/readyz").status_code == 503  # a load balancer should look elsewhere
        thread.join(10)
    # The held request hit the 1 s timeout mid-stream: its last event is the error, in OpenAI's shape.
    last = json.loads(events[-1])
    assert last["error"]["code"] == "request_timeout" and last["error"]["type"] == "timeout_error"
    wait_until(lambda: tight.serving.queue() == (0, 0) and leased_refs(tight.cache) == 0, timeout=10)


def test_timeout_is_504_and_cancels_the_generation(tight, tokenizer):
    before = {name: counter_sum(tight, name) for name in ("prefixcache_requests_total", "prefixcache_completion_tokens_total",
                                                         "prefixcache_request_errors_total")}
    with hold_until_cancelled(tight.cache), tight.client(ALPHA) as client:  # still answering at 1 s, on any machine
        assert_error(client.post(CHAT, json=long_job(tokenizer)), 504, code="request_timeout")
    wait_until(lambda: tight.serving.queue() == (0, 0), timeout=10)  # cancelled: see the token count
    assert tight.cache.stats()["completion_tokens"] < LONG
    # Counted as the 504 it was, never as a generation served (whichever timer ended it).
    after = {name: counter_sum(tight, name) for name in before}
    assert after["prefixcache_request_errors_total"] == before["prefixcache_request_errors_total"] + 1
    assert after["prefixcache_requests_total"] == before["prefixcache_requests_total"]
    assert after["prefixcache_completion_tokens_total"] == before["prefixcache_completion_tokens_total"]


def test_memory_pressure_on_a_pin_is_503_with_retry_after(tiny_model, tokenizer):
    text = "A long policy document that will not fit in the cache budget. " * 40  # ~500 tokens > 64 KiB
    cache = make_cache(tiny_model, tokenizer, max_bytes=64 << 10)  # tight's budget, not its 1 s timeout:
    with live(create_app(settings(), cache=cache)) as srv, srv.client(ADMIN) as client:  # a slow prefill is no 504;
        # the admin's pins have no pin quota: the budget is the limit
        r = client.post("/v1/cache/prewarm", json={"prompt": text, "pin": True})
        assert_error(r, 503, code="insufficient_capacity")
        assert r.headers["retry-after"] == "1"
        # Unpinned, the same prefix is simply cached as far as it fits: no error.
        assert client.post("/v1/cache/prewarm", json={"prompt": text}).status_code == 200
    cache.close()


def test_a_tenant_pin_over_its_pin_quota_is_429_with_its_own_figures_only(tight):
    """The pin quota (1/8 of the 64 KiB budget by default) binds tenant keys, not the admin key."""
    with tight.client(BETA) as beta:
        assert beta.post("/v1/cache/prewarm", json={"prompt": "Beta's short prompt", "pin": True}).status_code == 200
    text = "A policy document longer than a tenant's pin quota. " * 3
    with tight.client(ALPHA) as alpha:
        r = alpha.post("/v1/cache/prewarm", json={"prompt": text, "pin": True})
        assert_error(r, 429, code="pin_quota_exceeded")
        assert "retry-after" not in r.headers  # retrying will not help until the tenant unpins
        assert "and 0 bytes are pinned already" in r.json()["error"]["message"]  # alpha's, not beta's
    with tight.client(ADMIN) as admin:
        assert admin.post("/v1/cache/prewarm", params={"tenant": "alpha"},
                          json={"prompt": text, "pin": True}).status_code == 200
        admin.delete("/v1/cache")


def test_errors_are_counted_by_route_and_status(server):
    with server.client(ALPHA) as client:
        client.post(CHAT, json={"model": MODEL})
    with server.client(ADMIN) as admin:
        text = admin.get("/metrics").text
    assert 'prefixcache_request_errors_total{route="/v1/chat/completions",status="400"}' in text


def test_a_bad_value_deep_in_a_block_is_named_at_its_path(http):
    """A union (content as a string or blocks) that fails inside a block names that field, not the union."""
    body = ok_chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "7m"}}]}])
    r = http.post(CHAT, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages[0].content[0].prompt_cache_breakpoint")
    messages = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "10m"}}]}]}
    r = http.post("/v1/messages", json=messages)
    assert r.status_code == 400 and "messages[0].content[0].cache_control.ttl" in r.json()["error"]["message"]
