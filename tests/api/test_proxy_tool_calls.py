"""Tool calls out: for each template family, a scripted model's call reaches the official clients as
OpenAI ``tool_calls`` and Anthropic ``tool_use`` blocks, the same streamed and not; ``tool_choice`` is
honoured, a broken call comes back as text, and the tool result sent back reads the previous turn from the cache."""
from __future__ import annotations

import json

import anthropic
import openai
import pydantic
import pytest
from anthropic.types import Message as AnthropicMessage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, MODEL, live, make_cache
from proxy_support import settings as proxy_settings

from tests.support.tool_templates import (
    CALL_START,
    SCRIPTS,
    TEXT_BEFORE,
    broken_bias,
    family_tokenizer,
    scripted_model,
)

FAMILIES = ("hermes", "llama3_json", "mistral")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = {"city": "Paris"}


@pytest.fixture(scope="module", params=FAMILIES)
def family_server(request, tokenizer):
    family = request.param
    tok = family_tokenizer(tokenizer, family)
    cache = make_cache(scripted_model(tok, family), tok)
    with live(create_app(proxy_settings(default_max_tokens=16), cache=cache)) as srv:
        yield family, tok, srv
    cache.close()


def openai_client(srv) -> openai.OpenAI:
    return srv.openai(ALPHA)


def anthropic_client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=ALPHA, max_retries=0, timeout=60)


def streamed_chat(client: openai.OpenAI, **body) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) accumulated from the chunks, as a client assembles them."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_openai_tool_calls_are_parsed_the_same_streamed_and_not(family_server):
    family, _, srv = family_server
    client = openai_client(srv)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", PARIS)]
    assert (choice.message.content or "") == TEXT_BEFORE[family]
    content, calls, finish = streamed_chat(client, messages=ASK, tools=TOOLS)
    assert (content, finish) == (choice.message.content or "", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(c["id"] for c in calls)
    if family == "mistral":  # its template takes back only 9-character ids
        assert len(choice.message.tool_calls[0].id) == 9


def test_each_of_n_choices_carries_its_own_calls_streamed_and_not(family_server):
    family, _, srv = family_server
    client = openai_client(srv)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", PARIS)]
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id  # ids never shared
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finishes = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=2, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls[choice.index].setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert [[(c["name"], c["arguments"]) for c in calls[i].values()] for i in (0, 1)] == \
        [[(c.function.name, c.function.arguments) for c in choice.message.tool_calls] for choice in r.choices]


def test_anthropic_tool_use_blocks_the_same_streamed_and_not(family_server):
    family, _, srv = family_server
    client = anthropic_client(srv)
    body = dict(model=MODEL, max_tokens=16, tools=ANTHROPIC_TOOLS, messages=ASK)
    r = client.messages.create(**body)
    assert r.stop_reason == "tool_use"
    texts = [b.text for b in r.content if b.type == "text"]
    uses = [(b.name, b.input) for b in r.content if b.type == "tool_use"]
    assert uses == [("get_weather", PARIS)] and "".join(texts) == TEXT_BEFORE[family]
    assert r.content[-1].type == "tool_use" and r.content[-1].id.startswith("toolu_" if family != "mistral" else "")
    with client.messages.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and kinds.count("content_block_start") == len(r.content)
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
            for b in final.content] == \
        [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None)) for b in r.content]


def test_the_tool_result_reads_the_previous_turn_from_the_cache(family_server):
    _, _, srv = family_server
    client = openai_client(srv)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, prompt_cache_key="weather")
    call = first.choices[0].message.tool_calls[0]
    follow = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens  # the whole last prompt
    # The same through Anthropic's blocks: tool_use back, then its tool_result.
    claude = anthropic_client(srv)
    body = dict(model=MODEL, max_tokens=16, tools=ANTHROPIC_TOOLS)
    asked = claude.messages.create(**body, messages=ASK)
    use = next(b for b in asked.content if b.type == "tool_use")
    answered = claude.messages.create(**body, messages=[
        *ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in asked.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}]}])
    prompt = asked.usage.input_tokens + asked.usage.cache_read_input_tokens
    assert answered.usage.cache_read_input_tokens >= prompt


