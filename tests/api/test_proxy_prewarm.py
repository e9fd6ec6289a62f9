"""A prewarm over HTTP is cancelled like a generation: past the request timeout it is a 504 and
its prefill stops; a client that leaves stops it too; nothing partial is stored, nothing stays leased."""
from __future__ import annotations

import json
import socket
import time

import pytest
from prefixcache_api import create_app
from proxy_support import ALPHA, leased_refs, live, make_cache, settings, wait_until
from test_proxy_errors import assert_error

PREWARM = "/v1/cache/prewarm"
SLOW = 0.05  # seconds per prefill chunk


@pytest.fixture
def slow(tiny_model, tokenizer, monkeypatch):
    """A server with a 1 s request timeout whose prewarms take 8-token chunks of ``SLOW`` seconds each."""
    cache = make_cache(tiny_model, tokenizer)
    cache.serial.prewarm_chunk = 8
    calls: list[float] = []
    real = tiny_model.forward

    def forward(*args, **kwargs):
        calls.append(time.monotonic())
        time.sleep(SLOW)
        return real(*args, **kwargs)
    monkeypatch.setattr(tiny_model, "forward", forward)
    with live(create_app(settings(request_timeout_seconds=1.0), cache=cache)) as srv:
        srv.calls = calls
        yield srv
    cache.close()


def stopped(srv, after: float) -> None:
    """The prefill made no forward later than ``after`` + one chunk, and released everything."""
    wait_until(lambda: srv.serving.queue() == (0, 0), timeout=10)
    time.sleep(3 * SLOW)
    assert max(srv.calls) < after + 2 * SLOW + 0.5, "the prefill went on after the request ended"
    assert leased_refs(srv.cache) == 0 and srv.cache.store.bytes == 0
    srv.cache.check_integrity()


def test_a_prewarm_past_the_request_timeout_is_a_504_and_its_prefill_stops(slow):
    with slow.client(ALPHA) as client:
        start = time.monotonic()
        r = client.post(PREWARM, json={"prompt": "word " * 1500, "pin": True})
        ended = time.monotonic()
        assert_error(r, 504, code="request_timeout")
        assert ended - start < 3
    assert 5 < len(slow.calls) < 1500 // 8  # it ran, and not to the end
    stopped(slow, ended)


def test_a_client_leaving_a_prewarm_stops_its_prefill(slow):
    body = json.dumps({"prompt": "word " * 1500}).encode()
    head = (f"POST {PREWARM} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALPHA}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", slow.port)) as sock:
        sock.sendall(head + body)
        wait_until(lambda: len(slow.calls) >= 2, timeout=30)  # its prefill is under way, however busy the machine
        left = time.monotonic()
    stopped(slow, left)
    assert len(slow.calls) < 1500 // 8
