"""Schemathesis against /openapi.json of a live proxy: valid and invalid generated requests, never a 5xx.

Bounded: a fixed number of examples per operation and mode, derandomized, no
example database, so the run is reproducible and takes well under a minute.
"""
from __future__ import annotations

import json
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, MODEL, auth, leased_refs, live, make_cache, wait_until
from proxy_support import settings as proxy_settings
from pydantic import TypeAdapter
from schemathesis import GenerationMode

_RESPONSE_EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}
# schemathesis stops reading an event stream after 20 events by default, which cuts an
# Anthropic stream of 16 tokens (22 events) before its message_delta: read every event.
MAX_STREAM_EVENTS = 1000


@pytest.fixture(scope="module")
def fuzzed(tiny_model, tokenizer):
    """A server of its own (the run flushes caches); small max_tokens keeps every generation short.

    Small input limits too, so generated requests also cross them (a 400, never a 5xx).
    """
    cache = make_cache(tiny_model, tokenizer)
    limits = dict(max_messages=4, max_content_bytes=1024, max_tools=2, max_tool_schema_bytes=256,  # the valid chats
                  max_tool_schema_depth=3, max_stop_chars=40, max_logit_bias=3, max_json_depth=8,  # below stay within
                  max_prewarm_tokens=64)
    # docs: the schema is served (off by default). No invalid-request budget: a tenant key's stream of generated
    # bad requests would wait a second each for it (it has tests of its own); here each must be answered, never a 5xx.
    app = create_app(proxy_settings(max_tokens_limit=16, default_max_tokens=4, request_timeout_seconds=30, docs=True,
                                    tenant_invalid_rate=None, **limits), cache=cache)
    with live(app) as srv:
        yield srv
    cache.close()


def _operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    schema.config.max_stream_events = MAX_STREAM_EVENTS
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_lists_every_route(fuzzed):
    labels = {op.label for op in _operations(fuzzed.url)}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "POST /v1/cache/prewarm",
            "DELETE /v1/cache", "GET /v1/cache/stats", "GET /metrics", "GET /healthz", "GET /readyz",
            "POST /v1/messages", "POST /v1/messages/count_tokens", "POST /v1/responses", "GET /v1/responses/{response_id}",
            "DELETE /v1/responses/{response_id}"} <= labels


def stream_problems(text: str, path: str) -> list[str]:
    """What is wrong with a 200 SSE body: an error event, a chunk that is not the OpenAI
    chunk shape, a missing or misplaced ``[DONE]`` (a 200 status cannot report these)."""
    if path.endswith("/v1/messages"):
        return anthropic_stream_problems(text)
    if path.endswith("/v1/responses"):
        return responses_stream_problems(text)
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return [f"no final [DONE]: {events[-2:]}"]
    problems, chat = [], path.endswith("chat/completions")
    ids = set()
    for raw in events[:-1]:
        try:
            event = json.loads(raw)
        except ValueError:
            problems.append(f"not JSON: {raw[:120]}")
            continue
        if "error" in event:
            problems.append(f"error event: {event['error']}")
            continue
        try:
            if chat:
                ChatCompletionChunk.model_validate(event)
            else:  # OpenAI's Completion type has no null finish_reason, which a stream chunk has
                Completion.model_validate({**event, "choices": [
                    {**c, "finish_reason": c.get("finish_reason") or "length"} for c in event.get("choices", [])]})
        except ValueError as exc:
            problems.append(f"bad chunk {raw[:120]}: {exc}")
            continue
        ids.add(event["id"])
    if len(ids) > 1:
        problems.append(f"chunks of one stream carry several ids: {ids}")
    return problems


def anthropic_stream_problems(text: str) -> list[str]:
    """What is wrong with a 200 Anthropic event stream: an error event, an event whose data is not
    JSON of its own type, or an order other than message_start ... message_stop."""
    kinds, problems = [], []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        kind = lines.get("event")
        kinds.append(kind)
        try:
            data = json.loads(lines.get("data", ""))
        except ValueError:
            problems.append(f"not JSON: {block[:120]}")
            continue
        if data.get("type") != kind:
            problems.append(f"event {kind} carries type {data.get('type')}")
        if kind == "error":
            problems.append(f"error event: {data}")
    if kinds[:1] != ["message_start"] or kinds[-2:] != ["message_delta", "message_stop"]:
        problems.append(f"events out of order: {kinds}")
    return problems


