"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request is translated into a chat completion request (``translate.py``) and served as one:
the same chat template, tenant namespace, prefix cache, tool-call parsing (strict tools
included), cache fields, limits, queue, metrics and errors (``routes.respond``). Only the
shapes differ: the answer is a ``response`` whose ``output`` holds a ``message`` item of
``output_text`` for each run of text and a ``function_call`` item for each call, in the
order the model wrote them; reaching ``max_output_tokens`` makes it ``incomplete``. A stream
sends the semantic events, numbered by ``sequence_number``: ``response.created``,
``response.in_progress``, then per item ``response.output_item.added``, (a message)
``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, (a call) ``response.function_call_arguments.delta`` and
``.done``, then ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete``). A failure once the stream has begun is an ``error`` event then
``response.failed``. Stored responses (``store.py``) continue with ``previous_response_id``.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import xxhash
from fastapi import APIRouter, Query, Request

from prefixcache import GenerationResult, TokenLogprob
from prefixcache.errors import InvalidRequestError
from prefixcache.serving.tool_calls import Piece, Text, ToolCall, ToolUse

from ..errors import NotFoundError, ProxyError, map_exception
from ..jobs import chat_job
from ..limits import check_chat
from ..logprobs import TokenText, chat_content
from ..routes import _ERRORS, Caller, GuardedRoute, Meta, ServingDep, check_model, respond
from ..serving import GenerationStream, Serving
from ..streaming import SSE_RESPONSE, ReportedError, call_id, event, pieces, read
from .protocol import (
    DeletedResponse,
    FunctionChoice,
    FunctionTool,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseErrorInfo,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from .store import ResponseStore, StoredResponse
from .translate import chat_request, check_call_ids, input_messages, output_messages, param_of, refuse

router = APIRouter(route_class=GuardedRoute, tags=["openai"])


class PreviousResponseNotFoundError(ProxyError):
    """``previous_response_id`` names no response this API key stored (never, expired, dropped, another's)."""

    status, type, code = 400, "invalid_request_error", "previous_response_not_found"


@router.post("/v1/responses", response_model=ResponseObject,
             responses={**_ERRORS, **SSE_RESPONSE})
async def create_response(body: ResponsesRequest, request: Request, who: Caller, srv: ServingDep) -> Any:
    """OpenAI's Responses API, served as a chat completion."""
    check_model(srv, body.model)
    store: ResponseStore = request.app.state.responses
    with _named_as_responses():
        refuse(body)
        found: StoredResponse | None = None
        if body.previous_response_id is not None:
            found = store.get(who.tenant, body.previous_response_id)
            if found is None:
                raise PreviousResponseNotFoundError(f"Previous response with id '{body.previous_response_id}' not "
                                                    "found.", param="previous_response_id")
        own = input_messages(body)
        earlier = found.conversation() if found is not None else []
        check_call_ids(body, earlier)
        conversation = earlier + own
        chat = chat_request(body, conversation)
        check_chat(chat, srv.settings)
        job = chat_job(chat, who.tenant, srv.settings, srv.vocab_size, srv.tool_family)
    job.api = "responses"
    shape = _Shape(body, srv)
    tenant, keep = who.tenant, body.store is not False

    def finish(result: GenerationResult, meta: Meta, output: list[Any]) -> ResponseObject:
        response = shape.response(meta, output, result)
        if keep:
            store.put(tenant, response.model_dump(), own + output_messages(output), previous=found)
        return response

    def answer(result: GenerationResult, meta: Meta) -> ResponseObject:
        output = _items(read(result, job.tool_use), meta, job.tool_use, _status(result))
        if result.logprobs is not None:  # with logprobs asked, no tools: the answer is one message
            output[0].content[0].logprobs = chat_content(result.logprobs, srv.token_text)
        return finish(result, meta, output)

    names = None if job.options.logprobs is None else srv.token_text
    with _named_as_responses():
        return await respond(job, bool(body.stream), request, srv, "resp_", answer,
                             lambda stream, meta: _events(stream, meta, shape, job.tool_use, finish, names))


_ReadWhole = Annotated[bool, Query(description="Only false: a stored response is read whole, not streamed back "
                                   "as events.")]


@router.get("/v1/responses/{response_id}", response_model=ResponseObject, responses=_ERRORS)
async def get_response(response_id: str, request: Request, who: Caller, stream: _ReadWhole = False) -> ResponseObject:
    """A response this API key stored (``store`` unset or true), while it is kept. ``include`` (``include[]``)
    changes nothing: the response is as it was created (with its output text's logprobs if creating it asked)."""
    if stream:
        raise InvalidRequestError("stream=true is not supported: a stored response is read whole", param="stream")
    found = request.app.state.responses.get(who.tenant, response_id)
    if found is None:
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return ResponseObject.model_validate(found.response)


@router.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=_ERRORS)
async def delete_response(response_id: str, request: Request, who: Caller) -> DeletedResponse:
    """Forget a stored response: it can no longer be read or continued."""
    if not request.app.state.responses.delete(who.tenant, response_id):
        raise NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
    return DeletedResponse(id=response_id)