def test_tool_choice_none_hides_the_tools_and_the_answer_is_text(family_server):
    family, _, srv = family_server
    r = openai_client(srv).chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert "get_weather" in r.choices[0].message.content


def test_required_and_named_calls_the_model_makes_are_served(family_server):
    _, _, srv = family_server
    client = openai_client(srv)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    r = anthropic_client(srv).messages.create(model=MODEL, max_tokens=16, tools=ANTHROPIC_TOOLS, messages=ASK,
                                              tool_choice={"type": "tool", "name": "get_weather"})
    assert r.stop_reason == "tool_use"


#: A response format whose JSON is shaped as a llama3_json call: the answer is its JSON all the same.
CALL_SHAPED = {"type": "json_schema", "json_schema": {"name": "call", "strict": True, "schema": {
    "type": "object", "properties": {
        "name": {"type": "string", "enum": ["get_weather"]},
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                       "required": ["city"], "additionalProperties": False}},
    "required": ["name", "parameters"], "additionalProperties": False}}}


def test_with_a_response_format_and_auto_tools_the_answer_is_the_json_not_a_call(family_server):
    """The format holds the answer to its JSON from the first token, so it is the content (finish_reason stop),
    never read for tool calls, even where it looks like one; streamed as not; the Responses API's output_text."""
    _, _, srv = family_server
    client = openai_client(srv)
    want = '{"name":"get_weather","parameters":{"city":"Paris"}}'
    for tools in ([WEATHER], [strict(WEATHER)]):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, tool_choice="auto",
                                           response_format=CALL_SHAPED, max_tokens=60)
        choice = r.choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (want, None, "stop")
        assert streamed_chat(client, messages=ASK, tools=tools, response_format=CALL_SHAPED,
                             max_tokens=60) == (want, [], "stop")
    fmt = {"type": "json_schema", **CALL_SHAPED["json_schema"]}
    got = client.responses.create(model=MODEL, input=ASK[0]["content"], text={"format": fmt}, max_output_tokens=60,
                                  tools=[{"type": "function", **WEATHER["function"]}])
    assert [item.type for item in got.output] == ["message"] and got.output_text == want
    # All of it is content, so its logprobs are reported (without a format, tools the model sees refuse them).
    asked = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], response_format=CALL_SHAPED,
                                           max_tokens=60, logprobs=True, top_logprobs=1)
    assert "".join(entry.token for entry in asked.choices[0].logprobs.content) == want
    got = client.responses.create(model=MODEL, input=ASK[0]["content"], text={"format": fmt}, max_output_tokens=60,
                                  tools=[{"type": "function", **WEATHER["function"]}],
                                  include=["message.output_text.logprobs"])
    assert "".join(entry.token for entry in got.output[0].content[0].logprobs) == want


class GetWeather(pydantic.BaseModel):
    city: str


def strict(tool: dict, **parameters) -> dict:
    """``tool`` as a strict function, its parameters as OpenAI's strict mode wants them (changed by ``parameters``)."""
    schema = {**tool["function"]["parameters"], "additionalProperties": False, **parameters}
    return {**tool, "function": {**tool["function"], "strict": True, "parameters": schema}}


def anthropic_strict(tool: dict) -> dict:
    """The strict function ``tool`` as an Anthropic strict tool."""
    return {"name": tool["function"]["name"], "strict": True, "input_schema": tool["function"]["parameters"]}


#: get_weather strict, with a schema the scripted call {"city": "Paris"} does not match.
LONDON_ONLY = strict(WEATHER, properties={"city": {"type": "string", "enum": ["London"]}})


def request_errors(srv, route: str, status: int) -> float:
    """``prefixcache_request_errors_total`` of ``route`` and ``status``."""
    with srv.client(ADMIN) as admin:
        text = admin.get("/metrics").text
    label = f'prefixcache_request_errors_total{{route="{route}",status="{status}"}} '
    return next((float(line[len(label):]) for line in text.splitlines() if line.startswith(label)), 0.0)