def responses_stream_problems(text: str) -> list[str]:
    """What is wrong with a 200 Responses API event stream: an event that is not one of OpenAI's types (the
    client's own), an error or failed response, numbers out of sequence, or an order other than
    response.created, response.in_progress ... response.completed (or response.incomplete)."""
    problems, kinds = [], []
    for number, block in enumerate(text.strip().split("\n\n")):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        try:
            data = json.loads(lines.get("data", ""))
            parsed = _RESPONSE_EVENT.validate_python(data)
        except ValueError as exc:
            problems.append(f"not an event of OpenAI's: {block[:160]}: {exc}")
            continue
        kinds.append(parsed.type)
        if lines.get("event") != parsed.type:
            problems.append(f"event {lines.get('event')} carries type {parsed.type}")
        if parsed.type in ("error", "response.failed"):
            problems.append(f"error event: {data}")
        if parsed.sequence_number != number:
            problems.append(f"sequence_number {parsed.sequence_number} at event {number}")
    if kinds[:2] != ["response.created", "response.in_progress"] or \
            kinds[-1:] not in (["response.completed"], ["response.incomplete"]):
        problems.append(f"events out of order: {kinds}")
    return problems


def test_stream_check_catches_error_events_and_bad_chunks():
    """The checker itself can fail: an error event mid-stream and a malformed chunk are caught."""
    good = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    ok = f"data: {json.dumps(good)}\n\ndata: [DONE]\n\n"
    assert stream_problems(ok, "/v1/chat/completions") == []
    error = 'data: {"error": {"message": "boom", "type": "server_error", "code": null}}\n\n'
    assert stream_problems(f"data: {json.dumps(good)}\n\n{error}data: [DONE]\n\n", "/v1/chat/completions")
    broken = {**good, "choices": [{"index": "zero", "delta": 5}]}
    assert stream_problems(f"data: {json.dumps(broken)}\n\ndata: [DONE]\n\n", "/v1/chat/completions")
    assert stream_problems(f"data: {json.dumps(good)}\n\n", "/v1/chat/completions")  # no [DONE]
    events = ["message_start", "content_block_start", "ping", "content_block_stop", "message_delta", "message_stop"]
    ok = "".join(f"event: {e}\ndata: {json.dumps({'type': e})}\n\n" for e in events)
    assert stream_problems(ok, "/v1/messages") == []
    assert stream_problems(ok.replace("event: message_stop", "event: error"), "/v1/messages")
    assert stream_problems(ok.replace('"type": "ping"', '"type": "pong"'), "/v1/messages")
    response = {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL, "output": [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "status": "in_progress"}
    kinds = ["response.created", "response.in_progress", "response.completed"]
    ok = "".join(f"event: {e}\ndata: {json.dumps({'type': e, 'response': response, 'sequence_number': i})}\n\n"
                 for i, e in enumerate(kinds))
    assert stream_problems(ok, "/v1/responses") == []
    assert stream_problems(ok.replace('"sequence_number": 1', '"sequence_number": 7'), "/v1/responses")
    assert stream_problems(ok.replace("response.completed", "response.failed"), "/v1/responses")
    assert stream_problems(ok.replace('"object": "response"', '"object": 5'), "/v1/responses")


def _content_type(response) -> str:
    value = {k.lower(): v for k, v in response.headers.items()}.get("content-type", "")
    return value[0] if isinstance(value, list) else value  # schemathesis keeps header values as lists


def test_the_cache_contract_fields_are_in_the_fuzzed_schema(fuzzed):
    """The generated requests cover them: every field the schema declares is drawn from."""
    with fuzzed.client() as client:
        text = client.get("/openapi.json").text
    for field in ("prompt_cache_options", "prompt_cache_breakpoint", "prompt_cache_retention", "diagnostics",
                  "previous_message_id", "cache_control", "cache_write_tokens", "cache_miss_reason"):
        assert f'"{field}"' in text, field


def _fuzz(operation, mode: GenerationMode, key: str, statuses: Counter, failures: list[str]) -> None:
    """Send generated requests for one operation; count statuses and record any 5xx."""

    @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
            case.body["model"] = MODEL  # a random name is a 404 before any generation; fuzz the rest
        response = case.call(headers=auth(key), timeout=60)
        statuses[operation.label, response.status_code] += 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {case.as_curl_command()}\n  -> {response.text[:300]}")
        elif _content_type(response).startswith("text/event-stream"):
            statuses[operation.label, "stream"] += 1
            if response.stream_cut_short:  # the client stopped reading: its text is not the whole stream
                failures.append(f"stream read only in part by the client\n  {case.as_curl_command()}")
            for problem in stream_problems(response.text, operation.path):
                failures.append(f"stream: {problem}\n  {case.as_curl_command()}")

    try:
        run()
    except Unsatisfiable:  # negative mode: an operation without inputs has no invalid request to send
        assert mode is GenerationMode.NEGATIVE


def _needs_admin(operation) -> bool:
    """The routes whose answer depends on the admin key (the cache admin routes and ``/metrics``); the others
    serve the admin as one more tenant, through the same code as a tenant key."""
    return operation.path.startswith("/v1/cache") or operation.path == "/metrics"


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_no_generated_request_gets_a_5xx(fuzzed, mode):
    """Every route with a tenant key (the admin routes refuse it: 403, never a 5xx), and the admin routes again
    with the admin key."""
    failures: list[str] = []
    statuses: Counter[tuple[str, int]] = Counter()
    for operation in _operations(fuzzed.url):
        _fuzz(operation, mode, ALPHA, statuses, failures)
        if _needs_admin(operation):
            _fuzz(operation, mode, ADMIN, statuses, failures)
    exercised = {label for label, _ in statuses}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/cache/prewarm", "POST /v1/messages",
            "POST /v1/messages/count_tokens", "POST /v1/responses"} <= exercised
    if mode is GenerationMode.POSITIVE:  # valid requests really reached the engine
        assert statuses["POST /v1/chat/completions", 200] >= 5, statuses
        assert statuses["POST /v1/completions", 200] >= 1, statuses
        assert statuses["GET /metrics", 200] >= 1, statuses  # the admin key's requests (a tenant's are 403)
        assert statuses["POST /v1/messages", 200] >= 1 and statuses["POST /v1/messages/count_tokens", 200] >= 1, statuses
        # streamed answers were checked too (the schema's examples include a streamed chat and message)
        assert statuses["POST /v1/chat/completions", "stream"] >= 1 and statuses["POST /v1/messages", "stream"] >= 1, \
            statuses
        assert statuses["POST /v1/responses", 200] >= 1 and statuses["POST /v1/responses", "stream"] >= 1, statuses
    assert not failures, "\n".join(failures[:10])
    wait_until(lambda: fuzzed.serving.queue() == (0, 0) and leased_refs(fuzzed.cache) == 0, timeout=5)
    fuzzed.cache.check_integrity()


_text = st.text(st.characters(codec="utf-8"), max_size=40)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": _text})
_required = {"model": st.just(MODEL), "messages": st.lists(_message, min_size=1, max_size=4)}
_chat = st.fixed_dictionaries(_required, optional={
    "max_tokens": st.integers(1, 6), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50), "seed": st.integers(0, 2**32), "stop": st.lists(_text, max_size=2),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
    "stream": st.booleans(), "user": _text,
    "prompt_cache_options": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["implicit", "explicit"]),
                                                                "ttl": st.sampled_from(["30m", "12h"])}),
    "diagnostics": st.fixed_dictionaries({"previous_message_id": st.none() | _text})})


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(body=_chat)
def test_valid_random_chats_are_always_answered(fuzzed, body):
    """Any well-formed chat (odd Unicode, empty strings, any sampling values) is a 200 with usage."""
    with fuzzed.client(ALPHA) as client:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if body.get("stream"):
            assert stream_problems(r.text, "/v1/chat/completions") == []
            events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
            assert "usage" in events[-2], events[-3:]
        else:
            usage = r.json()["usage"]
            assert 1 <= usage["completion_tokens"] <= body.get("max_tokens", 4)
            assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
