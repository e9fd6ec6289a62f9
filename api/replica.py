"""Routes a replica answers for a router in front of it (SGLang's names).

``sglang-router`` registers a worker by polling ``GET /health`` (and health-checks it
there later), then reads ``/server_info`` or ``/get_server_info`` (and ``/model_info``)
for the served model's name. None of them needs a key: the router calls them without
one, and they tell no more than the model's name.
"""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from prefixcache import __version__

from .errors import UnavailableError
from .protocol import ErrorResponse, Health
from .routes import GuardedRoute, serving

replica = APIRouter(route_class=GuardedRoute)
_UNAVAILABLE: dict[int | str, dict[str, Any]] = {503: {"model": ErrorResponse, "description": "Not serving"}}


class ServerInfo(BaseModel):
    """The fields of SGLang's server info a router reads (``model_path`` names the model)."""

    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool = True
    version: str = __version__


@replica.get("/health", response_model=Health, response_model_exclude_none=True, responses=_UNAVAILABLE,
             tags=["health"])
async def health(request: Request) -> Health:
    """A router's health check: 200 while the model is loaded, its batching loop runs and the server is
    not shutting down; else 503, so the router stops sending requests here. A full queue stays
    healthy (it answers 429 with Retry-After, a moment's state, not a failed replica)."""
    srv = serving(request)
    srv.check_engine()
    if srv.closing:
        raise UnavailableError("shutting down", code="not_ready")
    return Health(status="ok")


@replica.get("/server_info", response_model=ServerInfo, responses=_UNAVAILABLE, tags=["health"],
             operation_id="server_info")
@replica.get("/get_server_info", response_model=ServerInfo, responses=_UNAVAILABLE, tags=["health"],
             operation_id="get_server_info")
@replica.get("/model_info", response_model=ServerInfo, responses=_UNAVAILABLE, tags=["health"],
             operation_id="model_info")
async def server_info(request: Request) -> ServerInfo:
    """The served model's name, as a router reads it (``model_path``); three names, one answer."""
    srv = serving(request)
    return ServerInfo(model_path=srv.model_name, served_model_name=srv.model_name, tokenizer_path=srv.model_name)
