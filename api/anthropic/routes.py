"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Same tenancy (``x-api-key`` or Bearer, authenticated before the body is read), limits,
queue and generation path as the OpenAI routes (``routes.respond``); only the shapes
differ. ``cache_control`` breakpoints are the library's (``PrefixCache.encode_messages``,
``serving/breakpoints.py``); errors take Anthropic's shape (``anthropic/errors.py``).
The model's tool calls (parsed in its chat template's syntax, ``tool_calls.py``) become
``tool_use`` blocks, with ``stop_reason`` "tool_use". ``output_config.format`` holds the text answer to a
JSON schema (``serving/messages.output_format``; the answer's JSON is not read for tool calls). A stream sends ``message_start`` (with
the usage known before generation: the tokens it reads, no cache write, since a breakpoint is
kept only once the answer is stored and memory pressure may drop it), then each block:
``content_block_start`` (the first followed by ``ping``), text deltas or a call's
``input_json_delta``, ``content_block_stop``; then ``message_delta`` (stop reason, output
tokens and the settled input figures, cumulative as Anthropic's, ``cache_creation`` too),
``message_stop``, or an ``error`` event if the generation fails once the stream has begun.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from prefixcache import CacheUsage, GenerationResult
from prefixcache.serving.messages import MessagesPrompt, output_format, prefilled
from prefixcache.serving.options import AnswerOptions
from prefixcache.serving.request import CallStats
from prefixcache.serving.structured import tool_call_grammar
from prefixcache.serving.tool_calls import Text, ToolUse, anthropic_tool_use, cut_short

from ..jobs import Job, limit_max_tokens, server_temperature
from ..limits import check_anthropic
from ..protocol import CacheDiagnostics
from ..routes import Caller, GuardedRoute, Meta, ServingDep, check_model, place_of, respond
from ..serving import GenerationStream, Serving
from ..settings import Settings
from ..streaming import SSE_RESPONSE, call_id, event, pieces, read
from .protocol import (
    CacheCreation,
    CountTokensRequest,
    ErrorResponse,
    Message,
    MessagesRequest,
    ResponseText,
    ResponseToolUse,
    TokenCount,
    Usage,
)

router = APIRouter(route_class=GuardedRoute, tags=["anthropic"])
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
        (404, "not_found_error: unknown model"), (413, "request_too_large"),
        (422, "invalid_request_error: tool_choice required a tool call the answer does not make"),
        (429, "rate_limit_error: queue full"),
        (500, "api_error: also a strict tool's call whose arguments do not match its schema, or an "
                "output_config.format answer that does not match its schema"), (504, "timeout_error"), (529, "overloaded_error: not ready or shutting down"))}


@router.post("/v1/messages", response_model=Message, responses={**_ERRORS, **SSE_RESPONSE})
async def messages(body: MessagesRequest, request: Request, who: Caller, srv: ServingDep) -> Any:
    """Anthropic's Messages API; ``cache_control`` breakpoints keep their prefixes for their TTL."""
    check_model(srv, body.model)
    check_anthropic(body, srv.settings)
    # Off the event loop: compiling an output_config.format's or strict tool's schema takes up to a few hundred ms.
    job = await asyncio.to_thread(messages_job, body, who.tenant, srv.settings, srv.tool_family)
    stops = body.stop_sequences or []

    def answer(result: GenerationResult, meta: Meta) -> Message:
        content: list[ResponseText | ResponseToolUse] = []
        answer = read(result, job.tool_use)
        for piece in answer:
            if isinstance(piece, Text):
                content.append(ResponseText(text=piece.text))
            else:
                content.append(ResponseToolUse(id=_use_id(meta, len(content), job.tool_use), name=piece.name,
                                               input=piece.input))
        reason, sequence = stop_reason(result, stops, srv)
        if any(isinstance(block, ResponseToolUse) for block in content) and not cut_short(answer):
            reason, sequence = "tool_use", None  # a call cut by max_tokens: "max_tokens", as Anthropic's
        return Message(id=meta.id, content=content or [ResponseText(text="")], model=meta.model, stop_reason=reason,
                       stop_sequence=sequence, usage=usage(result.cache, result.usage.completion_tokens, srv,
                                                                       result.stats),
                       diagnostics=CacheDiagnostics.of(result.stats.miss_reason, result.stats.cache_missed_tokens))
    return await respond(job, bool(body.stream), request, srv, "msg", answer,
                         lambda stream, meta: _events(stream, meta, stops, job.tool_use, srv))


@router.post("/v1/messages/count_tokens", response_model=TokenCount, responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request, who: Caller, srv: ServingDep) -> TokenCount:
    """The prompt's input tokens, as ``/v1/messages`` would encode it (nothing is generated or cached).
    Encoded on the side threads, in one of the key's places beside the queue."""
    check_model(srv, body.model)
    check_anthropic(body, srv.settings)
    def encode() -> MessagesPrompt:
        output_format(body.output(), body.prompt()["messages"], body.prompt()["tool_choice"])  # checked as a message's
        return srv.cache.encode_messages(**body.prompt())
    prompt = await srv.side(encode, place_of(request))
    return TokenCount(input_tokens=len(prompt.token_ids))


