"""Soak: ``prefixcache serve`` with two tenant keys, one well-behaved and one hostile.

``python -m benchmarks.soak [--model tiny|default|PATH] [--requests N]`` starts the
proxy as a subprocess on loopback and runs two phases in one invocation:

1. **alone**: the well-behaved tenant's streamed chats on a shared system prompt;
2. **mixed**: the same chats again (its cache flushed first, so both phases start cold)
   while the hostile tenant, from a process of its own, cycles through every hostile case
   (``bench.hostile``: the cases the hardening work was built against) and drops streams
   mid-way. ``--rounds N`` alternates the two phases N times.

Every request has a client deadline. The report: responses by status (5xx must be 0),
hung requests (0), the well-behaved tenant's token hit rate, TTFT p50 and time to the response
headers per phase and their ratios, the server's and the clients' CPU seconds per phase, what the admin stats audit reads at idle (refcounts 0, stored bytes equal to
live tensor bytes, nothing reserved in flight), and the server's peak RSS (``VmHWM``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from benchmarks.hostile import ADMIN, GOOD, KEYS, HostileProcess, Tally, case_names, run_hostile
from prefixcache.bench.servers import Server, free_port

SYSTEM = ("You are the support assistant of a parcel delivery company. Answer in one short sentence, "
          "politely, and never promise a delivery date. ") * 12
QUESTIONS = ["Where is my parcel?", "How long do refunds take?", "Can I change the address?",
             "Do you deliver on Sundays?", "What does the tracking code mean?", "Who signs for the parcel?"]


# -- the well-behaved tenant -------------------------------------------------------------
def good_chat(client: httpx.Client, model: str, i: int, tally: Tally, deadline: float) -> None:
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
    start = time.perf_counter()
    first, usage = None, None
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, timeout=deadline) as r:
            headers = time.perf_counter() - start  # sent once the server encoded the prompt and queued it
            if r.status_code != 200:
                r.read()
                tally.status(r.status_code)
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally.status(f"stream-error-{event['error'].get('code')}")
                    return
                if first is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    first = time.perf_counter() - start
                usage = event.get("usage") or usage
    except httpx.TimeoutException:
        tally.timed_out()
        return
    tally.status(200)
    with tally.lock:
        if first is not None:
            tally.ttft.append(first)
            tally.headers.append(headers)
        if usage:
            tally.prompt_tokens += usage["prompt_tokens"]
            tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]


# -- the run ---------------------------------------------------------------------------------
def run_phase(url: str, model: str, good_requests: int, hostile_requests: int, context: int,
              opts: argparse.Namespace, server_pid: int) -> tuple[Tally, Tally, dict[str, float]]:
    """The good tenant's ``good_requests`` chats (2 clients), with the hostile tenant's traffic
    (``opts.hostile_clients``) running alongside, when ``hostile_requests`` > 0, until both are done.
    Also returns the phase's wall, server CPU and client CPU seconds."""
    good, deadline = Tally(), opts.deadline
    hostile = hostile_requests > 0 and opts.hostile_clients > 0
    only = opts.hostile_cases.split(",") if opts.hostile_cases else None
    args = (url, model, context, hostile_requests, opts.hostile_clients, deadline, opts.seed)
    proc = HostileProcess(*args, only=only) if hostile and not opts.hostile_in_process else None
    if proc is not None:
        proc.start()
    done = threading.Event()

    def good_worker(ids: range) -> None:
        with httpx.Client(base_url=url, headers={"authorization": f"Bearer {GOOD}"}) as client:
            for i in ids:
                good_chat(client, model, i, good, deadline)

    wall, server_cpu, client_cpu = time.perf_counter(), cpu_seconds(server_pid), time.process_time()
    with ThreadPoolExecutor(3, thread_name_prefix="prefixcache-bench-soak") as pool:
        evil = pool.submit(run_hostile, *args, stop=done, only=only) if hostile and proc is None else None
        for f in [pool.submit(good_worker, range(k, good_requests, 2)) for k in range(2)]:
            f.result()
        done.set()
        tally, hostile_cpu = proc.result() if proc is not None else (evil.result() if evil else Tally(), 0.0)
    usage = {"wall_s": time.perf_counter() - wall, "server_cpu_s": cpu_seconds(server_pid) - server_cpu,
             "client_cpu_s": time.process_time() - client_cpu + hostile_cpu}
    return good, tally, {k: round(v, 2) for k, v in usage.items()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread), from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def phase_report(good: Tally, usage: dict[str, float]) -> dict[str, Any]:
    return {"requests": sum(good.statuses.values()) + good.hung, "statuses": dict(good.statuses), "hung": good.hung,
            "token_hit_rate": good.cached_tokens / good.prompt_tokens if good.prompt_tokens else 0.0,
            "ttft_p50_s": statistics.median(good.ttft) if good.ttft else None,
            # Headers come once the prompt is encoded and queued: before them, the proxy's admission; after, the engine.
            "headers_p50_s": statistics.median(good.headers) if good.headers else None, **usage}


