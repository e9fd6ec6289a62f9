"""The ASGI app: ``create_app(settings)`` wires settings, tenancy, metrics, serving and routes.

The engine belongs to the app: the lifespan loads the model (or takes the
``PrefixCache`` it was given), and on shutdown cancels running generations and stops
the workers. Nothing is a module global, so two apps live side by side in one process.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from prefixcache import ConfigError, PrefixCache, __version__, load_default_model, load_model
from prefixcache.planner.request_log import RequestLog

from . import errors
from .anthropic.routes import router as anthropic_router
from .auth import KeyRing
from .fairness import InvalidBudget, RateLimiter
from .metrics import Metrics
from .replica import replica
from .responses.routes import router as responses_router
from .responses.store import ResponseStore
from .routes import router
from .serving import Serving
from .settings import Settings

log = logging.getLogger(__name__)
DESCRIPTION = ("OpenAI-compatible proxy with prompt-prefix KV caching. Every answer reports "
               "`usage.prompt_tokens_details.cached_tokens`. The cache namespace is the API key's tenant.")


def build_cache(settings: Settings) -> PrefixCache:
    """Load the configured model (or the embedded default) and wrap it. Raises ``ModelLoadError``/``ConfigError``."""
    config = settings.cache_config()  # validate before a slow load
    if settings.torch_threads is not None:
        torch.set_num_threads(settings.torch_threads)
    if settings.model:
        model, tokenizer = load_model(settings.model, dtype=settings.dtype, device=settings.device)
    else:
        model, tokenizer = load_default_model(dtype=settings.dtype, device=settings.device)
    return PrefixCache(model, tokenizer, config, batching=settings.batch_overrides())


def open_request_log(settings: Settings, cache: PrefixCache) -> RequestLog | None:
    """The request log the settings ask for (None: off)."""
    if settings.request_log is None:
        return None
    key = settings.request_log_key
    return RequestLog(settings.request_log, block_tokens=cache.config.block_size,
                      kv_bytes_per_token=cache.bytes_per_token, max_bytes=settings.request_log_max_bytes,
                      backups=settings.request_log_backups,
                      secret=None if key is None else key.get_secret_value().encode("utf-8"))


def create_app(settings: Settings | None = None, *, cache: PrefixCache | None = None,
               clock: Callable[[], float] = time.monotonic) -> FastAPI:
    """Build the proxy. Given ``cache``, serve it (the caller closes it); else load the model at startup.
    ``clock`` times the tenants' request rates."""
    settings = settings if settings is not None else Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = cache if cache is not None else await asyncio.to_thread(build_cache, settings)
        if settings.require_batching and engine.batching_disabled_reason is not None:
            if cache is None:
                engine.close()
            raise ConfigError("require_batching", True, f"a model the batching engine serves; it does not: "
                              f"{engine.batching_disabled_reason}")
        request_log = open_request_log(settings, engine)
        srv = Serving(engine, settings, metrics, request_log=request_log)
        metrics.bind(srv.engine_state)
        app.state.serving = srv
        try:
            yield
        finally:
            await srv.aclose()
            if request_log is not None:
                await asyncio.to_thread(request_log.close)
            await asyncio.to_thread(engine.persist)  # before the server exits (it may re-raise a signal)
            if cache is None:
                engine.close()

    # The schema and its pages list every route and parameter to whoever asks: off unless ``docs`` is set.
    docs = settings.docs
    app = FastAPI(title="prefixcache proxy", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  openapi_url="/openapi.json" if docs else None, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None)
    app.state.settings = settings
    app.state.keyring = KeyRing(settings)
    app.state.rate_limiter = RateLimiter(settings.tenant_rate_limit, settings.tenant_rate_burst, clock)
    app.state.invalid_budget = InvalidBudget(settings.tenant_invalid_rate, settings.tenant_invalid_burst,
                                             settings.tenant_invalid_hold_seconds, clock)
    app.state.metrics = metrics
    app.state.responses = ResponseStore(clock)  # stored responses, for previous_response_id
    app.state.serving = None
    errors.install(app, settings.retry_after_seconds, lambda request, status: metrics.error(_route(request), status))
    app.include_router(router)
    app.include_router(responses_router)
    app.include_router(replica)
    app.include_router(anthropic_router)
    app.add_middleware(InternalErrors, on_error=lambda scope, status: metrics.error(_route(scope), status))
    return app


def _route(request_or_scope: Request | Scope) -> str:
    """The matched route's template (bounded label values), never the raw path."""
    scope = request_or_scope.scope if isinstance(request_or_scope, Request) else request_or_scope
    return getattr(scope.get("route"), "path", None) or "unmatched"


class InternalErrors:
    """A bug becomes a logged 500 in OpenAI's shape, and the connection stays usable.

    (Starlette's own last-resort handler answers too, but then re-raises, and the
    server drops the keep-alive connection the client will reuse.)
    """

    def __init__(self, app: ASGIApp, on_error: Callable[[Scope, int], None]):
        self.app, self.on_error = app, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if scope["type"] != "http" or started:
                raise  # too late for an error response
            mapped = errors.map_exception(exc)  # counted as answered: a known error that escaped its handler is no 500
            if mapped.status >= 500:
                log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            self.on_error(scope, mapped.status)
            await errors.error_response(mapped, 0, scope.get("path", ""))(scope, receive, send)

