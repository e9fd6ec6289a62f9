"""A real ``redis-server`` for the benchmark and the tests: loopback, a free port, a temporary directory,
no persistence."""
from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from prefixcache.bench.servers import free_port


class RedisServer:
    """One ``redis-server`` process; ``stop`` and ``start`` again keep the port (a restart, data lost)."""

    def __init__(self, directory: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make system-deps` (Debian's redis-server)")
        self.binary, self.directory, self.port = binary, directory, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)