def test_a_strict_call_that_matches_its_schema_is_served(family_server):
    """strict true is accepted (pydantic_function_tool sets it) and a call that matches its schema is served,
    streamed and not, on both APIs."""
    _, _, srv = family_server
    client = openai_client(srv)
    tools = [strict(WEATHER), strict(CLOCK, required=[])]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=tools)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == \
        [("get_weather", PARIS)]
    _, calls, finish = streamed_chat(client, messages=ASK, tools=tools)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", PARIS)]
    assert finish == "tool_calls"
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, tools=[
        openai.pydantic_function_tool(GetWeather, name="get_weather")])
    assert parsed.choices[0].message.tool_calls[0].function.parsed_arguments == GetWeather(city="Paris")
    claude = anthropic_client(srv)
    tool = anthropic_strict(strict(WEATHER))
    answer = claude.messages.create(model=MODEL, max_tokens=16, tools=[tool], messages=ASK)
    assert [(b.name, b.input) for b in answer.content if b.type == "tool_use"] == [("get_weather", PARIS)]


def test_a_strict_call_that_breaks_its_schema_is_an_error_never_an_answer(family_server):
    """The arguments fail the schema: a 500 tool_arguments_invalid naming where (the stream's last event once it
    has begun, before any of the call's deltas), counted as the 500 it is; on both APIs."""
    _, _, srv = family_server
    client = openai_client(srv)
    before = request_errors(srv, "/v1/chat/completions", 500)
    with pytest.raises(openai.InternalServerError, match=r"\$\.city") as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[LONDON_ONLY])
    assert err.value.body["code"] == "tool_arguments_invalid" and err.value.body["type"] == "server_error"
    with srv.client(ALPHA) as http:
        streamed = http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [LONDON_ONLY],
                                                            "stream": True})
    chunks = sse_data(streamed.text)
    assert chunks[-1]["error"]["code"] == "tool_arguments_invalid" and "$.city" in chunks[-1]["error"]["message"]
    assert not any(choice["delta"].get("tool_calls") for chunk in chunks[:-1] for choice in chunk["choices"])
    with pytest.raises(openai.APIError, match=r"\$\.city"):  # the official client raises the stream's error
        streamed_chat(client, messages=ASK, tools=[LONDON_ONLY])
    assert request_errors(srv, "/v1/chat/completions", 500) == before + 3
    claude = anthropic_client(srv)
    tool = anthropic_strict(LONDON_ONLY)
    body = dict(model=MODEL, max_tokens=16, tools=[tool], messages=ASK)
    with pytest.raises(anthropic.InternalServerError, match=r"\$\.city"):
        claude.messages.create(**body)
    with pytest.raises(anthropic.APIStatusError, match=r"\$\.city"), claude.messages.stream(**body) as stream:
        stream.get_final_message()


def test_a_strict_call_that_does_not_parse_is_an_error_not_text(family_server):
    """The model's call to a strict tool is broken JSON: a 500 tool_arguments_invalid, streamed and not, each
    counted once, where a loose tool's comes back as text. Cut short by max_tokens once named, it is no error: an
    incomplete tool_use block and stop_reason max_tokens, streamed and not, strict or loose."""
    family, tok, srv = family_server
    client, claude = openai_client(srv), anthropic_client(srv)
    bias = broken_bias(tok, family)
    before = [request_errors(srv, route, 500) for route in ("/v1/chat/completions", "/v1/messages")]
    with pytest.raises(openai.InternalServerError, match="strict tool 'get_weather' is not JSON") as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[strict(WEATHER)], logit_bias=bias)
    assert err.value.body["code"] == "tool_arguments_invalid"
    with pytest.raises(openai.APIError, match="is not JSON"):
        streamed_chat(client, messages=ASK, tools=[strict(WEATHER)], logit_bias=bias)
    tool = anthropic_strict(strict(WEATHER))
    cut = SCRIPTS[family].index(next(p for p in SCRIPTS[family] if '"name"' in p)) + 1  # ends after the name
    body = dict(model=MODEL, max_tokens=cut, tools=[tool], messages=ASK)
    unstreamed = claude.messages.create(**body)
    with claude.messages.stream(**body) as stream:
        streamed = stream.get_final_message()
    for message in (unstreamed, streamed):
        assert message.stop_reason == "max_tokens"
        *text, use = message.content
        assert [b.text for b in text] == [TEXT_BEFORE[family]] * bool(TEXT_BEFORE[family])
        assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {})
    after = [request_errors(srv, route, 500) for route in ("/v1/chat/completions", "/v1/messages")]
    assert after == [before[0] + 2, before[1]]
    loose = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, logit_bias=bias)
    assert "{city: Paris}" in loose.choices[0].message.content
    assert claude.messages.create(**{**body, "tools": ANTHROPIC_TOOLS}).stop_reason == "max_tokens"


