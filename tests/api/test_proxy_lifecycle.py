"""Admin flush of one tenant, tool-call conversations, and the 503s of a shutting-down proxy."""
from __future__ import annotations

import threading

from fastapi.testclient import TestClient
from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, BETA, MODEL, auth, make_cache, settings, wait_until

CHAT = "/v1/chat/completions"
SYSTEM = {"role": "system", "content": "You route parcels for a shipping company. " * 12}


def chat_body(messages: list[dict], **extra) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, **extra}


def cached(client, messages: list[dict]) -> dict:
    r = client.post(CHAT, json=chat_body(messages))
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_admin_flushes_one_named_tenant_and_leaves_the_other_intact(server):
    question = [SYSTEM, {"role": "user", "content": "Where is parcel 7?"}]
    server.cache.flush()
    with server.client(ALPHA) as alpha, server.client(BETA) as beta, server.client(ADMIN) as admin:
        cached(alpha, question)
        cached(beta, question)
        beta_before = server.cache.stats("beta")
        alpha_bytes = server.cache.stats("alpha")["bytes"]
        assert alpha_bytes > 0 and beta_before["bytes"] > 0
        flushed = admin.delete("/v1/cache", params={"tenant": "alpha"}).json()
        assert flushed == {"object": "cache.flush", "tenant": "alpha", "freed_bytes": alpha_bytes}
        assert server.cache.stats("alpha")["bytes"] == 0
        beta_after = server.cache.stats("beta")
        assert (beta_after["bytes"], beta_after["entries"]) == (beta_before["bytes"], beta_before["entries"])
        assert beta_after["evictions"]["flush"] == beta_before["evictions"]["flush"]
        # beta still hits its whole prompt; alpha starts cold
        assert cached(alpha, question)["prompt_tokens_details"]["cached_tokens"] == 0
        usage = cached(beta, question)
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        # a tenant key cannot flush another tenant
        assert alpha.delete("/v1/cache", params={"tenant": "beta"}).status_code == 403
    assert server.cache.stats("beta")["bytes"] > 0


TOOL_TURN = [
    SYSTEM,
    {"role": "user", "content": "Track parcel HF42."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "track", "arguments": '{"parcel": "HF42", "detail": "full"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "in transit", "eta": "Friday"}'},
]


def test_tool_calls_in_the_history_are_refused_where_the_template_cannot_render_them(server):
    """The default model's template renders no tool calls: a conversation holding one is refused (as ``tools``
    are), never answered from a prompt that silently lost the call. Tool-capable templates serve such turns
    (test_proxy_tool_calls); a tool result alone is text like any other turn."""
    with server.client(ALPHA) as alpha:
        for stream in (False, True):
            r = alpha.post(CHAT, json=chat_body(TOOL_TURN, stream=stream))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "messages[2].tool_calls"
            assert "does not render tool calls" in r.json()["error"]["message"]
        without_call = [*TOOL_TURN[:2], {"role": "assistant", "content": "Let me look."}, TOOL_TURN[3]]
        assert cached(alpha, without_call)["prompt_tokens"] > cached(alpha, TOOL_TURN[:2])["prompt_tokens"] + 10


def test_a_shutting_down_proxy_answers_503_and_cancels_running_work(tiny_model, tokenizer):
    cache = make_cache(tiny_model, tokenizer)
    app = create_app(settings(), cache=cache)
    long = chat_body([{"role": "user", "content": "A long story, please."}], max_tokens=1500,
                     logit_bias={str(tokenizer.eos_token_id): -100})
    outcome: dict[str, object] = {}
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 200

        def running_request() -> None:
            outcome["response"] = client.post(CHAT, json=long, headers=auth(ALPHA))

        worker = threading.Thread(target=running_request)
        worker.start()
        wait_until(lambda: app.state.serving.queue()[0] == 1, timeout=30)
        client.portal.call(app.state.serving.aclose)  # what the lifespan runs on shutdown
        worker.join(timeout=30)
        assert not worker.is_alive()
        # the running generation was cancelled, not run to its 1,500 tokens
        assert cache.stats("alpha")["completion_tokens"] < 1500
        running = outcome["response"]
        # a cut-short generation is not passed off as an answer
        assert running.status_code == 503 and running.json()["error"]["code"] == "shutting_down", running.text
        for path, body in ((CHAT, chat_body([{"role": "user", "content": "hi"}])),
                           ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                           ("/v1/cache/prewarm", {"prompt": "hi"})):
            r = client.post(path, json=body, headers=auth(ALPHA))
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"] == "1"
        stream = client.post(CHAT, json={**chat_body([{"role": "user", "content": "hi"}]), "stream": True},
                             headers=auth(ALPHA))
        assert stream.status_code == 503
        assert client.get("/readyz").status_code == 503
        assert client.get("/healthz").status_code == 200  # alive, just not ready
    assert all(n.refcount == 0 for n in cache.store.trie.iter_nodes())
    cache.check_integrity()
    cache.close()
