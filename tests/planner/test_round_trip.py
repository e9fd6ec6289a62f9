"""Round trip: `prefixcache serve --request-log`, a workload through the openai client, then `plan` at the
server's own budget and TTL reproduces the token hit rate the server reported in /v1/cache/stats."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

from prefixcache.cli import main

BLOCK, BUDGET_TOKENS, BYTES_PER_TOKEN = 4, 700, 512  # the tiny model: 2 layers x 2 x 2 heads x 16 x fp32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(rng: random.Random) -> list[list[dict]]:
    """Three long system prompts, questions on each, and a conversation that goes on for turns."""
    words = ["policy", "refund", "order", "shipping", "account", "invoice", "return", "warranty", "support", "team"]
    systems = [" ".join(rng.choice(words) for _ in range(120)) for _ in range(3)]
    chats = []
    for _ in range(14):
        system = rng.choice(systems)
        question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        chats.append([{"role": "system", "content": system}, {"role": "user", "content": question}])
    return chats


def test_plan_at_the_servers_budget_and_ttl_reproduces_its_hit_rate(tiny_folder, tmp_path, capsys):
    from openai import OpenAI

    port, log = free_port(), tmp_path / "requests.jsonl"
    budget = BUDGET_TOKENS * BYTES_PER_TOKEN
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefixcache.cli", "serve", "--model", str(tiny_folder), "--port", str(port),
         "--request-log", str(log), "--request-log-key", "test-secret", "--block-size", str(BLOCK),
         "--max-bytes", str(budget), "--ttl-seconds", "300", "--default-temperature", "0", "--workers", "1",
         "--log-level", "warning"],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        client = OpenAI(base_url=f"{url}/v1", api_key="local", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        conversation = workload(random.Random(0))
        for messages in conversation:
            client.chat.completions.create(model=model, messages=messages, max_tokens=6)
        turns = conversation[0][:1] + [{"role": "user", "content": "first question about the refund"}]
        for k in range(4):  # each turn extends the last one with its answer: the stored answer is reused
            r = client.chat.completions.create(model=model, messages=turns, max_tokens=6)
            turns = turns + [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"follow-up number {k}"}]
        stats = httpx.get(f"{url}/v1/cache/stats", timeout=30).json()
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    server_rate = stats["token_hit_rate"]
    assert stats["evictions"]["lru"] > 0 and 0.2 < server_rate < 0.95  # a workload that both hits and evicts

    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 18 and all(line["block_tokens"] == BLOCK for line in lines)
    assert all(line["kv_bytes_per_token"] == BYTES_PER_TOKEN for line in lines)
    text = log.read_text()
    assert "policy" not in text and '"default"' not in text  # no text, no tenant name

    assert main(["plan", str(log), "--budgets", f"{budget}B", "--ttls", "300s", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    point = next(p for p in out["points"] if p["budget_bytes"] == budget)
    assert out["logged_token_hit_rate"] == server_rate
    assert abs(point["token_hit_rate"] - server_rate) <= 0.01, (point["token_hit_rate"], server_rate)
