"""Errors at the HTTP edge: every failure becomes OpenAI's error object, mapped in one place.

``{"error": {"message", "type", "param", "code"}}``. Validation is a 400 (FastAPI would
say 422); anything a client can send maps to a 4xx, 429, 503 or 504; only a bug is a 500.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from prefixcache.errors import (
    CacheClosedError,
    CapacityError,
    ConfigError,
    ContextLengthExceededError,
    EngineFaultError,
    GenerationTimeoutError,
    InvalidRequestError,
    OutputFormatError,
    PinQuotaExceededError,
    RequestCancelledError,
    TierPurgeError,
    ToolArgumentsError,
    ToolCallError,
    UnsupportedModelError,
)

from .anthropic.errors import anthropic_error, is_anthropic
from .protocol import MESSAGE_ROLES, ErrorDetail, ErrorResponse

log = logging.getLogger(__name__)


class ProxyError(Exception):
    """An error the proxy itself raises; subclasses fix status, type and code."""

    status = 500
    type = "server_error"
    code: str | None = None
    retry: bool = False  # send Retry-After
    retry_after: int | None = None  # its seconds when known (else the configured retry_after_seconds)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class AuthenticationError(ProxyError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"


class PermissionDeniedError(ProxyError):
    status, type, code = 403, "permission_error", "permission_denied"


class NotFoundError(ProxyError):
    status, type, code = 404, "invalid_request_error", "not_found"


class LimitExceededError(ProxyError):
    """An input over one of the configured limits (``code`` says which kind, as OpenAI's do)."""

    status, type, code = 400, "invalid_request_error", "limit_exceeded"


class PayloadTooLargeError(ProxyError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class BodyTimeoutError(ProxyError):
    """The request's body did not arrive within ``body_timeout_seconds`` (its place is given back)."""

    status, type, code = 408, "invalid_request_error", "request_body_timeout"


class QueueFullError(ProxyError):
    status, type, code, retry = 429, "rate_limit_error", "queue_full", True


class TenantBusyError(ProxyError):
    """The caller's key has as many requests in flight as one key may (``tenant_max_in_flight``)."""

    status, type, code, retry = 429, "rate_limit_error", "tenant_busy", True


class RateLimitedError(ProxyError):
    """The caller's key is over its request rate (``tenant_rate_limit``); Retry-After says when it is not."""

    status, type, code, retry = 429, "rate_limit_error", "rate_limit_exceeded", True

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class InvalidBudgetError(RateLimitedError):
    """The caller's key caused more refused requests than its budget (``tenant_invalid_rate``)."""

    code = "too_many_invalid_requests"


class UnavailableError(ProxyError):
    status, type, code, retry = 503, "server_error", "unavailable", True


class RequestTimeoutError(ProxyError):
    status, type, code = 504, "timeout_error", "request_timeout"


class ClientClosedError(ProxyError):
    """The client went away; nobody reads this response (nginx's 499)."""

    status, type, code = 499, "invalid_request_error", "client_closed_request"


@dataclass(frozen=True, slots=True)
class Mapped:
    status: int
    detail: ErrorDetail
    retry: bool = False
    retry_after: int | None = None  # None: the configured default


def map_exception(exc: BaseException) -> Mapped:
    """The one table from exception to HTTP status and OpenAI error object."""
    if isinstance(exc, ProxyError):
        return Mapped(exc.status, ErrorDetail(message=str(exc), type=exc.type, param=exc.param, code=exc.code),
                      exc.retry, exc.retry_after)
    if isinstance(exc, ContextLengthExceededError):
        return Mapped(400, ErrorDetail(message=str(exc), type="invalid_request_error", param=exc.param,
                                       code="context_length_exceeded"))
    if isinstance(exc, InvalidRequestError):
        return Mapped(400, ErrorDetail(message=str(exc), type="invalid_request_error", param=exc.param,
                                       code="invalid_value"))
    if isinstance(exc, ConfigError):
        return Mapped(400, ErrorDetail(message=str(exc), type="invalid_request_error", param=exc.field,
                                       code="invalid_value"))
    if isinstance(exc, PinQuotaExceededError):  # the tenant's own limit: retrying will not help until it unpins
        return Mapped(429, ErrorDetail(message=str(exc), type="insufficient_quota", code="pin_quota_exceeded"))
    if isinstance(exc, CapacityError):  # memory pressure: a pin that does not fit now
        return Mapped(503, ErrorDetail(message=str(exc), type="server_error", code="insufficient_capacity"), True)
    if isinstance(exc, TierPurgeError):  # the device is flushed; a tier below could not be reached
        return Mapped(503, ErrorDetail(message=str(exc), type="server_error", code="tier_unavailable"), True)
    if isinstance(exc, EngineFaultError):  # not the request's doing: a retry may well succeed
        return Mapped(503, ErrorDetail(message=str(exc), type="server_error", code="engine_fault"), True)
    if isinstance(exc, ToolCallError):  # the request was fine; the model's answer broke its tool_choice
        return Mapped(422, ErrorDetail(message=str(exc), type="invalid_request_error", param="tool_choice",
                                       code="tool_call_missing"))
    if isinstance(exc, OutputFormatError):  # a structured answer that breaks its schema: a generation failure
        return Mapped(500, ErrorDetail(message=str(exc), type="server_error", code="response_format_invalid"))
    if isinstance(exc, ToolArgumentsError):  # the model broke a strict tool's schema: a generation failure
        return Mapped(500, ErrorDetail(message=str(exc), type="server_error", code="tool_arguments_invalid"))
    if isinstance(exc, GenerationTimeoutError):
        return Mapped(504, ErrorDetail(message=str(exc), type="timeout_error", code="request_timeout"))
    if isinstance(exc, RequestCancelledError):  # the client left (or the server shuts down): nobody reads this
        return Mapped(499, ErrorDetail(message=str(exc), type="invalid_request_error", code="client_closed_request"))
    if isinstance(exc, RecursionError):  # input nested deeper than the stack got past the depth checks: its fault
        return Mapped(400, ErrorDetail(message="the request nests too deeply", type="invalid_request_error",
                                       code="json_too_deep"))
    if isinstance(exc, CacheClosedError):  # the server is shutting down: another replica (or a retry) serves it
        return Mapped(503, ErrorDetail(message=str(exc), type="server_error", code="shutting_down"), True)
    if isinstance(exc, UnsupportedModelError):
        return Mapped(501, ErrorDetail(message=f"prefix caching is not available for this model: {exc}",
                                       type="invalid_request_error", code="not_supported"))
    return Mapped(500, ErrorDetail(message="internal server error", type="server_error", code="internal_error"))


def status_of(exc: BaseException) -> int:
    """The HTTP status ``exc`` is answered with (the handlers ``install`` registers included)."""
    if isinstance(exc, RequestValidationError):
        return 400
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code
    return map_exception(exc).status


def error_response(mapped: Mapped, retry_after: int, path: str = "") -> JSONResponse:
    """The error as OpenAI shapes it, or as Anthropic does on its routes (``path``)."""
    headers = {"Retry-After": str(mapped.retry_after or retry_after)} if mapped.retry else None
    if is_anthropic(path):
        status, body = anthropic_error(mapped.status, mapped.detail.message)
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(ErrorResponse(error=mapped.detail).model_dump(), status_code=mapped.status, headers=headers)


def validation_detail(exc: RequestValidationError) -> ErrorDetail:
    """The validation errors as one clear message, with ``param`` set to the field's path.

    Several errors under one path are one union that matched no form (``content`` is
    neither a string nor a list of parts); they are reported once, at that path.
    """
    errors = exc.errors() or [{"type": "value_error", "loc": (), "msg": "invalid request"}]
    first = errors[0]
    if first.get("type") == "json_invalid":
        at = next((f" at character {p} of the body" for p in first.get("loc", ())[1:] if isinstance(p, int)), "")
        return ErrorDetail(message="We could not parse the JSON body of your request: "
                           f"{first.get('ctx', {}).get('error', 'invalid JSON')}{at}", type="invalid_request_error",
                           code="invalid_json")
    if len(errors) > 1:  # a union: the forms whose shape did not fit say less than one that fit but failed deeper
        deeper = [e for e in errors if e.get("type") not in _SHAPE_ERRORS]
        if deeper and len(deeper) < len(errors):
            errors, first = deeper, deeper[0]
    shared = _common_prefix([tuple(e.get("loc", ())) for e in errors])
    union = len(errors) > 1 and len(shared) > 1
    param = _param(shared if union else tuple(first.get("loc", ())), first.get("type"))
    if first.get("type") == "extra_forbidden":
        return ErrorDetail(message=f"Unrecognized request argument supplied: {param}", type="invalid_request_error",
                           param=param, code="unrecognized_argument")
    if param is None and first.get("type") in ("missing", "model_attributes_type"):
        hint = " with Content-Type: application/json" if isinstance(first.get("input"), bytes) else ""
        message = f"the request body must be a JSON object{hint}"
    elif union:
        message = f"{param}: {first.get('msg', 'invalid value')} (no accepted form of {param} matched)"
    else:
        message = f"{param + ': ' if param else ''}{first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return ErrorDetail(message=message, type="invalid_request_error", param=param, code="invalid_value")


#: Pydantic's errors of a value of the wrong kind altogether (a union form that does not apply to it).
_SHAPE_ERRORS = frozenset({"string_type", "list_type", "dict_type", "model_type", "model_attributes_type",
                           "is_instance_of", "union_tag_invalid", "union_tag_not_found"})


def _common_prefix(locs: list[tuple]) -> tuple:
    out: list = []
    for parts in zip(*locs, strict=False):  # as long as the shortest
        if any(p != parts[0] for p in parts):
            break
        out.append(parts[0])
    return tuple(out)


def _param(loc: tuple, kind: str | None) -> str | None:
    """``('body', 'messages', 0, 'user', 'content')`` -> ``messages[0].content`` (the SDK's spelling).

    Pydantic puts union members in the path (a message's role tag, ``str``,
    ``list[...]``, ``function-after[...]``); those are not fields and are dropped.
    """
    out = ""
    parts = [p for p in loc if p != "body"]
    for i, part in enumerate(parts):
        if isinstance(part, int):
            out += f"[{part}]"
        elif (i > 0 and isinstance(parts[i - 1], int) and (part in MESSAGE_ROLES or (
                part in _BLOCK_TAGS and i + 1 < len(parts)))) or not str(part).isidentifier() or part in _TYPE_LABELS:
            continue  # a role or block-type tag after an index (a field of that name would end the path)
        else:
            out += f".{part}" if out else str(part)
    if kind == "union_tag_invalid":
        out += ".role"
    return out or None


_TYPE_LABELS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
#: Content blocks' ``type`` tags, which pydantic puts in the path of a discriminated block.
_BLOCK_TAGS = frozenset({"text", "image", "image_url", "input_audio", "file", "document", "tool_use", "tool_result",
                         "thinking", "redacted_thinking", "refusal"})


def route_hint(request: Request) -> str:
    """For a path that is a route once ``/v1`` is added or taken off, the route and the client setting
    that likely caused it: the ``openai`` client's base URL ends in ``/v1``, the ``anthropic`` client's does not.
    For the schema's pages (a 404 only while they are off), the flag that serves them."""
    path = request.url.path
    if path in ("/docs", "/redoc", "/openapi.json"):
        return ": the schema and its pages are served only with --docs (PREFIXCACHE_DOCS=true)"
    for near in ("/v1" + path, path.removeprefix("/v1")):
        scope = {**request.scope, "path": near, "raw_path": near.encode()}
        if near != path and any(route.matches(scope)[0] is not Match.NONE for route in request.app.router.routes):
            return (f": no route {path}; did you mean {near}? The openai client's base_url ends in /v1 "
                    "(http://HOST:PORT/v1); the anthropic client's does not (http://HOST:PORT).")
    return ""


def install(app: FastAPI, retry_after: int, on_error: Callable[[Request, int], None]) -> None:
    """Register the handlers; ``on_error(request, status)`` is told of every error response."""

    def respond(request: Request, mapped: Mapped) -> JSONResponse:
        on_error(request, mapped.status)
        return error_response(mapped, retry_after, request.url.path)

    async def validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, Mapped(400, validation_detail(exc)))

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = {404: "not_found", 405: "method_not_allowed"}.get(status)
        message = str(exc.detail) + (route_hint(request) if status == 404 else "")
        response = respond(request, Mapped(status, ErrorDetail(message=message, type=kind, code=code)))
        for name, value in (exc.headers or {}).items():
            response.headers[name] = value
        return response

    async def known(request: Request, exc: Exception) -> JSONResponse:
        return respond(request, map_exception(exc))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return respond(request, map_exception(exc))

    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for kind in (ProxyError, InvalidRequestError, ConfigError, CapacityError, UnsupportedModelError, EngineFaultError,
                 GenerationTimeoutError, RequestCancelledError, TierPurgeError, ToolCallError, ToolArgumentsError,
                 CacheClosedError, RecursionError):
        app.add_exception_handler(kind, known)
    app.add_exception_handler(Exception, unexpected)
