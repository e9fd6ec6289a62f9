"""Helpers shared by the proxy tests (imported by name: tests/api is on sys.path)."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from prefixcache_api import Settings

from prefixcache import CacheConfig, PrefixCache

MODEL = "tiny-llama"
KEYS = {"sk-alpha": "alpha", "sk-beta": "beta"}
ALPHA, BETA, ADMIN = "sk-alpha", "sk-beta", "sk-admin"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def anthropic_client(url: str, key: str, **kwargs):
    """The official ``anthropic`` client on ``url`` with ``key``: no retries, a 60 s timeout."""
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60, **kwargs)


def settings(**overrides) -> Settings:
    """Multi-tenant test settings: greedy by default, short answers."""
    base = dict(api_keys=KEYS, admin_key=ADMIN, served_model_name=MODEL, default_max_tokens=8,
                max_tokens_limit=2000, default_temperature=0.0, workers=2, max_queue=64,
                request_timeout_seconds=60.0)
    return Settings(**{**base, **overrides})


def make_cache(model, tokenizer, **config) -> PrefixCache:
    return PrefixCache(model, tokenizer, CacheConfig(**{"max_bytes": 256 << 20, **config}))


class LiveServer:
    """A uvicorn server on a free 127.0.0.1 port, in a background thread."""

    def __init__(self, app):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="prefixcache-test-server", daemon=True)

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def serving(self):
        return self.app.state.serving

    @property
    def cache(self) -> PrefixCache:
        return self.app.state.serving.cache

    def client(self, key: str | None = None, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=auth(key) if key else {}, timeout=60, **kwargs)

    def openai(self, key: str, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60, **kwargs)


@contextmanager
def live(app) -> Iterator[LiveServer]:
    server = LiveServer(app).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def held_stream(server: LiveServer, key: str, path: str, body: dict) -> Iterator[None]:
    """``body`` streamed from ``path`` with ``key`` in a thread, its place held, while the block runs (its first
    event arrived); leaving the block leaves the stream, which cancels the generation."""
    started, stop = threading.Event(), threading.Event()

    def hold() -> None:
        with server.client(key) as client, client.stream("POST", path, json=body) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    break

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert started.wait(30)
        yield
    finally:
        stop.set()
        holder.join(30)


def metric_samples(server) -> dict[tuple[str, tuple], float]:
    """Every sample on the server's ``/metrics`` (read with the admin key): ``(name, sorted labels) -> value``."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client(ADMIN) as admin:
        text = admin.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def counter_sum(server, name: str) -> float:
    """The sum of a series' samples over all its labels."""
    return sum(value for (sample, _), value in metric_samples(server).items() if sample == name)


def leased_refs(cache: PrefixCache) -> int:
    """Refcounts held on cached blocks (pins of running requests); 0 when nothing runs."""
    with cache.store._lock:  # test-only peek at the store's invariant state
        return sum(node.refcount for node in cache.store.trie.iter_nodes())


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.01) -> float:
    """Poll ``predicate`` until true; return the seconds it took. Fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start
