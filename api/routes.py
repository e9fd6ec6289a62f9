"""HTTP routes: authenticate, turn the request into a job, hand it to ``Serving``, shape the answer.

Handlers stay thin: tenancy lives in ``auth``, input bounds in ``limits``, parameter
handling in ``jobs``, queueing and cancellation in ``serving``, error mapping in
``errors``. Every route is a ``GuardedRoute``: the caller is authenticated and a tenant key's
place reserved before the body is read, and the body is read with a cap and a deadline before
FastAPI parses it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Security
from fastapi.dependencies.models import Dependant
from fastapi.responses import Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from prefixcache import GenerationResult
from prefixcache.errors import InvalidRequestError
from prefixcache.serving.tool_calls import Text, ToolUse, calls_of, cut_short, text_of

from .admission import Place
from .auth import Principal
from .errors import (
    InvalidBudgetError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitedError,
    UnavailableError,
    status_of,
)
from .fairness import InvalidBudget, retry_after_seconds
from .jobs import Job, chat_job, choices, completion_job
from .limits import NOT_JSON, check_chat, check_completion, check_counts, check_prewarm, read_body, utf8_text
from .logprobs import TextOffsets, chat_content, completion_logprobs
from .metrics import CONTENT_TYPE
from .protocol import (
    CacheDiagnostics,
    CacheStats,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorResponse,
    FlushResponse,
    FunctionCall,
    GenerationFields,
    Health,
    ModelCard,
    ModelList,
    PrewarmRequest,
    PrewarmResponse,
    PromptTokensDetails,
    QueueInfo,
    ResponseMessage,
    ResponseToolCall,
    TierInfo,
    UsageInfo,
)
from .serving import GenerationStream, Serving, StreamGroup
from .streaming import SSE_RESPONSE, call_id, event, merged, pieces, read, sse, tail

log = logging.getLogger(__name__)
_bearer = HTTPBearer(auto_error=False, description="A tenant's API key, or the admin key.")
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text} for status, text in (
        (400, "Invalid request (validation, context length)"), (401, "Missing or wrong API key"),
        (403, "Needs the admin key"), (404, "Unknown model"), (413, "Body too large"),
        (422, "tool_choice required a tool call the model's answer does not make (tool_call_missing)"),
        (429, "Queue full, the key's rate or places in flight exceeded (Retry-After), or a pin over the "
              "tenant's pin quota"),
        (500, "The model called a strict tool with arguments that do not match its schema "
              "(tool_arguments_invalid), or a response_format answer does not match its schema "
              "(response_format_invalid)"),
        (503, "Not ready, shutting down or out of cache capacity (Retry-After)"), (504, "Timed out"))}


# -- dependencies --------------------------------------------------------------------
def principal(request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]) -> Principal:
    """The caller's tenant, from the bearer key only (the ``Security`` parameter documents the scheme).

    ``GuardedRoute`` has already authenticated the request, before reading its body.
    """
    return request.state.principal


class GuardedRoute(APIRoute):
    """A route that authenticates before anything reads the body, then reads it within the limits.

    FastAPI reads and parses a body before it solves dependencies, so a dependency
    alone would parse a stranger's body (and answer 400 or 413 instead of 401).
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        authenticated = _depends_on(self.dependant, principal)
        has_body = self.body_field is not None
        queued, side = self.path in QUEUED, self.path in SIDE

        async def guarded(request: Request) -> Response:
            state = request.app.state
            tenant, took, place = None, False, None
            if authenticated:
                who = request.state.principal = state.keyring.authenticate(request.headers.get("authorization"),
                                                                           request.headers.get("x-api-key"))
                if not who.exempt:  # a key over its budgets, rate or places is refused before its body is read
                    tenant = who.tenant
                    took = await pass_invalid_budget(state.invalid_budget, tenant)
            try:
                if tenant is not None:
                    admit_tenant(state, tenant)
                    if (queued or side) and state.serving is not None:
                        # The place is the request's from here: while its body arrives, waits and runs.
                        place = request.state.place = state.serving.admission.reserve(tenant, queued=queued)
                if has_body:
                    body, parsed = await read_body(request, state.settings)
                    check_counts(parsed, state.settings)
                    request = _ReadRequest(request, body, parsed)
                response = await handler(request)
            except Exception as exc:
                if tenant is not None:
                    state.invalid_budget.settle(tenant, took, status_of(exc) in INVALID_STATUSES)
                raise
            finally:
                if place is not None:
                    place.release()  # a no-op if its job took it
            if tenant is not None:
                state.invalid_budget.settle(tenant, took, refused=False)
            return response

        return guarded