def test_a_strict_schema_breaking_openais_rules_is_refused(family_server):
    """As OpenAI: a strict function's objects must set additionalProperties false and require every property,
    else a 400 naming the parameters (strict false takes any schema)."""
    _, _, srv = family_server
    client = openai_client(srv)
    loose_object = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    for tools, rule in (([loose_object], "additionalProperties"), ([CLOCK, strict(WEATHER, required=[])], "required")):
        with pytest.raises(openai.BadRequestError, match=rule) as err:
            client.chat.completions.create(model=MODEL, messages=ASK, tools=tools)
        assert err.value.body["param"] == f"tools[{len(tools) - 1}].function.parameters"
    unresolved = strict(WEATHER, properties={"city": {"$ref": "https://example.com/city.json"}})
    with pytest.raises(openai.BadRequestError, match=r"\$ref"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[unresolved])
    loose = [{**WEATHER, "function": {**WEATHER["function"], "strict": False}}, CLOCK]
    assert client.chat.completions.create(model=MODEL, messages=ASK, tools=loose).choices[0].finish_reason


def test_a_strict_calls_formatted_value_is_checked(family_server):
    """A format strict mode supports is asserted: the scripted {"city": "Paris"} is no date (a 500
    tool_arguments_invalid, streamed too; Anthropic's api_error) but is a hostname (served); a format neither
    supports is an annotation (served)."""
    _, _, srv = family_server
    client, claude = openai_client(srv), anthropic_client(srv)
    as_date, as_hostname, as_colour = (strict(WEATHER, properties={"city": {"type": "string", "format": name}})
                                       for name in ("date", "hostname", "color"))
    with pytest.raises(openai.InternalServerError, match=r"\$\.city: 'Paris' is not a 'date'") as err:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[as_date])
    assert err.value.body["code"] == "tool_arguments_invalid"
    with pytest.raises(openai.APIError, match="is not a 'date'"):
        streamed_chat(client, messages=ASK, tools=[as_date])
    with pytest.raises(anthropic.InternalServerError, match="is not a 'date'") as err:
        claude.messages.create(model=MODEL, max_tokens=16, tools=[anthropic_strict(as_date)], messages=ASK)
    assert err.value.body["error"]["type"] == "api_error"
    for served in (as_hostname, as_colour):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[served])
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == PARIS
        _, calls, _ = streamed_chat(client, messages=ASK, tools=[served])
        assert [json.loads(c["arguments"]) for c in calls] == [PARIS]
        answer = claude.messages.create(model=MODEL, max_tokens=16, tools=[anthropic_strict(served)], messages=ASK)
        assert [b.input for b in answer.content if b.type == "tool_use"] == [PARIS]


