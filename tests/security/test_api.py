"""The proxy against a caller with a valid key (or none) who wants more than its share, or another caller's
prompts. Each test runs a real server on a loopback port, started as ``prefixcache serve`` starts uvicorn
(``server_options``: connection limit, keep-alive and header deadlines), on the tiny random model.

What each protection holds against: docs/hardening.md, "Protections".
"""
from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from prefixcache_api import create_app
from prefixcache_api.admission import SIDE_PER_TENANT
from prefixcache_api.errors import map_exception
from prefixcache_api.server import server_options
from prefixcache_api.settings import MIN_ADMIN_KEY_CHARS, MIN_API_KEY_CHARS, Settings

from prefixcache.cli import main
from prefixcache.errors import TierPurgeError
from tests.api.proxy_support import ADMIN, ALPHA, BETA, MODEL, LiveServer, make_cache, settings, wait_until

CHAT, COUNT = "/v1/chat/completions", "/v1/messages/count_tokens"
BODY_TIMEOUT, HEADER_TIMEOUT, KEEP_ALIVE = 2.0, 1.5, 1.0
#: Deadlines short enough to pass within a test; no invalid-request budget (these tests send refused requests
#: on purpose, and test_proxy_fairness tests the budget).
FAST = dict(body_timeout_seconds=BODY_TIMEOUT, header_timeout_seconds=HEADER_TIMEOUT,
            keep_alive_timeout_seconds=KEEP_ALIVE, tenant_invalid_rate=None)
SLACK = 3.0  # seconds on top of a deadline for a shared 2-core machine


class Served(LiveServer):
    """A live server as ``prefixcache serve`` runs it: uvicorn with the settings' ``server_options``."""

    def __init__(self, app):
        self.app = app
        options = {**server_options(app.state.settings), "timeout_graceful_shutdown": 5}  # the test stops it
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **options)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="prefixcache-test-server", daemon=True)


@contextmanager
def served(config: Settings, cache) -> Iterator[Served]:
    server = Served(create_app(config, cache=cache)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def srv(chat_llama, tokenizer) -> Iterator[Served]:
    """Keys alpha, beta and admin; 2 workers, a queue of 64: 16 places per key (a quarter)."""
    cache = make_cache(chat_llama, tokenizer)
    with served(settings(**FAST), cache) as server:
        yield server
    cache.close()


def chat(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}


def count_body(text: str = "hi") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}]}


