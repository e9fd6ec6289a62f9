"""prefixcache's OpenAI-compatible proxy (installed as ``prefixcache_api``).

Modules follow the request: settings -> protocol -> errors -> auth -> metrics ->
sampling -> serving -> routes -> app. ``create_app(settings)`` builds the ASGI app.
"""
from .app import build_cache, create_app
from .settings import Settings

__all__ = ["Settings", "build_cache", "create_app"]
