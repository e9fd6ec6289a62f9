"""Redis tier: blocks shared by every process that uses the same server and hash secret.

Layout (all under ``PREFIX``; key names are keyed hashes, so they say nothing about
prompts or tenants): ``b:<key>`` holds the encoded block, with a Redis expiry when the
block has a TTL; the index is a sorted set ``lru`` (member: key, score: last use), a
hash ``size`` (key -> bytes) and a counter ``bytes``. One server-side script writes the
payload *before* its index entry and then evicts least recently used blocks until the
tier's byte budget holds, so the budget and the LRU are shared by every process.

A reader asks the index for the longest run of keys in one round trip, fetches those
payloads a few blocks per reply and verifies each (``codec.decode``). An index entry whose payload
is gone (expired, or evicted by Redis' own ``maxmemory``) is a miss and is removed.

When the server is down or slow (connection error, or no answer within
``TIMEOUT_SECONDS``), the tier is *degraded*: every call returns at once as a miss or a
failed write until a retry, after a backoff that doubles from ``BACKOFF_SECONDS`` up to
``MAX_BACKOFF_SECONDS``, succeeds.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from prefixcache.cache.tiers.base import TierStats
from prefixcache.cache.tiers.codec import BlockMeta, CorruptBlock, decode

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "prefixcache:kv:"
TIMEOUT_SECONDS = 2.0
#: Blocks fetched per round trip when restoring (each reply stays a few MB).
READ_BATCH = 4
BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0

# KEYS: payload, lru, size, bytes. ARGV: member, blob, ttl ms (0: none), now, budget, payload key prefix.
_PUT = """
if ARGV[3] ~= '0' then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[2])
end
local n = string.len(ARGV[2])
local old = redis.call('HGET', KEYS[3], ARGV[1])
if old then redis.call('DECRBY', KEYS[4], old) end
redis.call('HSET', KEYS[3], ARGV[1], n)
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
local total = redis.call('INCRBY', KEYS[4], n)
while total > tonumber(ARGV[5]) do
  local victim = redis.call('ZPOPMIN', KEYS[2])
  if #victim == 0 then break end
  local size = tonumber(redis.call('HGET', KEYS[3], victim[1]) or '0')
  redis.call('HDEL', KEYS[3], victim[1])
  redis.call('DEL', ARGV[6] .. victim[1])
  total = redis.call('DECRBY', KEYS[4], size)
end
return total
"""
# KEYS: payload, lru, size, bytes. ARGV: member. Removes a block and its index entry.
_FORGET = """
redis.call('DEL', KEYS[1])
local size = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if size then
  redis.call('HDEL', KEYS[3], ARGV[1])
  redis.call('DECRBY', KEYS[4], size)
end
return 1
"""


class RedisTier:
    name = "redis"

    def __init__(self, url: str, max_bytes: int, clock: Callable[[], float],
                 monotonic: Callable[[], float] = time.monotonic, timeout: float = TIMEOUT_SECONDS):
        self.stats = TierStats()
        self.max_bytes = max_bytes
        self._clock, self._monotonic = clock, monotonic
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 0))
        self._put = self._client.register_script(_PUT)
        self._forget_script = self._client.register_script(_FORGET)
        self._index = [PREFIX + "lru", PREFIX + "size", PREFIX + "bytes"]
        self._lock = threading.Lock()
        self._degraded = False
        self._backoff = BACKOFF_SECONDS
        self._retry_at = 0.0
        self._last = {"bytes": 0, "entries": 0}

    # -- failure handling ----------------------------------------------------------
    @property
    def degraded(self) -> bool:
        return self._degraded

    def _call(self, what: str, op: Callable[[], T], default: T) -> T:
        """``op()``, or ``default`` while the server is unreachable (then retried after a backoff)."""
        with self._lock:
            if self._degraded and self._monotonic() < self._retry_at:
                return default
        try:
            result = op()
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            with self._lock:
                if not self._degraded:
                    log.warning("redis tier degraded (%s failed: %s); serving by recompute", what, exc)
                else:
                    self._backoff = min(self._backoff * 2, MAX_BACKOFF_SECONDS)
                self._degraded = True
                self._retry_at = self._monotonic() + self._backoff
            return default
        with self._lock:
            if self._degraded:
                log.warning("redis tier recovered")
            self._degraded, self._backoff = False, BACKOFF_SECONDS
        return result

    # -- tier interface ------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return bool(self._call("exists", lambda: self._client.exists(_payload(key)), 0))

    def put(self, meta: BlockMeta, kv: torch.Tensor, encoded: Callable[[], bytes]) -> bool:
        now = self._clock()
        ttl_ms = 0
        if meta.expires_at is not None:
            ttl_ms = int((meta.expires_at - now) * 1000)
            if ttl_ms <= 0:
                return False
        blob = encoded()
        if len(blob) > self.max_bytes:
            return False
        sentinel = object()
        done = self._call("write", lambda: self._put(keys=[_payload(meta.key), *self._index],
                                                     args=[meta.key.hex(), blob, ttl_ms, now, self.max_bytes,
                                                           PREFIX + "b:"]), sentinel)
        if done is sentinel:
            raise ConnectionError("redis tier unavailable")
        return True

    def load_run(self, metas: Sequence[BlockMeta], dtype: torch.dtype, shape: tuple[int, ...]) -> list[torch.Tensor]:
        if not metas:
            return []
        members = [m.key.hex() for m in metas]

        def scores():
            pipe = self._client.pipeline(transaction=False)
            for member in members:
                pipe.zscore(self._index[0], member)
            return pipe.execute()

        present = self._call("lookup", scores, [])
        run = 0
        while run < len(present) and present[run] is not None:
            run += 1
        if run == 0:
            return []
        blobs: list = []
        for at in range(0, run, READ_BATCH):  # a few blocks per reply: no reply waits on a whole prefix
            got = self._call("read", lambda: self._client.mget([_payload(m.key) for m in metas[at : at + READ_BATCH]]),
                             None)
            if got is None:
                break
            blobs.extend(got)
        out = []
        for meta, blob in zip(metas, blobs):
            if blob is None:  # expired or evicted by the server: the index entry is stale
                self._forget(meta.key)
                break
            try:
                out.append(decode(blob, meta, dtype, shape))
            except CorruptBlock as exc:
                log.warning("redis tier: block %s refused (%s); deleted, recomputing", meta.key.hex()[:12], exc)
                self.stats.add("corrupt_entries")
                self._forget(meta.key)
                break
        if out:
            now = self._clock()
            self._call("touch", lambda: self._client.zadd(self._index[0], {m: now for m in members[: len(out)]},
                                                          xx=True), 0)
        return out

    def _forget(self, key: bytes) -> None:
        self._call("delete", lambda: self._forget_script(keys=[_payload(key), *self._index], args=[key.hex()]), 0)

    def figures(self) -> dict[str, Any]:
        def read():
            pipe = self._client.pipeline(transaction=False)
            pipe.get(self._index[2])
            pipe.zcard(self._index[0])
            nbytes, entries = pipe.execute()
            return {"bytes": int(nbytes or 0), "entries": int(entries)}

        got = self._call("stats", read, None)
        if got is not None:
            self._last = got
        return {**self._last, "budget_bytes": self.max_bytes, "degraded": int(self._degraded)}

    def close(self) -> None:
        self._client.close()


def _payload(key: bytes) -> str:
    return f"{PREFIX}b:{key.hex()}"