def messages_job(req: MessagesRequest, tenant: str, settings: Settings, tool_family: str | None = None) -> Job:
    """``tool_family``: the syntax of the model's tool calls (``tool_calls.tokenizer_family``)."""
    prompt = req.prompt()
    fmt = output_format(req.output(), prompt["messages"], prompt["tool_choice"])
    reading = anthropic_tool_use(tool_family, prompt["tools"], prompt["tool_choice"])  # strict tools checked
    reading = None if fmt is not None else reading  # the answer is the format's JSON: no call to read in it
    # A forced call to strict tools is constrained to their schemas (not where it continues a prefill).
    forced = None if prefilled(prompt["messages"]) else tool_call_grammar(reading)
    options = AnswerOptions.parse(temperature=server_temperature(req.temperature, settings), top_p=req.top_p,
                                  top_k=req.top_k or None, stop=req.stop_sequences or None,
                                  blend=req.prefixcache_blend, response_format=fmt, tool_grammar=forced)
    return Job("messages", tenant, anthropic=prompt, max_tokens=limit_max_tokens(req.max_tokens, settings),
               options=options, cache_salt=req.cache_salt or None, diagnose=req.diagnostics is not None,
               previous_id=req.diagnostics.previous_message_id if req.diagnostics else None, tool_use=reading)


def _use_id(meta: Meta, index: int, tools: ToolUse | None) -> str:
    assert tools is not None  # calls are parsed only where tools were declared
    return call_id(meta.id, index, tools, "toolu_")


def usage(cache: CacheUsage | None, output_tokens: int, srv: Serving, stats: CallStats | None = None) -> Usage:
    """Anthropic's usage; tokens read from the cache as the server reports them (``cached_tokens_granularity``:
    what rounding takes off the read tokens counts as input tokens, so the parts still sum to the prompt)."""
    cache = cache or CacheUsage(0, 0, 0, 0, 0)
    read = srv.reported_cached(cache.cache_read_input_tokens)
    return Usage(input_tokens=cache.input_tokens + cache.cache_read_input_tokens - read, output_tokens=output_tokens,
                 cache_creation_input_tokens=cache.cache_creation_input_tokens,
                 cache_read_input_tokens=read,
                 chunk_reused_input_tokens=0 if stats is None else stats.chunk_reused_tokens,
                 chunk_recomputed_input_tokens=0 if stats is None else stats.chunk_recomputed_tokens,
                 cache_creation=CacheCreation(ephemeral_5m_input_tokens=cache.ephemeral_5m_input_tokens,
                                              ephemeral_1h_input_tokens=cache.ephemeral_1h_input_tokens))


def stop_reason(result: GenerationResult, stops: list[str], srv: Serving) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``: which stop string cut the text, if one did."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if stops and result.finish_reason == "stop":
        whole = srv.cache.tokenizer.decode(list(result.token_ids), skip_special_tokens=True)
        for stop in stops:
            if whole.startswith(stop, len(result.text)):
                return "stop_sequence", stop
    return "end_turn", None


async def _events(stream: GenerationStream, meta: Meta, stops: list[str], tools: ToolUse | None,
                  srv: Serving) -> AsyncIterator[str]:
    """Anthropic's event sequence (``streaming.tail`` turns a failure into an ``error`` event)."""
    start = usage(stream.predicted, 0, srv).model_dump()
    yield event({"message": {
        "id": meta.id, "type": "message", "role": "assistant", "content": [], "model": meta.model,
        "stop_reason": None, "stop_sequence": None, "usage": start, "diagnostics": _diagnostics(stream)}},
        "message_start")
    blocks, text_open, calls, cut = 0, False, 0, False  # blocks started; whether the last is a text block still open

    def begin(block: dict[str, Any]) -> list[str]:
        opened = [event({"index": blocks, "content_block": block}, "content_block_start")]
        return opened + [event({}, "ping")] if blocks == 0 else opened

    async for piece in pieces(stream, tools):
        if isinstance(piece, Text):
            if not text_open:
                for item in begin({"type": "text", "text": ""}):
                    yield item
                blocks, text_open = blocks + 1, True
            yield event({"index": blocks - 1, "delta": {"type": "text_delta", "text": piece.text}},
                        "content_block_delta")
            continue
        if text_open:
            yield event({"index": blocks - 1}, "content_block_stop")
        for item in begin({"type": "tool_use", "id": _use_id(meta, blocks, tools), "name": piece.name, "input": {}}):
            yield item
        # A call max_tokens cut streams the members written whole, the input its unstreamed block has: what was
        # written of its arguments may be no JSON a client's accumulator reads.
        written = piece.arguments if piece.complete else json.dumps(piece.input, ensure_ascii=False)
        yield event({"index": blocks, "delta": {"type": "input_json_delta", "partial_json": written}},
                    "content_block_delta")
        yield event({"index": blocks}, "content_block_stop")
        blocks, text_open, calls, cut = blocks + 1, False, calls + 1, not piece.complete
    if blocks == 0:  # an empty answer is one empty text block, as unstreamed
        for item in begin({"type": "text", "text": ""}):
            yield item
        blocks, text_open = 1, True
    if text_open:
        yield event({"index": blocks - 1}, "content_block_stop")
    result = stream.result
    reason, sequence = ("tool_use", None) if calls and not cut else stop_reason(result, stops, srv)
    final = usage(result.cache, result.usage.completion_tokens, srv, result.stats).model_dump()
    yield event({"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": final}, "message_delta")
    yield event({}, "message_stop")


def _diagnostics(stream: GenerationStream) -> dict[str, Any] | None:
    """A stream's cache diagnostics, known before generation (None: not asked, or no divergence)."""
    miss = stream.miss
    found = None if miss is None else CacheDiagnostics.of(miss.type, miss.cache_missed_input_tokens)
    return None if found is None else found.model_dump(exclude_none=True)