@contextmanager
def _named_as_responses() -> Iterator[None]:
    """A refusal from chat's path names the parameter as the Responses request spells it."""
    try:
        yield
    except (InvalidRequestError, ProxyError) as exc:
        exc.param = param_of(exc.param)
        raise


class _Shape:
    """The response object of a request: its echoed parameters around the answer's output and usage."""

    def __init__(self, req: ResponsesRequest, srv: Serving):
        self.srv = srv
        choice = req.tool_choice
        self.echo: dict[str, Any] = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "previous_response_id": req.previous_response_id,
            "store": req.store is not False, "metadata": req.metadata or {},
            "prompt_cache_key": req.prompt_cache_key, "prompt_cache_retention": req.prompt_cache_retention,
            "safety_identifier": req.safety_identifier, "user": req.user,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "tools": [{**t.model_dump(), "strict": bool(t.strict)} for t in req.tools or []
                      if isinstance(t, FunctionTool)],
            "temperature": req.temperature if req.temperature is not None else srv.settings.default_temperature,
            "top_p": req.top_p if req.top_p is not None else 1.0, "top_logprobs": req.top_logprobs or 0}
        if req.text is not None and req.text.format is not None:
            self.echo["text"] = {"format": req.text.format.model_dump(exclude_none=True), "verbosity": "medium"}

    def started(self, meta: Meta) -> ResponseObject:
        return ResponseObject(id=meta.id, created_at=meta.created, model=meta.model, status="in_progress", output=[],
                              **self.echo)

    def response(self, meta: Meta, output: list[Any], result: GenerationResult) -> ResponseObject:
        u = result.usage
        written = 0 if result.cache is None else result.cache.cache_creation_input_tokens
        usage = ResponseUsage(input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens,
                              total_tokens=u.total_tokens, input_tokens_details=InputTokensDetails(
                                  cached_tokens=self.srv.reported_cached(u.cached_tokens),
                                  cache_write_tokens=written))
        status = _status(result)
        return ResponseObject(id=meta.id, created_at=meta.created, completed_at=int(time.time()), model=meta.model,
                              status=status, output=output, usage=usage,
                              incomplete_details=IncompleteDetails(reason="max_output_tokens")
                              if status == "incomplete" else None, **self.echo)

    def failed(self, meta: Meta, output: list[Any], code: str, message: str) -> ResponseObject:
        return ResponseObject(id=meta.id, created_at=meta.created, model=meta.model, status="failed", output=output,
                              error=ResponseErrorInfo(code=code, message=message), **self.echo)


def _status(result: GenerationResult) -> str:
    return "incomplete" if result.finish_reason == "length" else "completed"


def _item_id(meta: Meta, kind: str, index: int) -> str:
    return f"{kind}_{xxhash.xxh64_hexdigest(f'{meta.id}/{index}'.encode())}"


def _message(meta: Meta, index: int, text: str, status: str) -> OutputMessage:
    return OutputMessage(id=_item_id(meta, "msg", index), status=status, content=[OutputText(text=text)])


def _call(meta: Meta, index: int, calls: int, call: ToolCall, tools: ToolUse | None) -> OutputFunctionCall:
    assert tools is not None  # calls are parsed only where tools were declared
    return OutputFunctionCall(id=_item_id(meta, "fc", index), status="completed" if call.complete else "incomplete",
                              name=call.name, arguments=call.arguments, call_id=call_id(meta.id, calls, tools, "call_"))


