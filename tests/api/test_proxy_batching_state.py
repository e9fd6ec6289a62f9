"""The batching engine's state is never silent: a gauge, /readyz details, admin stats, and a
setting that makes start-up fail instead of serving everything one at a time."""
from __future__ import annotations

import asyncio
import copy

import pytest
from prefixcache_api import create_app
from proxy_support import ADMIN, live, settings

from prefixcache import CacheConfig, ConfigError, PrefixCache


def _gauge(server) -> str:
    with server.client(ADMIN) as admin:
        return next(line for line in admin.get("/metrics").text.splitlines()
                    if line.startswith("prefixcache_batching_enabled "))


def test_enabled_batching_is_reported(server):
    with server.client() as anyone:
        ready = anyone.get("/readyz").json()
    assert ready["status"] == "ready" and ready["batching"] is True and ready["detail"] is None
    assert _gauge(server) == "prefixcache_batching_enabled 1.0"
    with server.client(ADMIN) as admin:
        stats = admin.get("/v1/cache/stats").json()
    assert stats["batching_enabled"] is True and stats["batching_disabled_reason"] is None


def test_disabled_batching_is_reported_with_its_reason(chat_llama, tokenizer):
    eager = copy.deepcopy(chat_llama)
    eager.set_attn_implementation("eager")  # cascade attention needs SDPA: batching turns off
    cache = PrefixCache(eager, tokenizer, CacheConfig(max_bytes=64 << 20))
    try:
        assert "eager" in cache.batching_disabled_reason
        with live(create_app(settings(), cache=cache)) as srv:
            with srv.client() as anyone:
                ready = anyone.get("/readyz").json()
            assert ready["batching"] is False and ready["detail"] == "serving one request at a time"  # no reason
            assert _gauge(srv) == "prefixcache_batching_enabled 0.0"
            with srv.client(ADMIN) as admin:
                stats = admin.get("/v1/cache/stats").json()
            assert stats["batching_enabled"] is False and "eager" in stats["batching_disabled_reason"]
    finally:
        cache.close()


def test_require_batching_fails_start_up(chat_llama, tokenizer):
    eager = copy.deepcopy(chat_llama)
    eager.set_attn_implementation("eager")
    cache = PrefixCache(eager, tokenizer, CacheConfig(max_bytes=64 << 20))
    try:
        app = create_app(settings(require_batching=True), cache=cache)

        async def start() -> None:
            async with app.router.lifespan_context(app):
                pass
        with pytest.raises(ConfigError, match="require_batching"):
            asyncio.run(start())
        ok = create_app(settings(require_batching=False), cache=cache)

        async def start_ok() -> bool:
            async with ok.router.lifespan_context(ok):
                return ok.state.serving is not None
        assert asyncio.run(start_ok())  # without the setting the same model is served (serially)
    finally:
        cache.close()
