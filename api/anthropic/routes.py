"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Same tenancy (``x-api-key`` or Bearer, authenticated before the body is read), limits,
queue and generation path as the OpenAI routes (``routes.respond``); only the shapes
differ. ``cache_control`` breakpoints are the library's (``PrefixCache.encode_messages``,
``serving/breakpoints.py``); errors take Anthropic's shape (``anthropic/errors.py``).
A stream sends ``message_start`` (with the usage known before generation),
``content_block_start``, ``ping``, text deltas, ``content_block_stop``, ``message_delta``
(stop reason, output tokens and the final input figures), ``message_stop``, or an
``error`` event if the generation fails once the stream has begun.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from prefixcache import CacheUsage, GenerationResult

from ..limits import check_anthropic
from ..protocol import CacheDiagnostics
from ..routes import Caller, Engine, GuardedRoute, Meta, check_model, place_of, respond
from ..sampling import Job, limit_max_tokens, server_temperature
from ..serving import GenerationStream, Serving
from ..settings import Settings
from ..streaming import SSE_RESPONSE, event
from .protocol import (
    CacheCreation,
    CountTokensRequest,
    ErrorResponse,
    Message,
    MessagesRequest,
    ResponseText,
    TokenCount,
    Usage,
)

router = APIRouter(route_class=GuardedRoute, tags=["anthropic"])
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
        (404, "not_found_error: unknown model"), (413, "request_too_large"), (429, "rate_limit_error: queue full"),
        (500, "api_error"), (504, "timeout_error"), (529, "overloaded_error: not ready or shutting down"))}


@router.post("/v1/messages", response_model=Message, responses={**_ERRORS, **SSE_RESPONSE})
async def messages(body: MessagesRequest, request: Request, who: Caller, srv: Engine) -> Any:
    """Anthropic's Messages API; ``cache_control`` breakpoints keep their prefixes for their TTL."""
    check_model(srv, body.model)
    check_anthropic(body, srv.settings)
    job = messages_job(body, who.tenant, srv.settings)
    stops = body.stop_sequences or []

    def answer(result: GenerationResult, meta: Meta) -> Message:
        reason, sequence = stop_reason(result, stops, srv)
        return Message(id=meta.id, content=[ResponseText(text=result.text)], model=meta.model, stop_reason=reason,
                       stop_sequence=sequence, usage=usage(result.cache, result.usage.completion_tokens, srv),
                       diagnostics=CacheDiagnostics.of(result.stats.miss_reason, result.stats.cache_missed_tokens))
    return await respond(job, bool(body.stream), request, srv, "msg", answer,
                         lambda stream, meta: _events(stream, meta, stops, srv))


@router.post("/v1/messages/count_tokens", response_model=TokenCount, responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request, who: Caller, srv: Engine) -> TokenCount:
    """The prompt's input tokens, as ``/v1/messages`` would encode it (nothing is generated or cached).
    Encoded on the side threads, in one of the key's places beside the queue."""
    check_model(srv, body.model)
    check_anthropic(body, srv.settings)
    prompt = await srv.side(lambda: srv.cache.encode_messages(**body.prompt()), place_of(request))
    return TokenCount(input_tokens=len(prompt.token_ids))


def messages_job(req: MessagesRequest, tenant: str, settings: Settings) -> Job:
    options = {"temperature": server_temperature(req.temperature, settings), "top_p": req.top_p,
               "top_k": req.top_k or None, "stop": req.stop_sequences or None}
    return Job("messages", tenant, anthropic=req.prompt(), max_tokens=limit_max_tokens(req.max_tokens, settings),
               options=options, cache_salt=req.cache_salt or None, diagnose=req.diagnostics is not None,
               previous_id=req.diagnostics.previous_message_id if req.diagnostics else None)


def usage(cache: CacheUsage | None, output_tokens: int, srv: Serving) -> Usage:
    """Anthropic's usage; tokens read from the cache as the server reports them (``cached_tokens_granularity``:
    what rounding takes off the read tokens counts as input tokens, so the parts still sum to the prompt)."""
    cache = cache or CacheUsage(0, 0, 0, 0, 0)
    read = srv.reported_cached(cache.cache_read_input_tokens)
    return Usage(input_tokens=cache.input_tokens + cache.cache_read_input_tokens - read, output_tokens=output_tokens,
                 cache_creation_input_tokens=cache.cache_creation_input_tokens,
                 cache_read_input_tokens=read,
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


async def _events(stream: GenerationStream, meta: Meta, stops: list[str], srv: Serving) -> AsyncIterator[str]:
    """Anthropic's event sequence (``streaming.tail`` turns a failure into an ``error`` event)."""
    start = usage(stream.predicted, 0, srv).model_dump()
    yield event({"message": {
        "id": meta.id, "type": "message", "role": "assistant", "content": [], "model": meta.model,
        "stop_reason": None, "stop_sequence": None, "usage": start, "diagnostics": _diagnostics(stream)}},
        "message_start")
    yield event({"index": 0, "content_block": {"type": "text", "text": ""}}, "content_block_start")
    yield event({}, "ping")
    async for text in stream.texts():
        if text:
            yield event({"index": 0, "delta": {"type": "text_delta", "text": text}}, "content_block_delta")
    result = stream.result
    reason, sequence = stop_reason(result, stops, srv)
    final = usage(result.cache, result.usage.completion_tokens, srv).model_dump(exclude={"cache_creation"})
    yield event({"index": 0}, "content_block_stop")
    yield event({"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": final}, "message_delta")
    yield event({}, "message_stop")


def _diagnostics(stream: GenerationStream) -> dict[str, Any] | None:
    """A stream's cache diagnostics, known before generation (None: not asked, or no divergence)."""
    miss = stream.miss
    found = None if miss is None else CacheDiagnostics.of(miss.type, miss.cache_missed_input_tokens)
    return None if found is None else found.model_dump(exclude_none=True)
