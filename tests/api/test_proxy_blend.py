"""Documents marked ``prefixcache_chunk`` through the official clients: reused in another order, reported in usage
and metrics, switched off per request, refused when malformed."""
from __future__ import annotations

import anthropic
import httpx
import openai
from proxy_support import ADMIN, ALPHA, BETA, MODEL, auth

DOCS = ["The lighthouse keeper logs every passing ship and the weather at each hour of the night. " * 3,
        "Tide tables list the times of high and low water for each day of the month at the harbour. " * 3,
        "A ship's bell is struck every half hour of a watch, one stroke more for each half hour. " * 3]


def parts(*docs: str, question: str = "Which document is about bells?") -> list[dict]:
    return [*({"type": "text", "text": d, "prefixcache_chunk": True} for d in docs), {"type": "text", "text": question}]


def ask(client: openai.OpenAI, *docs: str, **extra):
    return client.chat.completions.create(model=MODEL, max_tokens=3, messages=[
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": parts(*docs)}], extra_body=extra or None)


def details(response) -> dict:
    return response.usage.prompt_tokens_details.model_dump()


def test_openai_documents_are_reused_in_another_order_and_reported(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=ALPHA, max_retries=0)
    ask(client, DOCS[0], DOCS[1])
    second = ask(client, DOCS[2], DOCS[0])
    d = details(second)
    assert d["chunk_reused_tokens"] > 0 and d["chunk_recomputed_tokens"] > 0
    full = ask(client, DOCS[0], DOCS[2], prefixcache_blend=1)
    assert details(full)["chunk_reused_tokens"] == 0 and details(full)["chunk_recomputed_tokens"] > 0
    off = ask(client, DOCS[1], DOCS[2], prefixcache_blend=False)
    assert details(off)["chunk_reused_tokens"] == details(off)["chunk_recomputed_tokens"] == 0
    other = openai.OpenAI(base_url=server.url + "/v1", api_key=BETA, max_retries=0)
    theirs = ask(other, DOCS[2], DOCS[0])  # another tenant: alpha's documents are not found, a first sight
    assert details(theirs)["chunk_reused_tokens"] == details(theirs)["chunk_recomputed_tokens"] == 0
    metrics = httpx.get(server.url + "/metrics", headers=auth(ADMIN)).text
    assert 'prefixcache_chunk_tokens_total{kind="reused",tenant="alpha"}' in metrics
    assert 'prefixcache_chunk_tokens_total{kind="stored",tenant="beta"}' in metrics
    assert 'prefixcache_blend_requests_total{outcome="prefilled"}' in metrics


def test_anthropic_text_blocks_marked_as_chunks(server):
    client = anthropic.Anthropic(base_url=server.url, api_key=ALPHA, max_retries=0)
    for docs in ((DOCS[1], DOCS[2]), (DOCS[2], DOCS[1])):
        message = client.messages.create(model=MODEL, max_tokens=3, system="Answer from the documents.",
                                         messages=[{"role": "user", "content": parts(*docs)}])
    usage = message.usage.model_dump()
    assert usage["chunk_reused_input_tokens"] > 0 and usage["chunk_recomputed_input_tokens"] > 0


def test_malformed_marks_and_switches_are_400s(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": parts(DOCS[0])}]}
    for bad in ({"prefixcache_blend": 2}, {"prefixcache_blend": "yes"}):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, **bad}, headers=auth(ALPHA))
        assert r.status_code == 400, r.text
    marked = {"type": "text", "text": "x", "prefixcache_chunk": "sure"}
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(ALPHA),
                   json={**body, "messages": [{"role": "user", "content": [marked]}]})
    assert r.status_code == 400, r.text
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": ALPHA, "anthropic-version": "2023-06-01"},
                   json={**body, "messages": [{"role": "user", "content": [marked]}]})
    assert r.status_code == 400, r.text
