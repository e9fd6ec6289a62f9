"""Lower tiers through the proxy: restarts of ``prefixcache serve`` on a disk or Redis tier, two servers
sharing one real redis-server, and Redis stopped mid-run.

The first server of the restart test is a real ``prefixcache serve`` subprocess on a loopback port (its
tiers from the command line, stopped by a signal), loading a tiny random Llama saved with the default
model's tokenizer; the servers after it run the same settings and start-up on uvicorn threads of the test's
process. The Redis server is a real ``redis-server``.
"""
from __future__ import annotations

import re
import sys

import httpx
import pytest
from prefixcache_api import create_app
from proxy_support import ADMIN, MODEL, auth, live, settings, wait_until

from prefixcache.bench.servers import Server, free_port

SYSTEM = "You answer questions about the tide tables of small harbours, tersely and exactly. " * 6
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When is high tide?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-chat-llama")
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def serve(model_dir, *flags: str) -> Server:
    argv = [sys.executable, "-m", "prefixcache.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1",
            "--served-model-name", MODEL, "--block-size", "16", "--default-temperature", "0", "--workers", "2",
            "--torch-threads", "1", "--log-level", "warning", "--local-admin", *flags]  # the tiers' stats are admin's
    server = Server("prefixcache serve", argv + ["--port", str(port := free_port())], "/readyz", threads=1)
    server.start(port)
    return server


def ask(server: Server) -> tuple[str, int]:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": QUESTION, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def in_process(model_dir, **tiers):
    """``prefixcache serve``'s settings and start-up (the model loaded from the folder by the app's lifespan), on
    a uvicorn thread of this process: what a restarted replica does, without another interpreter to start."""
    from prefixcache_api import Settings

    return live(create_app(Settings(model=str(model_dir), served_model_name=MODEL, block_size=16,
                                    default_temperature=0.0, workers=2, local_admin=True, **tiers)))


def test_restart_on_disk_and_redis_and_sharing_by_secret(model_dir, redis_server, tmp_path):
    """A (a ``prefixcache serve`` process, its tiers from the command line) computes a prefix and is stopped by
    a signal: write-back keeps its blocks on disk and in Redis. Then three servers run at once: A restarted on
    its disk tier, B on the Redis tier with A's secret, C on it with another secret. A and B report cached
    tokens and A's answer; C reports none."""
    first, second = "one secret of the first deployment, 32+ bytes", "another secret, of a second deployment, 32+ bytes"
    a = serve(model_dir, "--tier-disk", str(tmp_path / "kv"), "--tier-redis", redis_server.url, "--hash-secret", first)
    try:
        answer, cached = ask(a)
        assert cached == 0
    finally:
        a.stop()
    tiers = {"a": dict(tier_disk=str(tmp_path / "kv"), hash_secret=first),
             "b": dict(tier_redis=redis_server.url, hash_secret=first),
             "c": dict(tier_redis=redis_server.url, hash_secret=second)}
    with in_process(model_dir, **tiers["a"]) as ra, in_process(model_dir, **tiers["b"]) as rb, \
            in_process(model_dir, **tiers["c"]) as rc:
        servers = {"a": ra, "b": rb, "c": rc}
        replies = {name: ask(server) for name, server in servers.items()}
        assert replies["a"][1] > 0 and replies["a"][0] == answer  # restart on the disk tier
        assert replies["b"][1] > 0 and replies["b"][0] == answer  # a prefix only A computed, via Redis
        assert replies["c"] == (answer, 0)  # another secret never hits
        stats = {name: httpx.get(s.url + "/v1/cache/stats").json()["tiers"] for name, s in servers.items()}
        assert stats["a"]["disk"]["restores"] == 1 and stats["b"]["redis"]["restores"] == 1
        assert stats["c"]["redis"]["restores"] == 0 and stats["c"]["redis"]["misses"] == 1


def test_a_redis_tier_needs_a_hash_secret(model_dir):
    from prefixcache.cli import main

    assert main(["serve", "--model", str(model_dir), "--tier-redis", "redis://127.0.0.1:1/0"]) == 2


def degraded(srv) -> float | None:
    text = httpx.get(srv.url + "/metrics", headers=auth(ADMIN)).text
    found = re.search(r'^prefixcache_tier_degraded\{tier="redis"\} (\S+)$', text, re.M)
    return None if found is None else float(found.group(1))


def test_redis_stopped_mid_run_fails_no_request_and_recovers(tiny_model, tokenizer, redis_server, new_proxy_cache):
    cache = new_proxy_cache(tiny_model, tokenizer, block_size=16, tier_redis=redis_server.url, hash_secret="s" * 32,
                            tier_write_policy="write-through")
    with live(create_app(settings(), cache=cache)) as srv, srv.openai("sk-alpha") as client:
        def chat(question: str):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)

        chat("warm up")
        assert degraded(srv) == 0
        redis_server.stop()
        answers = [chat(f"question {i} while Redis is down") for i in range(4)]
        assert all(a.choices[0].message.content is not None for a in answers)
        cache.flush(tiers=False)  # the next requests must look below the device, where Redis is down
        assert chat("after a flush").usage.prompt_tokens_details.cached_tokens == 0
        assert degraded(srv) == 1
        redis_server.start()

        def recovered() -> bool:
            cache.flush(tiers=False)
            chat("probe")
            return degraded(srv) == 0

        wait_until(recovered, timeout=60, interval=0.5)
        cache.tiers.flush_writes(10)
        cache.flush(tiers=False)
        again = chat("probe")  # its blocks were written through after recovery, then restored
        assert again.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("failure", ["readonly", "oom"])
def test_a_redis_that_refuses_writes_keeps_metrics_answering_and_requests_served(failure, tiny_model, tokenizer,
                                                                                 redis_server, new_proxy_cache):
    """READONLY (a failover left the tier on a replica) or OOM (maxmemory, noeviction): every request is still
    answered, the tier shows as degraded, and ``/metrics`` stays 200."""
    cache = new_proxy_cache(tiny_model, tokenizer, block_size=16, tier_redis=redis_server.url, hash_secret="s" * 32,
                            tier_write_policy="write-through")
    admin = redis_server.client()
    with live(create_app(settings(), cache=cache)) as srv, srv.openai("sk-alpha") as client:
        def chat(question: str):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)

        chat("warm up")
        if failure == "readonly":
            admin.execute_command("REPLICAOF", "127.0.0.1", "1")  # a master that never answers: writes refused
        else:
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)
        try:
            answers = [chat(f"question {i} while Redis refuses writes") for i in range(3)]
            assert all(a.choices[0].message.content is not None for a in answers)
            cache.tiers.flush_writes(10)
            r = httpx.get(srv.url + "/metrics", headers=auth(ADMIN), timeout=30)
            assert r.status_code == 200
            assert degraded(srv) == 1
        finally:
            admin.execute_command("REPLICAOF", "NO", "ONE")
            admin.config_set("maxmemory", 0)
