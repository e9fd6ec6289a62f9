"""Replicas behind a router, as processes on loopback: ``prefixcache serve`` × N and ``sglang-router``.

A ``Fleet`` starts every replica on a free 127.0.0.1 port with the same model folder,
keys and extra flags (``replica_args``: where a shared tier's flags go; ``cli``: what runs
the CLI, a test's wrapper of it included), and stops them;
``router`` starts ``sglang-router`` in front of them with explicit worker URLs and
loopback binds. ``shared_redis`` starts the ``redis-server`` replicas share a KV tier
through (``SharedTier``). The replicas measurement (``benchmarks.replicas``) and
the end-to-end tests both run on it.
"""
from __future__ import annotations

import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from prefixcache.bench.servers import Server, ServerError, free_port
from tests.support.redis_server import RedisServer

#: The admin key every replica of a fleet shares (loopback only; the admin fan-out uses it).
ADMIN_KEY = "sk-fleet-admin"
#: Seconds a replica may take to start: generous, for a machine other jobs share.
START_TIMEOUT = 600.0
#: The hash secret every replica of a fleet sharing a tier gets (in its environment, as in deploy/replicas/).
HASH_SECRET = "fleet-shared-tier-secret-of-32-bytes"
#: Replicas sharing a tier write through: a prefix reaches Redis as soon as one replica caches it.
#: Under write-back it would go down only when evicted (or at a clean shutdown), so the other replicas
#: would miss it meanwhile, and a killed replica would take it with it.
TIER_WRITE_POLICY = "write-through"
#: A tiny random Llama over the default tokenizer's vocabulary: chat templates work, answers take milliseconds.
TINY_CHAT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096)


def tiny_chat_folder(tokenizer, dest: Path, seed: int = 0) -> Path:
    """Save a tiny random Llama with ``tokenizer`` (and its chat template) to ``dest``; returns ``dest``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **TINY_CHAT)).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    return dest


def router_command() -> list[str]:
    """``sglang-router`` of this interpreter's environment (else ``python -m sglang_router.launch_router``)."""
    script = Path(sys.executable).parent / "sglang-router"
    if script.exists():
        return [str(script), "launch"]
    found = shutil.which("sglang-router")
    return [found, "launch"] if found else [sys.executable, "-m", "sglang_router.launch_router"]


@dataclass(slots=True)
class Router:
    """One ``sglang-router`` process; ``metrics_url`` is its separate Prometheus port."""

    server: Server
    metrics_port: int
    policy: str

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def workers(self) -> list[dict]:
        """The router's view of its workers (``GET /workers``)."""
        return httpx.get(self.url + "/workers", timeout=5).json()["workers"]


@dataclass(slots=True)
class Fleet:
    """N replicas of one model folder. Use ``with fleet(...)``: every process is stopped on exit."""

    folder: str
    keys: dict[str, str]  # API key -> tenant, the same on every replica
    replica_args: Sequence[str] = ()
    replica_env: dict[str, str] = field(default_factory=dict)  # added to every replica's environment
    workers: int = 4
    threads: int | None = 1
    cli: Sequence[str] = (sys.executable, "-m", "prefixcache.cli")  # what runs a replica's ``prefixcache`` CLI
    replicas: list[Server] = field(default_factory=list)
    routers: list[Router] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start_replica(self) -> Server:
        port = free_port()
        argv = [*self.cli, "serve", "--model", self.folder, "--host", "127.0.0.1", "--port", str(port),
                "--admin-key", ADMIN_KEY, "--workers", str(self.workers),
                "--default-temperature", "0", "--ttl-seconds", "none", "--log-level", "warning",
                *[f"--api-key={key}={tenant}" for key, tenant in self.keys.items()], *self.replica_args]
        if self.threads is not None:
            argv += ["--torch-threads", str(self.threads)]
        server = Server(f"replica {len(self.replicas)}", argv, "/health", self.threads)
        server.env.update(self.replica_env)
        self.replicas.append(server)
        server.start(port, START_TIMEOUT)
        return server

    def router(self, policy: str = "cache_aware", *, balance_abs_threshold: int = 4,
               extra: Sequence[str] = ()) -> Router:
        """Start ``sglang-router`` in front of every replica; returns once it lists them all healthy."""
        port, metrics_port = free_port(), free_port()
        argv = [*router_command(), "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port), "--policy", policy, "--worker-urls", *self.urls,
                "--balance-abs-threshold", str(balance_abs_threshold), "--health-check-interval-secs", "1",
                "--health-failure-threshold", "2", "--log-level", "warn", *extra]
        router = Router(Server(f"sglang-router ({policy})", argv, "/readiness"), metrics_port, policy)
        self.routers.append(router)
        router.server.start(port)
        wait_for(lambda: len(healthy(router)) == len(self.replicas), 60, f"{policy} router to list every replica")
        return router

    def kill(self, replica: Server) -> None:
        """SIGKILL: the replica dies mid-request, as a crashed process would."""
        if replica.proc is not None and replica.proc.poll() is None:
            replica.proc.send_signal(signal.SIGKILL)
            replica.proc.wait(10)

    def stop(self) -> None:
        for process in [*(r.server for r in self.routers), *self.replicas]:
            process.stop()


def healthy(router: Router) -> list[str]:
    """URLs of the workers the router currently sends requests to."""
    try:
        return [w["url"] for w in router.workers() if w.get("is_healthy", True)]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise ServerError(f"timed out after {timeout:.0f} s waiting for the {what}")
        time.sleep(interval)


@contextmanager
def fleet(folder: str, keys: dict[str, str], replicas: int = 2, **kwargs) -> Iterator[Fleet]:
    """Start ``replicas`` replicas of ``folder``; stop them (and any router started on it) on exit."""
    running = Fleet(folder, keys, **kwargs)
    try:
        for _ in range(replicas):
            running.start_replica()
        yield running
    finally:
        running.stop()


@dataclass(frozen=True, slots=True)
class SharedTier:
    """What replicas share below their devices: nothing (``server`` None), or one Redis tier."""

    server: RedisServer | None = None

    @property
    def name(self) -> str:
        return "none" if self.server is None else "redis"

    @property
    def replica_args(self) -> tuple[str, ...]:
        if self.server is None:
            return ()
        return ("--tier-redis", self.server.url, "--tier-write-policy", TIER_WRITE_POLICY)

    @property
    def replica_env(self) -> dict[str, str]:
        """The hash secret, in the environment (as a deployment passes it) rather than on a command line."""
        return {} if self.server is None else {"PREFIXCACHE_HASH_SECRET": HASH_SECRET}

    def clear(self) -> None:
        """Drop every block of the shared tier (a run that starts from flushed caches flushes this too)."""
        if self.server is not None:
            client = self.server.client()
            try:
                client.flushdb()
            finally:
                client.close()


@contextmanager
def shared_redis(enabled: bool = True) -> Iterator[SharedTier]:
    """A ``redis-server`` on a free loopback port in a temporary directory, stopped on exit (or no tier)."""
    if not enabled:
        yield SharedTier()
        return
    with tempfile.TemporaryDirectory(prefix="prefixcache-fleet-redis-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            yield SharedTier(server)
        finally:
            server.stop()


@contextmanager
def tiny_model_folder(tokenizer) -> Iterator[str]:
    """A temporary folder holding the tiny chat model (see ``tiny_chat_folder``)."""
    with tempfile.TemporaryDirectory(prefix="prefixcache-fleet-model-") as tmp:
        yield str(tiny_chat_folder(tokenizer, Path(tmp)))