# -- raw connections ---------------------------------------------------------------------------------
def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def stalled(port: int, key: str, n: int, path: str = CHAT) -> list[socket.socket]:
    """``n`` connections of ``key``, each sending its headers and the start of a 1,000-byte body, then nothing."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nx-api-key: {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode() + b'{"model": '
    socks = []
    for _ in range(n):
        socks.append(connect(port))
        socks[-1].sendall(head)
    return socks


def outcomes(socks: list[socket.socket], timeout: float) -> list[tuple[int | None, float | None]]:
    """Each connection's response status (None: none) and the seconds until the server closed it (None: it
    was still open after ``timeout``). Closes them all."""
    start, data, closed = time.monotonic(), {s: b"" for s in socks}, {}
    with selectors.DefaultSelector() as sel:
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() - start < timeout:
            for key, _ in sel.select(timeout=0.1):
                s = key.fileobj
                try:
                    chunk = s.recv(65536)
                except (ConnectionResetError, BlockingIOError):
                    chunk = b""
                if chunk:
                    data[s] += chunk
                else:
                    closed[s] = time.monotonic() - start
                    sel.unregister(s)
    for s in socks:
        s.close()
    return [(_status(data[s]), closed.get(s)) for s in socks]


def _status(raw: bytes) -> int | None:
    parts = raw.split(b"\r\n", 1)[0].split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def dribble(sock: socket.socket, byte: bytes, stop: threading.Event) -> threading.Thread:
    """Send ``byte`` every 0.2 s until the server closes the connection (or ``stop``)."""
    def run() -> None:
        while not stop.is_set():
            try:
                sock.sendall(byte)
            except OSError:
                return
            time.sleep(0.2)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- one key cannot take the server's connections, memory or threads ------------------------------
def test_200_slow_bodies_of_one_key_hold_only_its_places_and_another_key_is_served(srv):
    places = srv.app.state.settings.tenant_places
    assert places == (2 + 64) // 4  # a quarter of workers + max_queue: two keys leave half the queue
    admission = srv.serving.admission
    socks = stalled(srv.port, ALPHA, 200)
    try:
        # Its first requests take its places before their body is read; the rest are refused unread.
        wait_until(lambda: admission.in_flight("alpha") == places, timeout=10)
        with srv.client(ALPHA) as alpha, srv.client(BETA) as beta:
            busy = alpha.post(CHAT, json=chat("one more"))
            assert busy.status_code == 429 and busy.json()["error"]["code"] == "tenant_busy"
            started = time.monotonic()
            assert beta.post(CHAT, json=chat("another key's question")).status_code == 200
            assert beta.post(COUNT, json=count_body()).status_code == 200
            assert beta.get("/v1/cache/stats").status_code == 200
            assert time.monotonic() - started < 10
        assert admission.in_flight("alpha") <= places
        # Bodies that never come are answered 408 at their deadline; the refused ones 429 at once; the server
        # closes every one of these connections (keep-alive timeout), however long the client would wait.
        seen = outcomes(socks, timeout=BODY_TIMEOUT + KEEP_ALIVE + 4 * SLACK)
    finally:
        for s in socks:
            s.close()
    assert Counter(status for status, _ in seen) == {408: places, 429: 200 - places}
    assert all(when is not None for _, when in seen), "a connection outlived its deadlines"
    wait_until(lambda: admission.in_flight("alpha") == 0 and srv.serving.queue() == (0, 0), timeout=5)
    with srv.client(ALPHA) as alpha:
        assert alpha.post(CHAT, json=chat("its places are back")).status_code == 200


def test_a_keys_place_is_given_back_on_every_path(srv, tokenizer):
    places, admission = srv.app.state.settings.tenant_places, srv.serving.admission
    refused = [  # more of each than the key has places: a place kept by any of them would show as a 429
        (b'{"model": ', 400),  # not JSON
        (json.dumps(chat("x", model="no-such-model")).encode(), 404),
        (json.dumps(chat("x", max_tokens=10**6)).encode(), 400),  # over the server's max_tokens_limit
        (b"[" * 100 + b"]" * 100, 400),  # nested too deep
        (b" " * (5 << 20), 413),
    ]
    with srv.client(ALPHA) as alpha:
        for body, status in refused:
            for _ in range(places + 1):
                r = alpha.post(CHAT, content=body, headers={"content-type": "application/json"})
                assert r.status_code == status, r.text
        for _ in range(places + 1):  # answered, streamed to the end, or left mid-stream
            assert alpha.post(CHAT, json=chat("served")).status_code == 200
            with alpha.stream("POST", CHAT, json=chat("streamed", stream=True, max_tokens=50,
                                                       logit_bias={str(tokenizer.eos_token_id): -100})) as r:
                next(r.iter_lines())
    wait_until(lambda: admission.in_flight("alpha") == 0, timeout=10)  # the streams left are cancelled
    gone = stalled(srv.port, ALPHA, places)  # clients that leave before their body is in
    wait_until(lambda: admission.in_flight("alpha") == places, timeout=10)
    for s in gone:
        s.close()
    wait_until(lambda: admission.in_flight("alpha") == 0 and srv.serving.queue() == (0, 0), timeout=10)


def test_connections_that_stall_or_dribble_are_closed_at_their_deadline(srv):
    silent = connect(srv.port)  # opens, sends nothing
    slow_head = connect(srv.port)  # its headers a byte at a time, never done
    slow_head.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
    refused = connect(srv.port)  # answered 413 before its body is read, then keeps sending body bytes
    refused.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ALPHA}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {64 << 20}\r\n\r\n".encode())
    stop = threading.Event()
    threads = [dribble(slow_head, b"a", stop), dribble(refused, b" ", stop)]
    try:
        seen = outcomes([silent, slow_head, refused], timeout=HEADER_TIMEOUT + KEEP_ALIVE + 2 * SLACK)
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
    (_, silent_closed), (_, head_closed), (status, refused_closed) = seen
    assert silent_closed is not None and silent_closed < HEADER_TIMEOUT + SLACK
    assert head_closed is not None and head_closed < HEADER_TIMEOUT + SLACK  # bytes do not extend the deadline
    assert status == 413 and refused_closed is not None and refused_closed < KEEP_ALIVE + SLACK


def test_count_tokens_stats_and_flush_run_beside_the_queue_in_a_few_places_per_key(srv, monkeypatch):
    socks = stalled(srv.port, ALPHA, SIDE_PER_TENANT, path=COUNT)
    try:
        with srv.client(ALPHA) as alpha, srv.client(BETA) as beta:
            wait_until(lambda: alpha.get("/v1/cache/stats").status_code == 429, timeout=10)
            r = alpha.post(COUNT, json=count_body())
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            assert alpha.delete("/v1/cache").json()["error"]["code"] == "tenant_busy"
            assert beta.post(COUNT, json=count_body()).status_code == 200  # another key's places are its own
            assert beta.get("/v1/cache/stats").status_code == 200
            assert beta.delete("/v1/cache").status_code == 200
        seen = outcomes(socks, timeout=BODY_TIMEOUT + KEEP_ALIVE + 2 * SLACK)
    finally:
        for s in socks:
            s.close()
    assert [status for status, _ in seen] == [408] * SIDE_PER_TENANT
    # The work runs on the side threads (not the event loop's pool that parses every tenant's bodies); a flush
    # whose tier cannot be reached is a 503 that gives the key's place back.
    threads: list[str] = []

    def flush(tenant=None, **_):
        threads.append(threading.current_thread().name)
        raise TierPurgeError("the redis tier could not be reached")

    real_encode = srv.cache.encode_messages

    def encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(srv.cache, "flush", flush)
    monkeypatch.setattr(srv.cache, "encode_messages", encode)
    with srv.client(ALPHA) as alpha:
        for _ in range(SIDE_PER_TENANT + 1):  # more than its places: each failure gave its place back
            r = alpha.delete("/v1/cache")
            assert r.status_code == 503 and r.json()["error"]["code"] == "tier_unavailable", r.text
            assert r.headers.get("retry-after")
        assert alpha.post(COUNT, json=count_body()).status_code == 200
    assert threads and all(name.startswith("prefixcache-side") for name in threads), threads


# -- input the depth guard must see as it is parsed ------------------------------------------------------
def _nested_body(encoding: str, content: str) -> bytes:
    """A body whose tools nest 5,000 deep; the U+2200 in it holds a quote byte in UTF-16, which hides the
    nesting from a count made on the bytes."""
    depth = 5000
    text = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}]}, ensure_ascii=False)
    return (text[:-1] + ', "tools": ' + "[" * depth + "]" * depth + "}").encode(encoding)


@pytest.mark.parametrize("encoding,content,code", [
    ("utf-16-le", "\u2200 caf\u00e9", "invalid_encoding"),  # not UTF-8: refused as such
    ("utf-16-le", "\u2200", "invalid_json"),  # every byte ASCII (valid UTF-8), but not JSON as UTF-8 text
    ("utf-16-be", "\u2200", "invalid_json"),
    ("utf-32-le", "\u2200", "invalid_json"),
])
def test_a_utf16_body_cannot_slip_past_the_depth_guard(srv, encoding, content, code):
    with srv.client(ALPHA) as alpha:
        r = alpha.post(CHAT, content=_nested_body(encoding, content), headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == code
        assert alpha.post(CHAT, json=chat("the server is fine")).status_code == 200
    assert map_exception(RecursionError()).status == 400  # whatever recursion a body causes: the body's fault


# -- callers sharing a key --------------------------------------------------------------------------
def test_cache_salt_splits_the_callers_of_one_key(srv):
    tides = "You keep the tide tables of the harbour of Saltmarsh and answer in one line. " * 4

    def cached(key: str, salt: str | None, path: str = CHAT) -> tuple[int, int]:
        """(cached tokens, prompt tokens) of the same prompt sent with ``salt``."""
        # Each API its own prompts and salts: chat and messages encode alike.
        extra = {} if salt is None else {"cache_salt": f"{salt}@{path}" if salt else ""}
        system = f"[{path}] {tides}"
        with srv.client(key) as client:
            if path == "/v1/messages":
                r = client.post(path, json={"model": MODEL, "max_tokens": 2, "system": system, **extra,
                                            "messages": [{"role": "user", "content": "High tide?"}]})
                assert r.status_code == 200, r.text
                usage = r.json()["usage"]
                return usage["cache_read_input_tokens"], sum(usage[k] for k in (
                    "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
            if path == CHAT:
                body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "High tide?"}]}
            else:
                body = {"prompt": system}
            r = client.post(path, json={"model": MODEL, "max_tokens": 2, **extra, **body})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    def hit(found: tuple[int, int]) -> bool:
        """Its prompt was cached: more than half of it (a miss may still share the chat template's first tokens
        with the key's other requests)."""
        return found[0] > found[1] // 2

    for path in (CHAT, "/v1/completions", "/v1/messages"):
        assert cached(ALPHA, "caller-1", path)[0] == 0, path  # a salt's namespace starts empty
        assert cached(ALPHA, "caller-2", path)[0] == 0, path  # same key, same prompt, another salt: nothing shared
        assert not hit(cached(ALPHA, None, path)), path  # no salt: the key's own namespace, not caller-1's
        assert hit(cached(ALPHA, "", path)), path  # an empty salt is no salt
        assert hit(cached(ALPHA, "caller-1", path)), path  # the same salt: a hit
        assert cached(BETA, "caller-1", path)[0] == 0, path  # the same salt under another key: another tenant
    cache = srv.cache  # the SDK: a salt is one more namespace part; no salt or an empty one, none
    assert cache.namespace("alpha", "s") != cache.namespace("alpha", "t") != cache.namespace("alpha")
    assert cache.namespace("alpha", "") == cache.namespace("alpha", None) == cache.namespace("alpha")
    with srv.client(ALPHA) as alpha:  # a prewarm fills the salted namespace it names
        warm = alpha.post("/v1/cache/prewarm", json={"messages": [{"role": "system", "content": tides * 2}],
                                                      "cache_salt": "warmed"})
        assert warm.status_code == 200, warm.text
        for salt, warmed in (("other", False), ("warmed", True)):
            r = alpha.post(CHAT, json={"model": MODEL, "max_tokens": 2, "cache_salt": salt, "messages": [
                {"role": "system", "content": tides * 2}, {"role": "user", "content": "Low tide?"}]})
            usage = r.json()["usage"]
            assert hit((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"])) is warmed, salt


def test_cached_tokens_can_be_reported_in_whole_blocks(chat_llama, tokenizer):
    block = 16
    cache = make_cache(chat_llama, tokenizer, block_size=block)
    text = "The ferry to the outer islands leaves at dawn, weather permitting, and returns at dusk. " * 3
    try:
        with served(settings(cached_tokens_granularity="block", **FAST), cache) as server, \
                server.client(ALPHA) as alpha:
            body = {"model": MODEL, "prompt": text, "max_tokens": 2}
            assert alpha.post("/v1/completions", json=body).status_code == 200
            before = cache.stats("alpha")["cached_tokens"]
            usage = alpha.post("/v1/completions", json=body).json()["usage"]
            exact = cache.stats("alpha")["cached_tokens"] - before
            reported = usage["prompt_tokens_details"]["cached_tokens"]
            assert exact % block and reported == exact - exact % block > 0  # rounded down to whole blocks
            messages = {"model": MODEL, "max_tokens": 2, "system": text, "messages": [{"role": "user", "content": "?"}]}
            alpha.post("/v1/messages", json=messages)
            second = alpha.post("/v1/messages", json=messages).json()["usage"]
            assert second["cache_read_input_tokens"] % block == 0 and second["cache_read_input_tokens"] > 0
            count = alpha.post(COUNT, json={k: messages[k] for k in ("model", "system", "messages")}).json()
            parts = second["input_tokens"] + second["cache_read_input_tokens"] + second["cache_creation_input_tokens"]
            assert parts == count["input_tokens"]  # what rounding takes off counts as input: the sum is the prompt
    finally:
        cache.close()


# -- what strangers learn ---------------------------------------------------------------------------------
def test_health_routes_give_a_fixed_reason_and_the_detail_only_to_the_admin_and_the_log(
        chat_llama, tokenizer, monkeypatch, caplog):
    secret = "RuntimeError: kernel fault in /opt/internal/attention.cu:42 serving tenant alpha"
    cache = make_cache(chat_llama, tokenizer)
    try:
        with served(settings(**FAST), cache) as server, server.client() as anyone, server.client(ADMIN) as admin:
            monkeypatch.setattr(cache.batcher, "failure", secret)  # the batching loop stopped
            with caplog.at_level(logging.ERROR, logger="prefixcache_api.serving"):
                for path in ("/healthz", "/readyz", "/health"):
                    r = anyone.get(path)
                    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", (path, r.text)
                    assert "kernel" not in r.text and "/opt" not in r.text and "alpha" not in r.text, path
            assert any(secret in record.getMessage() for record in caplog.records)
            assert secret in admin.get("/v1/cache/stats").json()["batching_disabled_reason"]
            monkeypatch.setattr(cache.batcher, "failure", None)
            monkeypatch.setattr(type(cache.batcher), "faulting", property(lambda self: secret))  # steps all fail
            r = anyone.get("/readyz")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_faulting" and "kernel" not in r.text
            assert admin.get("/v1/cache/stats").json()["engine_faulting"] == secret
            monkeypatch.undo()
            assert anyone.get("/readyz").status_code == 200
    finally:
        cache.close()


def test_the_openapi_schema_and_its_pages_are_off_unless_asked_for(srv, chat_llama, tokenizer):
    for key in (None, ALPHA, ADMIN):
        with srv.client(key) as client:
            for path in ("/openapi.json", "/docs", "/redoc"):
                assert client.get(path).status_code == 404, (key, path)
    cache = make_cache(chat_llama, tokenizer)
    try:
        with served(settings(docs=True, **FAST), cache) as server, server.client() as anyone:
            assert "/v1/chat/completions" in anyone.get("/openapi.json").json()["paths"]
            assert anyone.get("/docs").status_code == 200
    finally:
        cache.close()


# -- keys and local mode ------------------------------------------------------------------------------------
def test_short_keys_are_refused_at_start_up(monkeypatch, capsys):
    import prefixcache_api

    def load(settings):
        raise AssertionError("start-up went on to load the model")
    monkeypatch.setattr(prefixcache_api, "build_cache", load)
    for name in ("API_KEYS", "ADMIN_KEY", "HOST"):
        monkeypatch.delenv(f"PREFIXCACHE_{name}", raising=False)
    admin, short = "a" * MIN_ADMIN_KEY_CHARS, "sk-" + "s" * (MIN_API_KEY_CHARS - 4)
    assert main(["serve", "--host", "0.0.0.0", "--admin-key", admin, "--api-key", f"{short}=alpha"]) == 2
    err = capsys.readouterr().err
    assert f"shorter than {MIN_API_KEY_CHARS} characters" in err and "'alpha'" in err
    assert short not in err and admin not in err  # the error names the tenant, never a key
    assert main(["serve", "--host", "0.0.0.0", "--admin-key", admin[1:]]) == 2
    err = capsys.readouterr().err
    assert f"needs at least {MIN_ADMIN_KEY_CHARS}" in err and admin[1:] not in err
    # On loopback only this machine could guess a key: short ones are accepted there (tests, benchmarks).
    assert Settings(host="127.0.0.1", api_keys={short: "alpha"}, admin_key="short").api_keys == {short: "alpha"}
    monkeypatch.setenv("PREFIXCACHE_HOST", "0.0.0.0")  # as the image sets it
    monkeypatch.setenv("PREFIXCACHE_API_KEYS", json.dumps({short: "alpha"}))
    monkeypatch.setenv("PREFIXCACHE_ADMIN_KEY", admin)
    assert main(["serve"]) == 2
    assert "shorter than" in capsys.readouterr().err
    # Keys of the right length go on (here, to the stand-in loader).
    monkeypatch.setenv("PREFIXCACHE_API_KEYS", json.dumps({short + "-and-more": "alpha"}))
    with pytest.raises(AssertionError, match="went on to load"):
        main(["serve"])


def test_local_callers_are_not_admin_unless_the_server_says_so(chat_llama, tokenizer):
    cache = make_cache(chat_llama, tokenizer)
    local = dict(served_model_name=MODEL, default_max_tokens=2, **FAST)
    try:
        with served(Settings(**local), cache) as server, server.client() as anyone:
            assert anyone.post(CHAT, json=chat("local")).status_code == 200  # no key needed
            assert anyone.get("/metrics").status_code == 403
            stats = anyone.get("/v1/cache/stats").json()
            assert stats["tenant"] == "default" and stats["queue"] is None  # its own figures, not the server's
            assert anyone.delete("/v1/cache", params={"tenant": "other"}).status_code == 403
            assert anyone.delete("/v1/cache").json()["tenant"] == "default"
        with served(Settings(local_admin=True, **local), cache) as server, server.client() as anyone:
            assert anyone.get("/metrics").status_code == 200
            assert anyone.delete("/v1/cache").json()["tenant"] is None  # --local-admin: everything
    finally:
        cache.close()


# -- fair shares by default ---------------------------------------------------------------------------------
def test_fair_share_defaults_leave_room_for_the_other_tenants():
    keys = {f"sk-tenant-{i}-0123456789abcdef": f"t{i}" for i in range(8)}
    config = Settings(api_keys=keys)
    capacity = config.workers + config.max_queue
    assert config.tenant_places == capacity // 4 and 2 * config.tenant_places <= capacity // 2
    cache = config.cache_config()
    assert cache.tenant_quota_bytes == config.max_bytes // 4  # a byte quota by default
    assert len(keys) * cache.pin_quota_bytes <= config.max_bytes // 2  # all keys' pins: half the budget at most
    assert Settings(api_keys=keys, max_pinned_bytes=8 << 20).cache_config().pin_quota_bytes == 1 << 20
    assert Settings(api_keys=keys, tenant_quota_bytes=123).cache_config().tenant_quota_bytes == 123
    assert Settings(api_keys=keys, tenant_quota_share=1).cache_config().tenant_quota_bytes is None
    assert Settings().cache_config().tenant_quota_bytes is None  # local mode: one tenant, the whole budget
    assert Settings(workers=1, max_queue=0).tenant_places == 1
