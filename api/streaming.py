"""The one stream tail of every API the proxy speaks: server-sent events, errors after the headers, closing.

Each API shapes its own events (OpenAI's chunks, the Responses API's and Anthropic's typed
events); what happens around them is shared: the response headers, how an event is written,
what a failure once the stream has begun becomes (the stream's last event, in the route's
error shape, unless the API's events reported it themselves: ``ReportedError``), and that
the generation stops when the stream ends, however it ends. All read the answer
as the same pieces (``pieces``, ``read``): text, and the tool calls parsed out of it when
the request declared tools, so a streamed and an unstreamed answer hold the same calls.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import xxhash
from fastapi.responses import StreamingResponse

from prefixcache import GenerationResult
from prefixcache.serving.tool_calls import Piece, Text, ToolUse

from .anthropic.errors import anthropic_error, is_anthropic
from .errors import ClientClosedError, map_exception
from .serving import GenerationStream, Serving, StreamGroup

T = TypeVar("T")
log = logging.getLogger(__name__)

#: The OpenAPI entry of a route that streams when asked.
SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events if stream is true"}}


def event(body: dict[str, Any], kind: str | None = None) -> str:
    """One server-sent event: ``data`` only (OpenAI), or named by ``kind`` with the kind as ``type`` (Anthropic)."""
    if kind is None:
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


def sse(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def tail(events: AsyncIterator[str], stream: GenerationStream | StreamGroup, route: str,
               srv: Serving) -> AsyncIterator[str]:
    """``events``, then: a failure becomes the stream's last event (in ``route``'s error shape, counted in
    metrics), and the generation is stopped when the stream ends (done, failed, or the client gone).

    A client gone before the stream ended (Starlette cancels the response, or the abandoned stream is
    closed) is counted as a 499, as one that leaves a request that does not stream, once the generation
    stops, unless it still ended as an answer (counted as served then)."""
    ended = False
    try:
        async for item in events:
            yield item
        ended = True
    except Exception as exc:  # after the headers: the error becomes the stream's last event
        ended = True
        cause = exc.cause if isinstance(exc, ReportedError) else exc
        mapped = map_exception(cause)
        if mapped.status >= 500 and mapped.detail.code == "internal_error":
            log.error("error while streaming", exc_info=cause)
        srv.metrics.error(route, mapped.status)
        if isinstance(exc, ReportedError):
            return  # the events already said it, in their API's shape
        if is_anthropic(route):
            yield event({"error": anthropic_error(mapped.status, mapped.detail.message)[1]["error"]}, "error")
        else:
            yield event({"error": mapped.detail.model_dump()})
    finally:
        if not ended:
            stream.when_cut_short(lambda: srv.metrics.error(route, ClientClosedError.status))
        stream.close()


class ReportedError(Exception):
    """A failure an API's events already reported in its own shape (the Responses API's ``error`` and
    ``response.failed``): ``tail`` counts ``cause`` and sends nothing more."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


async def pieces(stream: GenerationStream, tools: ToolUse | None) -> AsyncIterator[Piece]:
    """The answer as it streams: text deltas, and its calls once each is complete (``tools``: how they are read;
    None: all text). At the end a call ``tool_choice`` required and did not get raises ``ToolCallError``, unless
    ``max_tokens`` cut the answer (which may end inside a call: an incomplete one, ``tool_calls.ToolCall``)."""
    if tools is None:
        async for text in stream.texts():
            if text:
                yield Text(text)
        return
    parser, seen = tools.parser(), []
    async for text in stream.texts():
        for piece in parser.feed(text):
            seen.append(piece)
            yield piece
    assert stream.result is not None  # set once its texts ended
    cut = stream.result.finish_reason == "length"
    for piece in parser.finish(cut):
        seen.append(piece)
        yield piece
    tools.check(seen, cut)


async def merged(iterators: list[AsyncIterator[T]]) -> AsyncIterator[T]:
    """The items of ``iterators`` as each yields them (a request's choices streaming side by side); the first
    error of any is raised, and ends the others."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield item
        return
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async def pump(iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put(("item", item))
        except Exception as exc:  # noqa: BLE001 - raised by the merge, in the consumer's task
            await queue.put(("error", exc))
        else:
            await queue.put(("end", None))

    pumps = [asyncio.ensure_future(pump(iterator)) for iterator in iterators]
    try:
        left = len(pumps)
        while left:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                left -= 1
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def read(result: GenerationResult, tools: ToolUse | None) -> list[Piece]:
    """The whole answer's pieces, as ``pieces`` streams them (adjacent texts joined)."""
    return [Text(result.text)] if tools is None else tools.read(result.text, result.finish_reason == "length")


def call_id(response_id: str, index: int, tools: ToolUse, prefix: str) -> str:
    """The id of a response's ``index``-th call: stable per response; nine alphanumerics for Mistral's
    templates, which refuse any other id when the call is sent back."""
    digest = xxhash.xxh64_hexdigest(f"{response_id}/{index}".encode())
    return digest[:9] if tools.family == "mistral" else prefix + digest