def _items(answer: list[Piece], meta: Meta, tools: ToolUse | None, status: str) -> list[Any]:
    """The output items of a whole answer, as ``_events`` streams them: a message per run of text, a call each."""
    items: list[Any] = []
    calls = 0
    for piece in answer:
        if isinstance(piece, Text):
            if items and isinstance(items[-1], OutputMessage):
                items[-1].content[0].text += piece.text
            else:
                items.append(_message(meta, len(items), piece.text, "completed"))
        else:
            items.append(_call(meta, len(items), calls, piece, tools))
            calls += 1
    if not items:
        items.append(_message(meta, 0, "", "completed"))
    if isinstance(items[-1], OutputMessage):
        items[-1].status = status  # a text cut by max_output_tokens is incomplete
    return items


async def _events(stream: GenerationStream, meta: Meta, shape: _Shape, tools: ToolUse | None,
                  finish: Any, names: TokenText | None = None) -> AsyncIterator[str]:
    """The Responses API's event sequence (a failure once begun: ``error``, then ``response.failed``). ``names``:
    the request asked for logprobs (each text delta carries its tokens'; those of tokens whose text came before, or
    that have none, a last delta of no text), read with it."""
    number = 0
    output: list[Any] = []

    def send(kind: str, **body: Any) -> str:
        nonlocal number
        number += 1
        return event({**body, "sequence_number": number - 1}, kind)

    def close_text(status: str = "completed") -> Iterator[str]:
        item = output[-1]
        index, text = len(output) - 1, item.content[0].text
        yield send("response.output_text.done", item_id=item.id, output_index=index, content_index=0, text=text,
                   logprobs=item.content[0].logprobs)
        yield send("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                   part=item.content[0].model_dump())
        item.status = status
        yield send("response.output_item.done", output_index=index, item=item.model_dump())

    def delta(text: str, entries: list[TokenLogprob]) -> str:
        """The open message's text delta, with the logprobs of its tokens when asked."""
        if names is not None:
            output[-1].content[0].logprobs += chat_content(entries, names)
        return send("response.output_text.delta", item_id=output[-1].id, output_index=len(output) - 1,
                    content_index=0, delta=text, logprobs=chat_content(entries, names, with_bytes=False)
                    if entries else [])

    def open_text() -> Iterator[str]:
        item = _message(meta, len(output), "", "in_progress")
        output.append(item)
        yield send("response.output_item.added", output_index=len(output) - 1, item=item.model_dump())
        yield send("response.content_part.added", item_id=item.id, output_index=len(output) - 1, content_index=0,
                   part=OutputText(text="").model_dump())

    yield send("response.created", response=shape.started(meta).model_dump())
    yield send("response.in_progress", response=shape.started(meta).model_dump())
    text_open, calls = False, 0
    try:
        async for piece in pieces(stream, tools):
            if isinstance(piece, Text):
                if not text_open:
                    for item in open_text():
                        yield item
                    text_open = True
                output[-1].content[0].text += piece.text
                yield delta(piece.text, stream.take_logprobs())
                continue
            if text_open:
                for item in close_text():
                    yield item
                text_open = False
            call = _call(meta, len(output), calls, piece, tools)
            added = call.model_copy(update={"arguments": "", "status": "in_progress"})
            output.append(call)
            index = len(output) - 1
            yield send("response.output_item.added", output_index=index, item=added.model_dump())
            yield send("response.function_call_arguments.delta", item_id=call.id, output_index=index,
                       delta=call.arguments)
            yield send("response.function_call_arguments.done", item_id=call.id, output_index=index,
                       name=call.name, arguments=call.arguments)
            yield send("response.output_item.done", output_index=index, item=call.model_dump())
            calls += 1
    except Exception as exc:  # after the headers: OpenAI's error event, then the failed response
        mapped = map_exception(exc)
        yield send("error", code=mapped.detail.code, message=mapped.detail.message, param=mapped.detail.param)
        yield send("response.failed", response=shape.failed(
            meta, [item.model_dump() for item in output], _failed_code(mapped.status), mapped.detail.message
        ).model_dump())
        raise ReportedError(exc) from exc
    result = stream.result
    status = _status(result)
    rest = stream.take_logprobs() if names is not None else []
    if not output or (rest and not text_open):  # an empty answer is one empty message, as unstreamed
        for item in open_text():
            yield item
        text_open = True
    if rest:
        yield delta("", rest)
    if text_open:
        for item in close_text(status):
            yield item
    response = finish(result, meta, output)
    kind = "response.incomplete" if status == "incomplete" else "response.completed"
    yield send(kind, response=response.model_dump())


def _failed_code(status: int) -> str:
    """A failed response's ``error.code`` among OpenAI's: the ``error`` event before it carries the exact one."""
    return "rate_limit_exceeded" if status == 429 else "server_error"
