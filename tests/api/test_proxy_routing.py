"""Penalty and logit_bias requests through the proxy are served by the batching engine (shared
steps), and their answers equal the serial engine's (fp32, greedy)."""
from __future__ import annotations

import copy

import pytest
from prefixcache_api import create_app
from prometheus_client.parser import text_string_to_metric_families
from proxy_support import ADMIN, KEYS, MODEL, live, settings

from prefixcache import CacheConfig, PrefixCache

ALPHA = next(iter(KEYS))
MESSAGES = [{"role": "system", "content": "You count things. " * 20}, {"role": "user", "content": "Count the apples."}]
OPTIONS = [
    {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0},
    {"logit_bias": {"42": -100, "7": 5.5}},
    {"presence_penalty": -0.5, "frequency_penalty": 0.75, "logit_bias": {"100": 3}},
]


def served_by(server) -> dict[str, float]:
    with server.client(ADMIN) as admin:
        text = admin.get("/metrics").text
    return {s.labels["executor"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "prefixcache_executor_requests_total"}


@pytest.fixture(scope="module")
def servers(chat_llama, tokenizer):
    batched = PrefixCache(copy.deepcopy(chat_llama), tokenizer, CacheConfig(max_bytes=256 << 20))
    serial = PrefixCache(copy.deepcopy(chat_llama), tokenizer, CacheConfig(max_bytes=256 << 20), batching=False)
    with live(create_app(settings(), cache=batched)) as a, live(create_app(settings(), cache=serial)) as b:
        yield a, b
    batched.close()
    serial.close()


@pytest.mark.parametrize("options", OPTIONS, ids=["presence", "frequency", "logit_bias", "all"])
def test_penalties_stay_batched_and_match_the_serial_engine(servers, options):
    batched, serial = servers
    before, steps = served_by(batched), batched.cache.batcher.steps
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "ignore_eos": True, **options}
    with batched.client(ALPHA) as a, serial.client(ALPHA) as b:
        got, want = a.post("/v1/chat/completions", json=body), b.post("/v1/chat/completions", json=body)
    assert got.status_code == want.status_code == 200, (got.text, want.text)
    after = served_by(batched)
    assert after.get("batched", 0) == before.get("batched", 0) + 1 and after.get("serial", 0) == before.get("serial", 0)
    assert batched.cache.batcher.steps >= steps + 10  # its tokens came from the engine's steps
    assert served_by(serial).get("serial", 0) >= 1
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]
    assert got.json()["usage"]["completion_tokens"] == want.json()["usage"]["completion_tokens"] == 10


def test_penalties_change_the_answer(servers):
    """The penalties are applied, not dropped: a strong logit_bias decides the text."""
    batched, _ = servers
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with batched.client(ALPHA) as a:
        plain = a.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        forced = a.post("/v1/chat/completions", json={**body, "logit_bias": {"42": 100}})
    text = forced.json()["choices"][0]["message"]["content"]
    assert text != plain and text == batched.cache.tokenizer.decode([42] * 6, skip_special_tokens=True)