def test_a_strict_schema_breaking_anthropics_rules_is_refused(family_server):
    """As Anthropic: a strict tool's objects must set additionalProperties false, and numeric and string bounds
    are refused; a 400 invalid_request_error in Anthropic's shape, streamed or not (strict false takes them)."""
    _, _, srv = family_server
    claude = anthropic_client(srv)
    open_object = {**ANTHROPIC_TOOLS[0], "strict": True}
    bounded = anthropic_strict(strict(WEATHER, properties={"city": {"type": "string", "maxLength": 40}}))
    for tool, rule in ((open_object, "'additionalProperties' must be explicitly set to false"),
                       (bounded, "For 'string' type, property 'maxLength' is not supported")):
        for stream in (False, True):
            with srv.client(ALPHA) as http:
                r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 16, "messages": ASK,
                                                    "tools": [tool], "stream": stream})
            assert r.status_code == 400 and r.json()["type"] == "error", r.text
            assert r.json()["error"]["type"] == "invalid_request_error" and rule in r.json()["error"]["message"]
        with pytest.raises(anthropic.BadRequestError, match="strict tool 'get_weather'"):
            claude.messages.create(model=MODEL, max_tokens=16, tools=[tool], messages=ASK)
        loose = claude.messages.create(model=MODEL, max_tokens=16, tools=[{**tool, "strict": False}], messages=ASK)
        assert [b.input for b in loose.content if b.type == "tool_use"] == [PARIS]


def test_a_required_or_named_call_the_model_does_not_make_is_an_error(family_server, caplog):
    family, _, srv = family_server
    routes = ("/v1/chat/completions", "/v1/messages")
    before = {status: [request_errors(srv, route, status) for route in routes] for status in (422, 500)}
    client, claude = openai_client(srv), anthropic_client(srv)
    cut = {"stop": [CALL_START[family]]}  # the answer ends before its call
    other = {"type": "function", "function": {"name": "get_time"}}
    for body in (dict(tool_choice="required", **cut), dict(tool_choice=other)):
        with pytest.raises(openai.UnprocessableEntityError, match="tool_choice"):
            client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **body)
        with pytest.raises(openai.APIError, match="tool_choice"):  # streamed: the stream's last event
            streamed_chat(client, messages=ASK, tools=TOOLS, **body)
    body = dict(model=MODEL, max_tokens=16, tools=ANTHROPIC_TOOLS, messages=ASK, tool_choice={"type": "any"},
                stop_sequences=[CALL_START[family]])
    with pytest.raises(anthropic.UnprocessableEntityError, match="tool_choice"):
        claude.messages.create(**body)
    with pytest.raises(anthropic.APIStatusError, match="tool_choice"), claude.messages.stream(**body) as stream:
        stream.get_final_message()
    with pytest.raises(openai.BadRequestError, match="not one of the tools"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert "unhandled error" not in caplog.text  # a 422 of the model's answer is no bug
    after = {status: [request_errors(srv, route, status) for route in routes] for status in (422, 500)}
    # counted as the 422 the client got, never a 500
    assert after[500] == before[500] and all(a > b for a, b in zip(after[422], before[422], strict=True))


def test_a_broken_call_comes_back_as_text_never_a_500(family_server, caplog):
    family, tok, srv = family_server
    client = openai_client(srv)
    body = dict(messages=ASK, tools=TOOLS, logit_bias=broken_bias(tok, family))
    r = client.chat.completions.create(model=MODEL, **body)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert "{city: Paris}" in r.choices[0].message.content
    content, calls, finish = streamed_chat(client, **body)
    assert (content, calls, finish) == (r.choices[0].message.content, [], "stop")
    assert "tool call returned as text" in caplog.text


# -- fuzzing the tool fields: never a 5xx, and a stream always says what the answer says --------------------
_NAMES = ("get_weather", "get_time", "lookup")
_tools = st.lists(st.sampled_from(_NAMES), unique=True, max_size=3)
_choice = st.one_of(st.none(), st.sampled_from(["none", "auto", "required"]), st.sampled_from([*_NAMES, "nope"]))
_fields = st.fixed_dictionaries({"tools": _tools, "choice": _choice, "parallel": st.one_of(st.none(), st.booleans()),
                                 "cut": st.booleans(), "broken": st.booleans()})


def openai_body(family: str, tok, fields: dict) -> dict:
    body: dict = {"model": MODEL, "messages": ASK, "max_tokens": 12}
    if fields["tools"]:
        body["tools"] = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
                         for n in fields["tools"]]
    choice = fields["choice"]
    if choice is not None:
        body["tool_choice"] = choice if choice in ("none", "auto", "required") else \
            {"type": "function", "function": {"name": choice}}
    if fields["parallel"] is not None:
        body["parallel_tool_calls"] = fields["parallel"]
    if fields["cut"]:
        body["stop"] = [CALL_START[family]]
    if fields["broken"]:
        body["logit_bias"] = broken_bias(tok, family)
    return body