#: Routes whose requests take a place in the queue (``Serving``), reserved before their body is read.
QUEUED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                    "/v1/cache/prewarm"})
#: Routes whose work runs on the side threads, in one of the key's few places beside the queue.
SIDE = frozenset({"/v1/messages/count_tokens", "/v1/cache/stats", "/v1/cache"})


#: Refusals that draw from a key's invalid-request budget: what the caller sent was wrong (or too slow).
INVALID_STATUSES = frozenset({400, 404, 408, 413})


async def pass_invalid_budget(budget: InvalidBudget, tenant: str) -> bool:
    """Let ``tenant``'s request by its invalid-request budget. Returns True if it went on holding a token
    of the budget (it was spent: the request waited for it, and returns it unless refused); raises 429
    if the key's budget stays empty (the request held up to ``hold_seconds`` first)."""
    hold, wait = budget.hold(tenant)
    if wait == 0.0:
        return False
    if hold > 0:
        budget.held[tenant] = budget.held.get(tenant, 0) + 1
        try:
            await asyncio.sleep(hold)
        finally:
            budget.held[tenant] -= 1
    wait = budget.take(tenant)
    if wait > 0:
        raise InvalidBudgetError(f"this API key sent too many invalid requests (more than "
                                 f"{budget.bucket.rate:g} a second over time, {budget.bucket.burst} in a row); "
                                 f"retry in {wait:.2f} s", retry_after_seconds(wait))
    return True


def admit_tenant(state: Any, tenant: str) -> None:
    """Raise 429 if ``tenant`` is over its request rate."""
    wait = state.rate_limiter.take(tenant)
    if wait > 0:
        limiter = state.rate_limiter
        raise RateLimitedError(f"this API key may send {limiter.rate:g} requests a second (bursts of "
                               f"{limiter.burst}); retry in {wait:.2f} s", retry_after_seconds(wait))


def place_of(request: Request) -> Place | None:
    """The place ``GuardedRoute`` reserved for this request (None: the admin, local mode, or a route without)."""
    return getattr(request.state, "place", None)


class _ReadRequest(Request):
    """A request whose body the route has read (bounded); FastAPI's parser takes it from here."""

    def __init__(self, request: Request, body: bytes, parsed: Any):
        super().__init__(request.scope, request.receive)
        self._read = body
        if parsed is not NOT_JSON:
            self._json = parsed  # parsed once, by ``read_body``: Starlette's ``json()`` returns it

    async def body(self) -> bytes:
        return self._read

    async def json(self) -> Any:
        """What FastAPI parses when ``read_body`` found no JSON: the UTF-8 text (checked), never the bytes
        (which ``json.loads`` would decode as UTF-16 if they begin with a NUL)."""
        if not hasattr(self, "_json"):
            self._json = json.loads(utf8_text(self._read))
        return self._json


def _depends_on(dependant: Dependant, call: Callable[..., Any]) -> bool:
    return any(dep.call is call or _depends_on(dep, call) for dep in dependant.dependencies)


router = APIRouter(route_class=GuardedRoute)


def serving(request: Request) -> Serving:
    current = request.app.state.serving
    if current is None:
        raise UnavailableError("the model is still loading", code="not_ready")
    return current


Caller = Annotated[Principal, Depends(principal)]
ServingDep = Annotated[Serving, Depends(serving)]
TenantQuery = Annotated[str | None, Query(description="Admin only: act on this tenant (omit: all). Others may "
                                          "name only their own.")]


