"""prefixcache's OpenAI-compatible proxy (installed as ``prefixcache_api``).

Modules follow the request: settings -> protocol -> errors -> auth -> metrics ->
jobs -> serving -> routes -> app. ``create_app(settings)`` builds the ASGI app.

The names below are imported on first use, so reading ``settings`` alone (the ``prefixcache``
command builds its ``serve`` flags from it for every subcommand) does not load the app and the model code.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import build_cache, create_app
    from .settings import Settings

_HOMES = {"Settings": ".settings", "build_cache": ".app", "create_app": ".app"}

__all__ = ["Settings", "build_cache", "create_app"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value