def idle_audit(url: str) -> dict[str, Any]:
    """The admin stats once the server is idle (queue empty), with the store walked."""
    with httpx.Client(base_url=url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60) as admin:
        for _ in range(600):
            stats = admin.get("/v1/cache/stats", params={"audit": "true"}).json()
            if stats["queue"]["running"] == 0 and stats["queue"]["waiting"] == 0 and stats["refcounts"] == 0:
                break
            time.sleep(0.1)
    in_flight = {k: v for k, v in stats["kv_bytes"].items() if k != "stored"}
    return {"refcounts": stats["refcounts"], "stored_bytes": stats["bytes"],
            "live_tensor_bytes": stats["live_tensor_bytes"], "in_flight_kv_bytes": in_flight,
            "pinned_bytes": stats["pinned_bytes"], "tenant_bytes": stats["tenant_bytes"]}


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def tiny_model_folder(folder: str) -> None:
    """A 2-layer random Llama over the default model's tokenizer (chat template included), saved to ``folder``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from prefixcache.loading import default_cache_dir, find_default_gguf, load_default_model

    # The tokenizer only: from the converted copy when it exists (loading the model costs far more).
    folders = sorted(default_cache_dir().glob(f"{find_default_gguf().stem}-*/tokenizer_config.json"))
    tokenizer = AutoTokenizer.from_pretrained(folders[-1].parent) if folders else load_default_model()[1]
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    tmp = tempfile.TemporaryDirectory(prefix="prefixcache-soak-") if opts.model == "tiny" else None
    port = free_port()
    max_bytes = opts.max_bytes or ((16 << 20) if opts.model == "tiny" else (512 << 20))
    argv = [sys.executable, "-m", "prefixcache.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--served-model-name", "soak", "--log-level", "warning", "--request-timeout-seconds",
            str(opts.deadline / 2), "--max-bytes", str(max_bytes), *opts.server_arg]
    if tmp is not None:
        tiny_model_folder(tmp.name)
        argv += ["--model", tmp.name]
    elif opts.model != "default":
        argv += ["--model", opts.model]
    server = Server("prefixcache serve", argv, "/readyz")
    server.env.update(PREFIXCACHE_API_KEYS=json.dumps(KEYS), PREFIXCACHE_ADMIN_KEY=ADMIN)
    try:
        server.start(port, timeout=opts.ready_timeout)
        context = 2048 if opts.model == "tiny" else opts.context
        good_n = max(2, opts.requests // 4)
        hostile_n = max(0, opts.requests - 2 * good_n)
        rounds = max(1, min(opts.rounds, good_n // 2))
        started = time.perf_counter()
        pid = server.proc.pid
        alone, mixed, evil = Tally(), Tally(), Tally()
        alone_usage: Counter[str] = Counter()
        mixed_usage: Counter[str] = Counter()
        round_ratios = []
        for k in range(rounds):  # alone, then mixed, in turn: a change of the machine's load hits both
            share = good_n // rounds + (k < good_n % rounds)
            with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60) as admin:
                admin.delete("/v1/cache", params={"tenant": "good"})  # every phase starts cold
            a, _, usage = run_phase(server.url, "soak", share, 0, context, opts, pid)
            alone_usage.update(usage)
            with httpx.Client(base_url=server.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60) as admin:
                admin.delete("/v1/cache", params={"tenant": "good"})
            m, e, usage = run_phase(server.url, "soak", share, hostile_n // rounds, context, opts, pid)
            mixed_usage.update(usage)
            if a.ttft and m.ttft:
                round_ratios.append(round(statistics.median(m.ttft) / statistics.median(a.ttft), 3))
            for total, part in ((alone, a), (mixed, m), (evil, e)):
                total.merge(part)
        seconds = time.perf_counter() - started
        audit = idle_audit(server.url)
        rss = peak_rss_bytes(server.proc.pid)
        if not server.alive():
            raise RuntimeError(f"the server died during the soak{server.tail()}")
    finally:
        server.stop()
        if tmp is not None:
            tmp.cleanup()
    statuses = Counter(alone.statuses) + Counter(mixed.statuses) + Counter(evil.statuses)
    a = phase_report(alone, {k: round(v, 2) for k, v in alone_usage.items()})
    m = phase_report(mixed, {k: round(v, 2) for k, v in mixed_usage.items()})
    return {
        "model": opts.model, "seconds": round(seconds, 1),
        "requests": sum(statuses.values()) + alone.hung + mixed.hung + evil.hung,
        "statuses": dict(sorted(statuses.items())),
        "responses_5xx": sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500),
        "hung": alone.hung + mixed.hung + evil.hung,
        "hostile": {"requests": sum(evil.statuses.values()) + evil.hung, "statuses": dict(sorted(evil.statuses.items())),
                    "cases": dict(sorted(evil.cases.items()))},
        "good_alone": a, "good_mixed": m,
        "hit_rate_ratio": m["token_hit_rate"] / a["token_hit_rate"] if a["token_hit_rate"] else None,
        "ttft_p50_ratio": m["ttft_p50_s"] / a["ttft_p50_s"] if a["ttft_p50_s"] and m["ttft_p50_s"] else None,
        "rounds": rounds, "round_ttft_p50_ratios": round_ratios,
        "idle": audit, "server_peak_rss_bytes": rss,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny (a 2-layer random Llama, CI scale), default (the "
                        "embedded SmolLM2-135M) or a model folder")
    parser.add_argument("--requests", type=int, default=1000, help="requests in all: a quarter are the "
                        "well-behaved tenant's per phase, the rest hostile")
    parser.add_argument("--deadline", type=float, default=120.0, help="client deadline per request (s); the "
                        "server's request timeout is half of it")
    parser.add_argument("--context", type=int, default=8192, help="the model's context (for the cases beyond it)")
    parser.add_argument("--max-bytes", type=int, default=None, help="the server's store budget (default: 16 MiB "
                        "for tiny, 512 MiB otherwise; a tenant may pin 1/8 of it)")
    parser.add_argument("--hostile-clients", type=int, default=2, help="concurrent clients of the hostile "
                        "tenant (the well-behaved one has 2)")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the alone and mixed phases this many "
                        "times (the requests shared out), so a change of a shared machine's load hits both phases")
    parser.add_argument("--hostile-cases", default=None, help="comma-separated hostile cases to send (default: "
                        f"all): {', '.join(case_names())}")
    parser.add_argument("--hostile-in-process", action="store_true", help="send the hostile tenant's requests from "
                        "threads of this process (default: a process of its own, whose GIL and CPU time building "
                        "bodies are not those of the client timing the well-behaved tenant)")
    parser.add_argument("--server-arg", action="append", default=[], help="one more argument for `prefixcache "
                        "serve` (repeat it: --server-arg=--tenant-rate-limit --server-arg=20)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds the server may take to start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the report here too")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    report = run(opts)
    text = json.dumps(report, indent=1)
    print(text)
    if opts.json:
        with open(opts.json, "w") as f:
            f.write(text + "\n")
    idle = report["idle"]
    ok = (report["responses_5xx"] == 0 and report["hung"] == 0 and idle["refcounts"] == 0
          and idle["stored_bytes"] == idle["live_tensor_bytes"] and not any(idle["in_flight_kv_bytes"].values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
