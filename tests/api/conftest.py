"""Fixtures for the proxy tests: a tiny random Llama with the real SmolLM2 tokenizer, live servers.

The tokenizer is the default model's (its chat template included), so requests are
encoded exactly as in production; the model is a 2-layer random Llama, so generation
takes milliseconds. Servers are real uvicorn servers on 127.0.0.1, driven by the
official ``openai`` client and httpx.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefixcache_api import create_app
from proxy_support import ALPHA, LiveServer, anthropic_client, live, make_cache, settings

from prefixcache import PrefixCache


@pytest.fixture(scope="session")
def tiny_model(chat_llama):
    """The top-level conftest's tiny random Llama over the real SmolLM2 vocabulary."""
    return chat_llama


@pytest.fixture
def new_proxy_cache():
    """``new_proxy_cache(model, tokenizer, **config)``: ``make_cache``'s cache, closed after the test (an app
    never closes a cache it was given)."""
    caches: list[PrefixCache] = []

    def make(model, tokenizer, **config) -> PrefixCache:
        caches.append(make_cache(model, tokenizer, **config))
        return caches[-1]

    yield make
    for cache in caches:
        cache.close()


@pytest.fixture(scope="session")
def server(tiny_model, tokenizer) -> Iterator[LiveServer]:
    """The shared multi-tenant server (keys alpha, beta, admin)."""
    cache = make_cache(tiny_model, tokenizer)
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


@pytest.fixture(scope="module")
def srv(tiny_model, tokenizer) -> Iterator[LiveServer]:
    """A server for breakpoint tests, one per module: breakpoints of 16 tokens and more, blocks of 8 (the
    tiny model's context is small, so a TTL boundary falls close to its breakpoint)."""
    cache = make_cache(tiny_model, tokenizer, breakpoint_min_tokens=16, block_size=8)
    with live(create_app(settings(), cache=cache)) as server:
        yield server
    cache.close()


@pytest.fixture
def alpha(srv):
    """``srv`` flushed, and the ``anthropic`` client of key alpha on it."""
    srv.cache.flush()
    return anthropic_client(srv.url, ALPHA)