def check_model(srv: Serving, model: str | None) -> None:
    if model is not None and model != srv.model_name:
        raise NotFoundError(f"The model `{model}` does not exist. This server serves `{srv.model_name}`.",
                            param="model", code="model_not_found")


def disconnected(request: Request) -> Callable[[], Awaitable[None]]:
    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # a stray body message; keep listening

    return wait


# -- health --------------------------------------------------------------------------
@router.get("/healthz", response_model=Health, response_model_exclude_none=True, responses=_ERRORS,
            tags=["health"])
async def healthz(request: Request) -> Health:
    """Liveness: the process answers and its batching loop runs (if it stopped, restart the process)."""
    srv = request.app.state.serving
    if srv is not None:  # still loading is alive, not failed
        srv.check_engine()
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses=_ERRORS, tags=["health"])
async def readyz(request: Request) -> Health:
    """Readiness: the model is loaded, the server is not shutting down, the queue has room and the
    batching engine's recent steps do not all fail."""
    srv = serving(request)
    srv.check_engine()
    srv.check_steps()
    if not srv.ready:
        raise UnavailableError("not ready: shutting down or the queue is full", code="not_ready")
    batching = srv.cache.batching_disabled_reason is None
    # Anyone may ask: why batching is off is in the admin's stats (batching_disabled_reason), not here.
    return Health(status="ready", batching=batching, detail=None if batching else "serving one request at a time")


# -- OpenAI ----------------------------------------------------------------------------
@router.get("/v1/models", response_model=ModelList, responses=_ERRORS, tags=["openai"])
async def list_models(who: Caller, srv: ServingDep) -> ModelList:
    return ModelList(data=[ModelCard(id=srv.model_name, created=srv.created)])


@router.get("/v1/models/{model}", response_model=ModelCard, responses=_ERRORS, tags=["openai"])
async def get_model(model: str, who: Caller, srv: ServingDep) -> ModelCard:
    check_model(srv, model)
    return ModelCard(id=srv.model_name, created=srv.created)


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses={**_ERRORS, **SSE_RESPONSE}, tags=["openai"])
async def chat_completions(body: ChatCompletionRequest, request: Request, who: Caller, srv: ServingDep) -> Any:
    check_model(srv, body.model)
    check_chat(body, srv.settings)
    # Off the event loop: compiling a response_format's or strict tool's schema takes up to a few hundred ms.
    job = await asyncio.to_thread(chat_job, body, who.tenant, srv.settings, srv.vocab_size, srv.tool_family)
    jobs = choices(job, body.n, srv.settings)

    def choice(index: int, result: GenerationResult, meta: Meta) -> ChatChoice:
        parts = read(result, job.tool_use)
        calls = [ResponseToolCall(id=call_id(_choice_id(meta, index), i, job.tool_use, "call_"), function=FunctionCall(
            name=call.name, arguments=call.arguments)) for i, call in enumerate(calls_of(parts))]
        message = ResponseMessage(content=text_of(parts) or (None if calls else ""), tool_calls=calls or None)
        logprobs = None if result.logprobs is None else {
            "content": chat_content(result.logprobs, srv.token_text)}
        return ChatChoice(index=index, message=message, logprobs=logprobs,
                          finish_reason=_finish(result, bool(calls), cut_short(parts)))

    def answer(results: list[GenerationResult], meta: Meta) -> ChatCompletion:
        first = results[0]
        return ChatCompletion(**meta.fields(), usage=_usage_of(results, jobs, srv),
                              choices=[choice(i, result, meta) for i, result in enumerate(results)],
                              diagnostics=CacheDiagnostics.of(first.stats.miss_reason, first.stats.cache_missed_tokens))
    usage_chunk = _usage_chunk(body)
    return await respond_choices(jobs, bool(body.stream), request, srv, "chatcmpl", answer,
                                 lambda streams, meta: _chat_events(streams, meta, usage_chunk, job.tool_use, srv,
                                                                    jobs, job.options.logprobs is not None))