def anthropic_body(family: str, fields: dict) -> dict:
    body: dict = {"model": MODEL, "messages": ASK, "max_tokens": 12}
    if fields["tools"]:
        body["tools"] = [{"name": n, "input_schema": {"type": "object"}} for n in fields["tools"]]
    choice = fields["choice"]
    if choice is not None:
        body["tool_choice"] = {"type": {"required": "any"}.get(choice, choice)} if choice in (
            "none", "auto", "required") else {"type": "tool", "name": choice}
        if fields["parallel"] is not None:
            body["tool_choice"]["disable_parallel_tool_use"] = not fields["parallel"]
    if fields["cut"]:
        body["stop_sequences"] = [CALL_START[family]]
    return body


def sse_data(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def openai_stream_answer(text: str) -> tuple:
    """(content, calls, finish) assembled from a chat stream's chunks, or ("error", code) if it ended in one."""
    content, calls, finish = "", {}, None
    for chunk in sse_data(text):
        if "error" in chunk:
            return "error", chunk["error"]["code"]
        ChatCompletionChunk.model_validate(chunk)
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.get("id") or call["id"]
                call["name"] += delta.get("function", {}).get("name") or ""
                call["arguments"] += delta.get("function", {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


def anthropic_stream_answer(text: str) -> tuple:
    """(blocks, stop_reason) assembled from a messages stream, or ("error", type) if it ended in one."""
    blocks, reason = [], None
    for event in sse_data(text):
        kind = event["type"]
        if kind == "error":
            return "error", event["error"]["type"]
        if kind == "content_block_start":
            block = event["content_block"]
            blocks.append([block["type"], block.get("text", ""), block.get("name"), ""])
        elif kind == "content_block_delta":
            delta = event["delta"]
            blocks[event["index"]][1 if delta["type"] == "text_delta" else 3] += \
                delta.get("text", delta.get("partial_json", ""))
        elif kind == "message_delta":
            reason = event["delta"]["stop_reason"]
    return [(t, text, name, json.loads(args) if t == "tool_use" else None) for t, text, name, args in blocks], reason


def _fuzz_settings(test):
    return settings(max_examples=12, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))(test)


@_fuzz_settings
@given(fields=_fields)
def test_fuzzed_openai_tool_fields_are_never_a_5xx_and_streams_agree(family_server, fields):
    family, tok, srv = family_server
    body = openai_body(family, tok, fields)
    with srv.client(ALPHA) as http:
        whole = http.post("/v1/chat/completions", json=body)
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code in (200, 400, 422), whole.text
    if whole.status_code == 400:
        assert streamed.status_code == 400 and whole.json()["error"]["param"] == "tool_choice", whole.text
        return
    assert streamed.status_code == 200, streamed.text
    if whole.status_code == 422:
        assert openai_stream_answer(streamed.text) == ("error", "tool_call_missing")
        return
    message = ChatCompletion.model_validate(whole.json()).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in message.message.tool_calls or []]
    assert openai_stream_answer(streamed.text) == (message.message.content or "", calls, message.finish_reason)
    declared = "get_weather" in fields["tools"] and fields["choice"] != "none"
    assert calls == ([("get_weather", '{"city": "Paris"}')] if declared and not fields["cut"]
                     and not fields["broken"] else [])


@_fuzz_settings
@given(fields=_fields)
def test_fuzzed_anthropic_tool_fields_are_never_a_5xx_and_streams_agree(family_server, fields):
    family, _, srv = family_server
    body = anthropic_body(family, fields)
    with srv.client(ALPHA) as http:
        whole = http.post("/v1/messages", json=body)
        streamed = http.post("/v1/messages", json={**body, "stream": True})
    assert whole.status_code in (200, 400, 422), whole.text
    if whole.status_code != 200:
        assert whole.json()["error"]["type"] == "invalid_request_error"
    if whole.status_code == 400:
        assert streamed.status_code == 400, streamed.text
        return
    assert streamed.status_code == 200, streamed.text
    if whole.status_code == 422:
        assert anthropic_stream_answer(streamed.text) == ("error", "invalid_request_error")
        return
    message = AnthropicMessage.model_validate(whole.json())
    blocks = [(b.type, getattr(b, "text", ""), getattr(b, "name", None), getattr(b, "input", None))
              for b in message.content]
    assert anthropic_stream_answer(streamed.text) == (blocks, message.stop_reason)



#: A call whose arguments grow a nested list, then stop being JSON: cut after each piece, a different cut.
CUT_SCRIPT = ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2', '], "note": x',
              "y}}", "</tool_call>"]


