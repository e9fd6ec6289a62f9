"""The proxy's request log: one JSON line per request, written off the request path, privacy-safe.

A line holds the time, the tenant as a keyed hash, prompt / cached / output / held token
counts, the server's block size and KV bytes per token, and ``blocks``: one keyed hash per
full block of the tokens the server stores (prompt, plus the answer when it caches answers).
Keys chain like the cache's own block keys (each hashes its parent's key and its block's
token ids), so equal keys at equal positions mean equal prefixes, which is all the planner
needs. The hash is BLAKE2b keyed with a secret (``request_log_key``): without the secret
nothing in the log can be turned back into token ids or text, nor confirmed against a
guessed prompt. No token id, text or tenant name is written.

``record`` only puts a tuple on a bounded queue (a full queue drops the line and counts it);
a writer thread hashes, serialises and appends, rotating the file by size.
"""
from __future__ import annotations

import hashlib
import json
import logging
import queue
import secrets
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from logging.handlers import RotatingFileHandler
from pathlib import Path

log = logging.getLogger(__name__)

#: Lines waiting for the writer; beyond it ``record`` drops (and counts) instead of blocking a request.
QUEUE_SIZE = 4096


class KeyedHasher:
    """BLAKE2b keyed with a secret: tenant ids and chained block keys, 16 hex digits each."""

    def __init__(self, secret: bytes):
        self._key = hashlib.sha256(secret).digest()

    def _hash(self, data: bytes, person: bytes) -> bytes:
        return hashlib.blake2b(data, key=self._key, digest_size=8, person=person).digest()

    def tenant(self, name: str) -> str:
        return self._hash(name.encode("utf-8"), b"tenant").hex()

    def chain(self, tokens: Sequence[int], block_tokens: int) -> list[str]:
        """Keys of the full blocks of ``tokens``; each covers its whole prefix."""
        keys, parent = [], b"root"
        for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
            parent = self._hash(parent + array("q", tokens[start : start + block_tokens]).tobytes(), b"block")
            keys.append(parent.hex())
        return keys


class RequestLog:
    """Appends request lines to ``path`` from a writer thread; ``close`` flushes what is queued."""

    def __init__(self, path: str | Path, *, block_tokens: int, kv_bytes_per_token: int, secret: bytes | None,
                 max_bytes: int, backups: int, clock: Callable[[], float] = time.time, queue_size: int = QUEUE_SIZE):
        if secret is None:
            secret = secrets.token_bytes(32)
            log.warning("request log: no key set; a random one is used, so logs of different runs do not link")
        self.block_tokens, self.kv_bytes_per_token = block_tokens, kv_bytes_per_token
        self.hasher = KeyedHasher(secret)
        self.dropped = 0
        self._clock = clock
        self._queue: queue.Queue = queue.Queue(queue_size)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._thread = threading.Thread(target=self._run, name="prefixcache-request-log", daemon=True)
        self._thread.start()

    def record(self, tenant: str, prompt: Sequence[int], output: Sequence[int], cached_tokens: int,
               held_tokens: int) -> None:
        """Queue one request (never blocks). ``held_tokens``: how many of prompt + output the server stores."""
        try:
            self._queue.put_nowait((self._clock(), tenant, prompt, output, cached_tokens, held_tokens))
        except queue.Full:
            self.dropped += 1

    def line(self, ts: float, tenant: str, prompt: Sequence[int], output: Sequence[int], cached_tokens: int,
             held_tokens: int) -> dict:
        held = (list(prompt) + list(output))[:held_tokens]
        return {"ts": round(ts, 6), "tenant": self.hasher.tenant(tenant), "prompt_tokens": len(prompt),
                "cached_tokens": cached_tokens, "output_tokens": len(output), "held_tokens": len(held),
                "block_tokens": self.block_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
                "blocks": self.hasher.chain(held, self.block_tokens)}

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._handler.close()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                text = json.dumps(self.line(*item), separators=(",", ":"))
                self._handler.emit(logging.LogRecord("prefixcache.requests", logging.INFO, "", 0, text, None, None))
            except Exception:  # noqa: BLE001 - a log line must never take the writer down
                log.exception("request log: could not write a line")