@router.post("/v1/completions", response_model=Completion, responses={**_ERRORS, **SSE_RESPONSE}, tags=["openai"])
async def completions(body: CompletionRequest, request: Request, who: Caller, srv: ServingDep) -> Any:
    check_model(srv, body.model)
    check_completion(body, srv.settings)
    job = completion_job(body, who.tenant, srv.settings, srv.vocab_size)
    jobs = choices(job, body.n, srv.settings)
    echo = job.prompt if job.echo else None

    def answer(results: list[GenerationResult], meta: Meta) -> Completion:
        names = srv.token_text
        return Completion(**meta.fields(), usage=_usage_of(results, jobs, srv), choices=[CompletionChoice(
            index=i, text=(echo or "") + result.text, finish_reason=_finish(result),
            logprobs=None if result.logprobs is None else completion_logprobs(result.logprobs, names, TextOffsets()))
            for i, result in enumerate(results)])
    usage_chunk = _usage_chunk(body)
    return await respond_choices(jobs, bool(body.stream), request, srv, "cmpl", answer,
                                 lambda streams, meta: _completion_events(streams, meta, usage_chunk, echo, srv, jobs,
                                                                          job.options.logprobs is not None))


def _usage_chunk(body: GenerationFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def respond(job: Job, stream: bool, request: Request, srv: Serving, id_prefix: str,
                  answer: Callable[[GenerationResult, Meta], Any],
                  events: Callable[[GenerationStream, Meta], AsyncIterator[str]]) -> Any:
    """Run ``job``: an SSE stream of ``events`` when asked for one, else ``answer`` of its result.

    The one generation path of every API the proxy speaks (OpenAI's and Anthropic's).
    """
    meta = Meta.new(id_prefix, srv)
    job.record_id = meta.id  # cache diagnostics keep the job's fingerprint under its response's id
    if stream:
        handle = await srv.open_stream(job, disconnected(request), place_of(request))
        return sse(tail(events(handle, meta), handle, request.scope["route"].path, srv))
    return answer(await srv.run(job, disconnected(request), place_of(request)), meta)


async def respond_choices(jobs: list[Job], stream: bool, request: Request, srv: Serving, id_prefix: str,
                          answer: Callable[[list[GenerationResult], Meta], Any],
                          events: Callable[[list[GenerationStream], Meta], AsyncIterator[str]]) -> Any:
    """``respond`` for the choices of one request (``jobs``, ``n`` of them): generated side by side, each in a
    place of the key's; one answer (or one stream) holding them all. More choices than the key may have in
    flight is a 400 naming ``n`` (no retry could serve them)."""
    place = place_of(request)
    places = srv.capacity if place is None else min(srv.settings.tenant_places, srv.capacity)
    if len(jobs) > places:
        raise InvalidRequestError(f"n is {len(jobs)}; each choice takes one of this API key's places in flight, and "
                                  f"it has {places}", param="n")
    meta = Meta.new(id_prefix, srv)
    for job in jobs:  # cache diagnostics (choice 0's) keep the job's fingerprint under its response's id
        job.record_id = meta.id
    if stream:
        handles = await srv.open_streams(jobs, disconnected(request), place)
        return sse(tail(events(handles, meta), StreamGroup(handles), request.scope["route"].path, srv))
    return answer(await srv.run_choices(jobs, disconnected(request), place), meta)


# -- cache admin -------------------------------------------------------------------------
@router.post("/v1/cache/prewarm", response_model=PrewarmResponse, responses=_ERRORS, tags=["cache"])
async def prewarm(body: PrewarmRequest, request: Request, who: Caller, srv: ServingDep,
                  tenant: TenantQuery = None) -> PrewarmResponse:
    """Prefill and keep a prefix for the caller's tenant (admin: any tenant via ?tenant=)."""
    check_model(srv, body.model)
    check_prewarm(body, srv.settings)
    target = who.target(tenant)
    prefix: Any = body.prompt if body.prompt is not None else [m.model_dump(exclude_none=True) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    # Pins are a privilege: a tenant's count against its pin quota and expire when idle; the admin's do not.
    warm = await srv.prewarm(target, prefix, tools, body.pin, body.ttl_seconds, privileged=who.admin,
                             disconnected=disconnected(request), cache_salt=body.cache_salt or None,
                             place=place_of(request))
    return PrewarmResponse(tenant=target, prompt_tokens=warm.prompt_tokens,
                           cached_tokens=srv.reported_cached(warm.cached_tokens), stored_tokens=warm.stored_tokens,
                           pinned=warm.pinned)


@router.delete("/v1/cache", response_model=FlushResponse, responses=_ERRORS, tags=["cache"])
async def flush(request: Request, who: Caller, srv: ServingDep, tenant: TenantQuery = None) -> FlushResponse:
    """Drop cached prefixes, on the device and in the tiers below: the caller's tenant; with the admin key
    every tenant (or ?tenant=). 503 tier_unavailable if a tier could not be reached (the rest is flushed)."""
    scope = who.scope(tenant)
    return FlushResponse(tenant=scope, freed_bytes=await srv.flush(scope, place_of(request)))


@router.get("/v1/cache/stats", response_model=CacheStats, responses=_ERRORS, tags=["cache"])
async def cache_stats(request: Request, who: Caller, srv: ServingDep, tenant: TenantQuery = None,
                      audit: Annotated[bool, Query(description="Admin only: also walk the store to count the "
                                                   "bytes of live snapshot tensors and the refcounts held "
                                                   "(time grows with the entries).")] = False) -> CacheStats:
    """Hit rate and memory of the caller's tenant; with the admin key of all tenants (or ?tenant=)."""
    scope = who.scope(tenant)
    if audit and not who.admin:
        raise PermissionDeniedError("audit=true needs the admin key")
    r = await srv.report(scope, place_of(request))
    c = r.counts
    stats = CacheStats(tenant=scope, tenant_quota_bytes=srv.cache.config.tenant_quota_bytes, queries=c.queries,
                       hits=c.hits, partial_hits=c.partial_hits, misses=c.misses, bypassed=c.bypassed,
                       prompt_tokens=c.prompt_tokens, cached_tokens=c.cached_tokens,
                       completion_tokens=c.completion_tokens, hit_rate=c.hit_rate, token_hit_rate=c.token_hit_rate,
                       bytes=r.bytes, budget_bytes=r.budget_bytes, entries=r.entries, pinned_bytes=r.pinned_bytes,
                       evictions=r.evictions, reclaimed_bytes=r.reclaimed_bytes, breakpoints=r.breakpoints)
    if who.admin:  # other tenants' bytes and the shared queue are not a tenant's business
        running, waiting = srv.queue()
        update: dict[str, Any] = {"tenant_bytes": r.tenant_bytes, "engine_faulting": srv.cache.engine_faulting,
                                  "queue": QueueInfo(running=running, waiting=waiting, capacity=srv.capacity)}
        if r.server is not None:  # all tenants: the server's figures
            sf = r.server
            update.update(batching_enabled=sf.batching_enabled, batching_disabled_reason=sf.batching_disabled_reason,
                          kv_bytes=sf.kv_bytes, kv_total_bytes=sf.kv_total_bytes,
                          tiers=None if sf.tiers is None else {k: TierInfo(**v) for k, v in sf.tiers.items()})
        stats = stats.model_copy(update=update)
    if audit:
        counted = await srv.side(srv.cache.audit)
        stats = stats.model_copy(update={"live_tensor_bytes": counted["live_tensor_bytes"],
                                         "refcounts": counted["refcounts"]})
    return stats


@router.get("/metrics", response_class=Response, responses={**_ERRORS, 200: {"content": {CONTENT_TYPE: {}}}},
            tags=["metrics"])
async def metrics(request: Request) -> Response:
    """Prometheus text format. Needs the admin key unless ``metrics_public`` is set."""
    state = request.app.state
    if not state.settings.metrics_public:
        state.keyring.require_admin(state.keyring.authenticate(request.headers.get("authorization")))
    return Response(await asyncio.to_thread(state.metrics.render), media_type=CONTENT_TYPE)


# -- response shaping --------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Meta:
    id: str
    created: int
    model: str
    fingerprint: str

    @classmethod
    def new(cls, prefix: str, srv: Serving) -> Meta:
        """``prefix`` ends the id's prefix with "_" (the Responses API's ``resp_``), else "-" is put after it."""
        sep = "" if prefix.endswith("_") else "-"
        return cls(f"{prefix}{sep}{uuid.uuid4().hex}", int(time.time()), srv.model_name, srv.system_fingerprint)

    def fields(self) -> dict[str, Any]:
        """The fields every answer and chunk carries."""
        return {"id": self.id, "created": self.created, "model": self.model, "system_fingerprint": self.fingerprint}

    def chunk(self, kind: str, choices: list[dict[str, Any]], usage: UsageInfo | None, with_usage: bool,
              **extra: Any) -> str:
        body: dict[str, Any] = {**self.fields(), "object": kind, "choices": choices, **extra}
        if with_usage or usage is not None:
            body["usage"] = None if usage is None else usage.model_dump()
        return event(body)


def _usage(result: GenerationResult, srv: Serving) -> UsageInfo:
    u = result.usage
    written = 0 if result.cache is None else result.cache.cache_creation_input_tokens
    return UsageInfo(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, total_tokens=u.total_tokens,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=srv.reported_cached(u.cached_tokens), cache_write_tokens=written,
                         chunk_reused_tokens=result.stats.chunk_reused_tokens,
                         chunk_recomputed_tokens=result.stats.chunk_recomputed_tokens))


def _usage_of(results: list[GenerationResult], jobs: list[Job], srv: Serving) -> UsageInfo:
    """The usage of a request's choices, as OpenAI counts it: the prompt once, the completions' tokens summed.
    Its cache figures are the prompt's one prefill's (what the cache supplied to it and what it stored); the
    choices then read the prompt from the cache (counted in the cache's stats). Where the prompt was not
    prefilled ahead (breakpoints, chunks, a failed prefill): the least any choice read, the most it wrote."""
    usage = _usage(results[0], srv)
    if len(results) == 1:
        return usage
    shared = jobs[0].shared
    assert shared is not None
    if shared.read is not None:
        read, written = shared.read, shared.written
    else:
        read = min(r.usage.cached_tokens for r in results)
        written = max(0 if r.cache is None else r.cache.cache_creation_input_tokens for r in results)
    completion = sum(r.usage.completion_tokens for r in results)
    details = usage.prompt_tokens_details.model_copy(update={
        "cached_tokens": srv.reported_cached(read), "cache_write_tokens": written})
    return usage.model_copy(update={"completion_tokens": completion, "total_tokens": usage.prompt_tokens + completion,
                                    "prompt_tokens_details": details})


def _choice_id(meta: Meta, index: int) -> str:
    """What a choice's tool-call ids derive from: the response's id (choice 0, as with one choice), else the id
    and the choice's index, so no two choices' calls share an id."""
    return meta.id if index == 0 else f"{meta.id}/{index}"


def _finish(result: GenerationResult, calls: bool = False, cut: bool = False) -> str:
    """OpenAI's ``finish_reason``: "tool_calls" where the answer holds ``calls``, unless its last was ``cut`` by
    ``max_tokens`` ("length", as OpenAI reports a call cut short)."""
    if calls and not cut:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


async def _chat_events(streams: list[GenerationStream], meta: Meta, usage_chunk: bool, tools: ToolUse | None,
                       srv: Serving, jobs: list[Job], asked: bool = False) -> AsyncIterator[str]:
    """OpenAI's chunk sequence: role, content and tool-call deltas, finish_reason, [usage], [DONE].

    ``asked``: the request asked for logprobs; each content delta carries its tokens' (those of tokens whose
    text was sent before, or that have none, come in a last content chunk of no text).

    A call comes as OpenAI streams one: its id, type and name with empty arguments, then the
    arguments. Without ``include_usage`` the usage rides on the finish chunk (with ``n``, the last
    choice's to finish), so every response reports ``cached_tokens``; with it, a last chunk with
    empty choices carries it. Choices stream side by side, each chunk one choice's, by its index.
    """
    names = srv.token_text if asked else None

    async def one(index: int, stream: GenerationStream) -> AsyncIterator[dict[str, Any]]:
        def choice(delta: dict[str, Any], finish: str | None = None, entries: list | None = None) -> dict[str, Any]:
            logprobs = None if names is None or entries is None else {"content": chat_content(entries, names)}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

        calls, cut, ids = 0, False, _choice_id(meta, index)
        yield choice({"role": "assistant", "content": ""})
        async for piece in pieces(stream, tools):
            if isinstance(piece, Text):
                yield choice({"content": piece.text}, entries=stream.take_logprobs())
                continue
            assert tools is not None  # calls are parsed only where tools were declared
            call = {"index": calls, "id": call_id(ids, calls, tools, "call_"), "type": "function",
                    "function": {"name": piece.name, "arguments": ""}}
            yield choice({"tool_calls": [call]})
            yield choice({"tool_calls": [{"index": calls, "function": {"arguments": piece.arguments}}]})
            calls, cut = calls + 1, not piece.complete
        if rest := stream.take_logprobs():  # tokens whose text came earlier, or had none
            yield choice({"content": ""}, entries=rest)
        assert stream.result is not None  # set once its texts ended
        yield choice({}, _finish(stream.result, bool(calls), cut))

    kind = "chat.completion.chunk"
    miss = streams[0].miss  # cache diagnostics ride on the first chunk, known before generation
    diagnosed = {} if miss is None else {"diagnostics": CacheDiagnostics.of(
        miss.type, miss.cache_missed_input_tokens).model_dump(exclude_none=True)}
    async for chunk in _choice_chunks(streams, meta, kind, usage_chunk, srv, jobs,
                                      merged([one(i, s) for i, s in enumerate(streams)]), diagnosed):
        yield chunk


async def _choice_chunks(streams: list[GenerationStream], meta: Meta, kind: str, usage_chunk: bool, srv: Serving,
                         jobs: list[Job], entries: AsyncIterator[dict[str, Any]],
                         first: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """Each choice entry as a chunk of its own (``first``: more fields of the first chunk), the usage on the last
    finish chunk (or, with ``include_usage``, a chunk of its own after it), then [DONE]."""
    finished = 0
    async for entry in entries:
        finished += entry["finish_reason"] is not None
        last = entry["finish_reason"] is not None and finished == len(streams)
        usage = _usage_of(_results(streams), jobs, srv) if last and not usage_chunk else None
        yield meta.chunk(kind, [entry], usage, usage_chunk, **(first or {}))
        first = None
    if usage_chunk:
        yield meta.chunk(kind, [], _usage_of(_results(streams), jobs, srv), True)
    yield "data: [DONE]\n\n"


def _results(streams: list[GenerationStream]) -> list[GenerationResult]:
    results = [stream.result for stream in streams]
    assert all(result is not None for result in results)  # every choice has finished
    return results  # type: ignore[return-value]


async def _completion_events(streams: list[GenerationStream], meta: Meta, usage_chunk: bool, echo: str | None,
                             srv: Serving, jobs: list[Job], asked: bool = False) -> AsyncIterator[str]:
    """``asked``: the request asked for logprobs; each text delta carries its tokens' (as ``_chat_events``), their
    offsets counted over its choice's whole answer."""
    names = srv.token_text if asked else None

    async def one(index: int, stream: GenerationStream) -> AsyncIterator[dict[str, Any]]:
        offsets = TextOffsets()

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            logprobs = None
            if names is not None and finish is None:
                logprobs = completion_logprobs(stream.take_logprobs(), names, offsets)
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        if echo:
            yield choice(echo)
        async for text in stream.texts():
            yield choice(text)
        if names is not None and (rest := choice(""))["logprobs"]["tokens"]:
            yield rest
        assert stream.result is not None  # set once its texts ended
        yield choice("", _finish(stream.result))

    async for chunk in _choice_chunks(streams, meta, "text_completion", usage_chunk, srv, jobs,
                                      merged([one(i, s) for i, s in enumerate(streams)])):
        yield chunk
