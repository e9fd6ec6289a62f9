"""All KV memory at the HTTP edge: a request whose KV cannot fit the total is a 503 with Retry-After;
/metrics, the admin stats and their audit report every kind, and nothing is in flight at idle."""
from __future__ import annotations

import pytest
from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, MODEL, live, make_cache, settings
from test_proxy_errors import assert_error

CHAT = "/v1/chat/completions"
BPT = 512  # the tiny Llama's KV bytes per token


@pytest.fixture(scope="module")
def bounded(tiny_model, tokenizer):
    cache = make_cache(tiny_model, tokenizer, max_kv_bytes_total=400 * BPT, kv_wait_seconds=0.2)
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


def chat(max_tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "How long do refunds take?"}],
            "max_tokens": max_tokens}


def test_a_request_whose_kv_cannot_fit_the_total_is_503_with_retry_after(bounded):
    with bounded.client(ALPHA) as client:
        r = client.post(CHAT, json=chat(1000))
        assert_error(r, 503, code="insufficient_capacity")
        assert r.headers.get("Retry-After") and "KV" in r.json()["error"]["message"]
        assert client.post(CHAT, json=chat(8)).status_code == 200


def test_every_kind_of_kv_memory_is_reported_and_none_is_in_flight_at_idle(bounded):
    with bounded.client(ALPHA) as client:
        assert client.post(CHAT, json=chat(8)).status_code == 200
        assert client.get("/v1/cache/stats").json().get("kv_bytes") is None  # all tenants' memory: admin only
        assert_error(client.get("/v1/cache/stats", params={"audit": "true"}), 403)
    with bounded.client(ADMIN) as admin:
        stats = admin.get("/v1/cache/stats", params={"audit": "true"}).json()
        assert stats["kv_total_bytes"] == 400 * BPT
        assert stats["kv_bytes"] == {"stored": stats["bytes"], "private": 0, "serial": 0, "prewarm": 0}
        assert stats["bytes"] > 0 and stats["live_tensor_bytes"] == stats["bytes"] and stats["refcounts"] == 0
        text = admin.get("/metrics").text
        for kind in ("stored", "private", "serial", "prewarm"):
            assert f'prefixcache_kv_bytes{{kind="{kind}"}}' in text
        assert f"prefixcache_kv_total_bytes {float(400 * BPT)}" in text
