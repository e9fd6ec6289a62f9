"""/metrics (Prometheus), /v1/cache/stats, prewarm and flush: shapes, gating, and numbers that move."""
from __future__ import annotations

from fastapi.testclient import TestClient
from prefixcache_api import create_app, metrics
from prometheus_client.parser import text_string_to_metric_families
from proxy_support import ADMIN, ALPHA, BETA, MODEL, auth, settings

SYSTEM = "Policy: refunds within 30 days, exchanges within 60, no questions asked. " * 10


def scrape(server) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} from a parsed exposition."""
    with server.client(ADMIN) as admin:
        r = admin.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def total(samples: dict[str, dict[tuple, float]], name: str, **labels: str) -> float:
    return sum(v for k, v in samples.get(name, {}).items() if all((n, labels[n]) in k for n in labels))


def ask(client, question: str) -> dict:
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_metrics_parse_name_every_defined_metric_and_move(server):
    with server.client(ALPHA) as client:
        ask(client, "warm-up")  # at least one request of each kind, so labelled series exist
        before = scrape(server)
        first = ask(client, "What is the refund window?")
        second = ask(client, "What is the exchange window?")
    after = scrape(server)
    families = {f.name for f in text_string_to_metric_families(_raw(server))}
    assert set(metrics.NAMES) <= families, set(metrics.NAMES) - families
    assert set(after) <= metrics.SERIES | {n + "_created" for n in metrics.COUNTERS + metrics.HISTOGRAMS}

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert delta("prefixcache_requests_total", tenant="alpha", endpoint="chat") == 2
    assert delta("prefixcache_prompt_tokens_total", tenant="alpha") == first["prompt_tokens"] + second["prompt_tokens"]
    cached = first["prompt_tokens_details"]["cached_tokens"] + second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and delta("prefixcache_cached_tokens_total", tenant="alpha") == cached
    assert delta("prefixcache_time_to_first_token_seconds_count") == 2
    assert delta("prefixcache_time_per_output_token_seconds_count") == 2
    assert delta("prefixcache_lookup_seconds_count") == 2
    assert delta("prefixcache_request_duration_seconds_count", endpoint="chat") == 2
    assert total(after, "prefixcache_cache_bytes") > 0
    assert total(after, "prefixcache_cache_budget_bytes") == server.cache.config.max_bytes
    assert total(after, "prefixcache_cache_entries") > 0
    assert 0 < total(after, "prefixcache_hit_ratio", basis="tokens") <= 1
    assert total(after, "prefixcache_queue_depth") == 0


def _raw(server) -> str:
    with server.client(ADMIN) as admin:
        return admin.get("/metrics").text


def test_metrics_are_gated_by_the_admin_key(server, tiny_model, tokenizer, new_proxy_cache):
    with server.client() as anon, server.client(ALPHA) as tenant:
        assert anon.get("/metrics").status_code == 401
        assert tenant.get("/metrics").status_code == 403
    app = create_app(settings(metrics_public=True), cache=new_proxy_cache(tiny_model, tokenizer))
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 200  # a separate, private scrape network


def test_two_apps_in_one_process_have_separate_registries(tiny_model, tokenizer, new_proxy_cache):
    a = create_app(settings(), cache=new_proxy_cache(tiny_model, tokenizer))
    b = create_app(settings(), cache=new_proxy_cache(tiny_model, tokenizer))
    with TestClient(a) as ca, TestClient(b) as cb:
        ca.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, headers=auth(ALPHA))
        sa = ca.get("/metrics", headers=auth(ADMIN)).text
        sb = cb.get("/metrics", headers=auth(ADMIN)).text
    assert 'prefixcache_requests_total{endpoint="completions"' in sa
    assert 'prefixcache_requests_total{endpoint="completions"' not in sb


def test_stats_scope_tenant_view_and_admin_view(server):
    server.cache.flush()
    with server.client(ALPHA) as alpha, server.client(BETA) as beta, server.client(ADMIN) as admin:
        ask(alpha, "one")
        ask(alpha, "two")
        mine = alpha.get("/v1/cache/stats").json()
        assert mine["tenant"] == "alpha" and mine["queries"] >= 2 and mine["bytes"] > 0
        assert 0 < mine["hit_rate"] <= 1 and mine["cached_tokens"] > 0
        # A tenant sees its own entries and evictions; other tenants' bytes and the queue are admin only.
        assert mine["entries"] > 0 and set(mine["evictions"]) == {"lru", "ttl", "quota", "flush"}
        assert mine["tenant_bytes"] is None and mine["queue"] is None
        theirs = beta.get("/v1/cache/stats").json()
        assert theirs["bytes"] == 0 and theirs["entries"] == 0
        everyone = admin.get("/v1/cache/stats").json()
        assert everyone["tenant"] is None and everyone["entries"] > 0
        assert set(everyone["evictions"]) == {"lru", "ttl", "quota", "flush"}
        assert everyone["queue"] == {"running": 0, "waiting": 0, "capacity": 66}
        assert admin.get("/v1/cache/stats", params={"tenant": "alpha"}).json()["bytes"] == mine["bytes"]


def test_prewarm_pins_then_hits_and_flush_is_scoped(server):
    server.cache.flush()
    messages = [{"role": "system", "content": SYSTEM}]
    with server.client(ALPHA) as alpha, server.client(BETA) as beta, server.client(ADMIN) as admin:
        warm = alpha.post("/v1/cache/prewarm", json={"messages": messages, "pin": True, "model": MODEL}).json()
        assert warm["tenant"] == "alpha" and warm["pinned"] and warm["stored_tokens"] == warm["prompt_tokens"] > 100
        assert admin.get("/v1/cache/stats").json()["pinned_bytes"] > 0
        assert ask(alpha, "first question")["prompt_tokens_details"]["cached_tokens"] >= warm["prompt_tokens"]
        ask(beta, "first question")
        # A tenant flushes only itself.
        freed = alpha.delete("/v1/cache").json()
        assert freed == {"object": "cache.flush", "tenant": "alpha", "freed_bytes": freed["freed_bytes"]}
        assert freed["freed_bytes"] > 0
        assert alpha.get("/v1/cache/stats").json()["bytes"] == 0
        assert beta.get("/v1/cache/stats").json()["bytes"] > 0
        # Admin prewarms for a named tenant, and flushes everyone.
        warmed = admin.post("/v1/cache/prewarm", params={"tenant": "beta"}, json={"prompt": "hello"}).json()
        assert warmed["tenant"] == "beta"
        assert admin.delete("/v1/cache").json()["tenant"] is None
        assert admin.get("/v1/cache/stats").json()["bytes"] == 0
    samples = scrape(server)
    assert total(samples, "prefixcache_evictions_total", reason="flush") > 0
    assert total(samples, "prefixcache_reclaimed_bytes_total", reason="flush") > 0
    server.cache.check_integrity()