def scripted_server(tokenizer, script: list[str]):
    """A live server whose hermes model answers ``script``."""
    tok = family_tokenizer(tokenizer, "hermes", script)
    cache = make_cache(scripted_model(tok, "hermes", script=script), tok)
    with live(create_app(proxy_settings(default_max_tokens=16), cache=cache)) as srv:
        yield srv
    cache.close()


@pytest.fixture(scope="module")
def cut_server(tokenizer):
    yield from scripted_server(tokenizer, CUT_SCRIPT)


def test_a_call_cut_by_max_tokens_streams_the_tool_use_input_the_unstreamed_block_has(cut_server):
    """Cut inside a nested list, or after arguments that stopped being JSON: the streamed tool_use block's input
    (as the official client accumulates its input_json_delta) is the unstreamed block's, the members written
    whole, and the client's accumulator never fails on the partial JSON."""
    claude = anthropic_client(cut_server)
    for cut, whole in ((2, {"city": "Paris"}), (3, {"city": "Paris", "days": [1, 2]})):
        body = dict(model=MODEL, max_tokens=cut, tools=ANTHROPIC_TOOLS, messages=ASK)
        unstreamed = claude.messages.create(**body)
        with claude.messages.stream(**body) as stream:
            streamed = stream.get_final_message()
        for message in (unstreamed, streamed):
            assert message.stop_reason == "max_tokens"
            assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", whole)]


#: A call whose argument is a lone surrogate escape: valid JSON, no Unicode text.
SURROGATE_SCRIPT = ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "\\ud83d", "n": 1', "}}",
                    "</tool_call>"]


@pytest.fixture(scope="module")
def surrogate_server(tokenizer):
    yield from scripted_server(tokenizer, SURROGATE_SCRIPT)


def test_a_call_holding_a_lone_surrogate_escape_is_served_as_text_not_a_500(surrogate_server):
    """The model's arguments hold "\\ud83d" alone, which no UTF-8 answer can carry decoded: whole, the call is the
    text the model wrote (as a call with NaN); cut, its input leaves that member out. Streamed and not, on both
    APIs, never an internal error or a broken stream."""
    client, claude = openai_client(surrogate_server), anthropic_client(surrogate_server)
    whole = "".join(SURROGATE_SCRIPT)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (whole, None)
    assert streamed_chat(client, messages=ASK, tools=TOOLS)[:2] == (whole, [])
    body = dict(model=MODEL, tools=ANTHROPIC_TOOLS, messages=ASK)
    assert [b.text for b in claude.messages.create(**body, max_tokens=16).content] == [whole]
    unstreamed = claude.messages.create(**body, max_tokens=2)
    with claude.messages.stream(**body, max_tokens=2) as stream:
        streamed = stream.get_final_message()
    for message in (unstreamed, streamed):
        assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", {})]
