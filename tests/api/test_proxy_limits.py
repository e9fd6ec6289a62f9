"""Input limits: every bound is a setting, refused before any work with a 400/413 naming the parameter.

A server of its own with small limits keeps every request small; the shared server
checks what its defaults refuse. Strangers are refused (401) before their body is read.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from prefixcache_api import create_app
from prefixcache_api.limits import json_depth
from proxy_support import ALPHA, MODEL, auth, live, make_cache, settings
from test_proxy_errors import assert_error, ok_chat

CHAT, COMPLETIONS, PREWARM = "/v1/chat/completions", "/v1/completions", "/v1/cache/prewarm"
LIMITS = dict(max_messages=8, max_content_bytes=2000, max_tools=2, max_tool_schema_bytes=400,
              max_tool_schema_depth=3, max_stop_chars=10, max_logit_bias=3, max_json_depth=12,
              max_prewarm_tokens=50, max_body_bytes=64 << 10)


@pytest.fixture(scope="module")
def small(tiny_model, tokenizer):
    cache = make_cache(tiny_model, tokenizer)
    with live(create_app(settings(**LIMITS), cache=cache)) as srv:
        yield srv
    cache.close()


@pytest.fixture()
def http(small):
    with small.client(ALPHA) as client:
        yield client


def user(text: str = "hi") -> dict:
    return {"role": "user", "content": text}


def tool(name: str = "f", parameters: dict | None = None, description: str | None = None) -> dict:
    function = {"name": name, "parameters": parameters or {"type": "object"}}
    if description is not None:
        function["description"] = description
    return {"type": "function", "function": function}


def nested(levels: int) -> dict:
    """A parameters schema ``levels`` objects deep."""
    value: dict = {"type": "string"}
    for _ in range(levels - 1):
        value = {"type": "object", "x": value}
    return value


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_limits_are_described_settings():
    from prefixcache_api import Settings

    for name in LIMITS:
        assert Settings.model_fields[name].description, name


@pytest.mark.parametrize("body,param,code", [
    (ok_chat(messages=[user()] * 9), "messages", "array_above_max_length"),
    (ok_chat(messages=[user("é" * 1001)]), "messages", "string_above_max_length"),  # 2002 bytes, 1001 chars
    (ok_chat(messages=[user("a" * 1000), {"role": "user", "content": [{"type": "text", "text": "b" * 1001}]}]),
     "messages", "string_above_max_length"),
    (ok_chat(messages=[user(), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "x" * 2000}}]}]),
     "messages", "string_above_max_length"),
    (ok_chat(tools=[tool("a"), tool("b"), tool("c")]), "tools", "array_above_max_length"),
    (ok_chat(tools=[tool(description="d" * 400)]), "tools[0]", "string_above_max_length"),
    (ok_chat(tools=[tool("a"), tool(parameters=nested(4))]), "tools[1].function.parameters", "json_too_deep"),
    (ok_chat(stop=["a" * 11]), "stop", "string_above_max_length"),
    (ok_chat(stop="a" * 11), "stop", "string_above_max_length"),
    (ok_chat(logit_bias={"1": 1, "2": 1, "3": 1, "4": 1}), "logit_bias", "array_above_max_length"),
    (ok_chat(response_format=json_schema({"type": "string", "description": "d" * 400})),
     "response_format.json_schema", "string_above_max_length"),
    (ok_chat(response_format=json_schema(nested(4))), "response_format.json_schema.schema", "json_too_deep"),
])
def test_chat_over_a_limit_is_400_naming_the_parameter(http, body, param, code):
    err = assert_error(http.post(CHAT, json=body), 400, kind="invalid_request_error", code=code, param=param)
    assert "at most" in err["message"]


def test_chat_at_every_limit_is_served(http):
    # tool_choice "none": the tools are measured, then hidden (this template does not take tools).
    body = ok_chat(messages=[user("a" * 200)] * 8, tools=[tool("a"), tool(parameters=nested(3))], tool_choice="none",
                   stop=["a" * 10], logit_bias={"1": 1, "2": 1, "3": 1},
                   response_format=json_schema({"type": "object", "x": {"enum": ["a" * 300]}}))
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "string", "description": "d" * 400}, "output_config.format is 4"),
    (nested(4), "output_config.format.schema nests 4 levels deep"),
])
def test_an_anthropic_output_format_over_a_limit_is_400_naming_it(http, schema, message):
    body = {"model": MODEL, "messages": [user()], "output_config": {"format": {"type": "json_schema",
                                                                              "schema": schema}}}
    for path, more in (("/v1/messages", {"max_tokens": 2}), ("/v1/messages/count_tokens", {})):
        r = http.post(path, json={**body, **more})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and message in error["message"] and "at most" in error["message"]


@pytest.mark.parametrize("body,code", [
    ({"model": MODEL, "prompt": "x" * 2001}, "string_above_max_length"),
    ({"model": MODEL, "prompt": ["x" * 2001]}, "string_above_max_length"),
    ({"model": MODEL, "prompt": "x", "stop": ["y" * 11]}, "string_above_max_length"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {str(i): 1 for i in range(4)}}, "array_above_max_length"),
])
def test_completion_over_a_limit_is_400(http, body, code):
    param = "prompt" if "stop" not in body and "logit_bias" not in body else next(k for k in ("stop", "logit_bias")
                                                                                   if k in body)
    assert_error(http.post(COMPLETIONS, json=body), 400, code=code, param=param)


def test_prewarm_is_bounded_in_text_and_in_tokens(http):
    assert_error(http.post(PREWARM, json={"messages": [user()] * 9}), 400, code="array_above_max_length",
                 param="messages")
    assert_error(http.post(PREWARM, json={"prompt": "x" * 2001}), 400, code="string_above_max_length", param="prompt")
    assert_error(http.post(PREWARM, json={"prompt": "hi", "tools": [tool("a")] * 3}), 400, param="tools")
    # Within the text limits but over max_prewarm_tokens (50): refused once encoded, before any prefill.
    err = assert_error(http.post(PREWARM, json={"prompt": "word " * 60}), 400, code="context_length_exceeded",
                       param="prompt")
    assert "at most 50" in err["message"]
    assert_error(http.post(PREWARM, json={"messages": [user("word " * 60)]}), 400, code="context_length_exceeded",
                 param="messages")
    assert http.post(PREWARM, json={"prompt": "word " * 20}).json()["prompt_tokens"] <= 50


def test_prewarm_over_the_context_is_400_by_default(server):
    with server.client(ALPHA) as client:  # max_prewarm_tokens unset: the model's context (2048) bounds it
        assert_error(client.post(PREWARM, json={"prompt": "word " * 2100}), 400, code="context_length_exceeded")


def test_deep_body_is_400_before_parsing(http, server):
    deep = '{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "metadata": ' \
           + "[" * 20 + "]" * 20 + "}"
    assert_error(http.post(CHAT, content=deep, headers={"content-type": "application/json"}), 400,
                 code="json_too_deep")
    shallow = '{"model": "tiny-llama", "messages": [{"role": "user", "content": "' + "[" * 50 + '"}], "max_tokens": 1}'
    assert http.post(CHAT, content=shallow, headers={"content-type": "application/json"}).status_code == 200
    # Far past any recursion limit, on the defaults: a 400, never a 500 from the parser or a validator.
    with server.client(ALPHA) as client:
        for body in ("[" * 200_000 + "]" * 200_000,
                     '{"model": "tiny-llama", "messages": [{"role": "assistant", "tool_calls": [' + "[" * 900
                     + "]" * 900 + "]}]}"):
            assert_error(client.post(CHAT, content=body, headers={"content-type": "application/json"}), 400,
                         code="json_too_deep")


@pytest.mark.parametrize("field,number,code", [
    ("seed", "9" * 5000, "number_too_large"), ("max_tokens", "-" + "9" * 5000, "number_too_large"),
    ("max_tokens", "1e999", "invalid_value"), ("temperature", "1e999", "invalid_value")])
def test_numbers_too_large_to_parse_are_400_naming_the_parameter(server, field, number, code):
    raw = '{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "%s": %s}' % (field, number)
    with server.client(ALPHA) as client:
        r = client.post(CHAT, content=raw, headers={"content-type": "application/json"})
        err = assert_error(r, 400, code=code, param=field)
        assert "parsing the body" not in err["message"] and field in err["message"]
        nested = ('{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, '
                  '"metadata": {"k": [0, %s]}}' % number)
        if code == "number_too_large":
            assert_error(client.post(CHAT, content=nested, headers={"content-type": "application/json"}), 400,
                         code=code, param="metadata.k[1]")


@pytest.mark.parametrize("raw,depth", [
    (b"{}", 1), (b"[[], {}]", 2), (b'{"a": "[[[{{{"}', 1), (b'["\\\\", [["\\"]]"]]]', 3),
    (b'["\\\\\\"[", []]', 2), (b"1", 0), (b"", 0), (b'{"a": [{"b": [1, {"c": []}]}]}', 6),
])
def test_json_depth_ignores_brackets_in_strings(raw, depth):
    assert json_depth(raw) == depth
    if raw:
        assert json_depth(raw) == _parsed_depth(json.loads(raw))


def _parsed_depth(value) -> int:
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max((_parsed_depth(c) for c in children), default=0)


def test_json_depth_is_linear_on_a_hostile_body():
    start = time.perf_counter()
    assert json_depth(b"[" * 2_000_000 + b"]" * 2_000_000) == 2_000_000
    assert json_depth(b'"\\"' * 1_000_000) == 0
    assert time.perf_counter() - start < 5  # generous: a quadratic scan would take hours


# -- oversized bodies ----------------------------------------------------------------------
def test_body_over_the_limit_is_413_with_or_without_a_length(http):
    big = json.dumps(ok_chat(messages=[user("x" * (70 << 10))])).encode()
    assert_error(http.post(CHAT, content=big, headers={"content-type": "application/json"}), 413,
                 code="payload_too_large", kind="invalid_request_error")

    def chunks():  # no Content-Length: Transfer-Encoding: chunked
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert_error(http.post(CHAT, content=chunks(), headers={"content-type": "application/json"}), 413,
                 code="payload_too_large")


def test_chunked_body_is_refused_without_reading_it_to_the_end(small):
    """The 413 arrives while the client is still sending: the body is never read past the limit."""
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALPHA}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"%x\r\n%s\r\n" % (4096, b"x" * 4096)
    with socket.create_connection(("127.0.0.1", small.port), timeout=10) as sock:
        sock.sendall(head)
        sent = 0
        sock.setblocking(False)
        reply = b""
        while sent < 100 * LIMITS["max_body_bytes"]:  # far more than the limit, if nobody stopped us
            try:
                reply += sock.recv(65536)
            except BlockingIOError:
                pass
            if reply:
                break
            try:
                sock.send(chunk)
                sent += 4096
            except BlockingIOError:
                time.sleep(0.01)
        sock.setblocking(True)
        deadline = time.monotonic() + 10
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            assert time.monotonic() < deadline, reply
            reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 100 * LIMITS["max_body_bytes"]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "payload_too_large"


# -- strangers are refused before their body is read ------------------------------------------
@pytest.mark.parametrize("headers", [{}, auth("sk-wrong")])
def test_stranger_gets_401_whatever_the_body(small, headers):
    json_ct = {"content-type": "application/json"}
    huge = b'{"model": "tiny-llama", "prompt": "' + b"x" * (1 << 20) + b'"}'

    def chunked():
        for i in range(0, len(huge), 65536):
            yield huge[i:i + 65536]

    bodies = [b"{not json", b"[" * 100_000, huge, chunked, b'{"model": "tiny-llama", "tenant": "beta"}']
    with httpx.Client(base_url=small.url, headers=headers, timeout=30) as client:
        for path in (CHAT, COMPLETIONS, PREWARM):
            for body in bodies:
                content = body() if callable(body) else body
                r = client.post(path, content=content, headers=json_ct)
                assert_error(r, 401, code="invalid_api_key")
