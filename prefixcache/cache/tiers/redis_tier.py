"""Redis tier: blocks shared by every process that uses the same server, key prefix and hash secret.

Layout (all under the key prefix, ``PREFIX`` by default: its ``{hash tag}`` puts every key in
one cluster slot, as the scripts need; key names are keyed hashes, so they say nothing about
prompts or tenants): ``b:<tenant tag>:<key>`` holds the sealed block, with a Redis expiry when
the block has a TTL; the index is a sorted set ``lru`` (member: ``<tenant tag>:<key>``, score:
last use), a hash ``size`` (member -> bytes) and a counter ``bytes``. One server-side script
writes the payload *before* its index entry and then evicts least recently used blocks until
the tier's byte budget holds, so the budget and the LRU are shared by every process. A purge
finds a tenant's blocks by their names (``SCAN``), not through an index key: Redis' own
``maxmemory`` eviction may drop any key, and a purge must reach every block still there.

A reader asks the index for the longest run of keys in one round trip, then fetches those
payloads a few blocks per reply through a script that checks each value's type and length
first (a value larger than a block can be is refused without being sent), and verifies each
(``BlockCodec.decode``). An index entry whose payload is gone (expired, or evicted by Redis'
own ``maxmemory``) is a miss and is removed; a refused block is deleted and counted.

Any Redis error (unreachable, no answer within ``TIMEOUT_SECONDS``, READONLY after a failover,
OOM, NOPERM, ...) makes the tier *degraded*: every call returns at once as a miss or a failed
write until a retry, after a backoff that doubles from ``BACKOFF_SECONDS`` up to
``MAX_BACKOFF_SECONDS``, succeeds. ``figures`` never raises.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from prefixcache.cache.tiers.base import TierStats, TierUnavailable, lasts
from prefixcache.cache.tiers.codec import BlockCodec, BlockMeta, CorruptBlock

log = logging.getLogger(__name__)
T = TypeVar("T")

PREFIX = "{prefixcache}:kv:"
TIMEOUT_SECONDS = 2.0
#: Blocks fetched per round trip when restoring (each reply stays a few MB).
READ_BATCH = 4
#: Blocks deleted per script call when purging (each call stays short: Redis runs scripts alone).
PURGE_BATCH = 256
BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0
#: The tenant tag of blocks written without one.
NO_TENANT = "_"
_TAG = re.compile(r"[0-9a-f]+|_")
#: What ``_READ`` answers for a key instead of its value.
_MISSING, _REFUSED = 0, 1

# Removes one block and every index entry of it. KEYS: lru, size, bytes. P: the key prefix.
_DROP = """
local P = ARGV[1]
local function drop(member)
  local gone = redis.call('DEL', P .. 'b:' .. member)
  redis.call('ZREM', KEYS[1], member)
  local size = redis.call('HGET', KEYS[2], member)
  if size then
    redis.call('HDEL', KEYS[2], member)
    redis.call('DECRBY', KEYS[3], size)
  end
  return gone
end
"""
# KEYS: lru, size, bytes, payload. ARGV: prefix, member, blob, ttl ms (0: none), now, budget. The SET comes
# first: under OOM it is refused before anything else is written (Redis lets a script that has written once
# go on writing).
_PUT = _DROP + """
if ARGV[4] ~= '0' then
  redis.call('SET', KEYS[4], ARGV[3], 'PX', ARGV[4])
else
  redis.call('SET', KEYS[4], ARGV[3])
end
local old = redis.call('HGET', KEYS[2], ARGV[2])
if old then redis.call('DECRBY', KEYS[3], old) end
local n = string.len(ARGV[3])
redis.call('HSET', KEYS[2], ARGV[2], n)
redis.call('ZADD', KEYS[1], ARGV[5], ARGV[2])
local total = redis.call('INCRBY', KEYS[3], n)
while total > tonumber(ARGV[6]) do
  local victim = redis.call('ZPOPMIN', KEYS[1])
  if #victim == 0 then break end
  drop(victim[1])
  total = tonumber(redis.call('GET', KEYS[3]) or '0')
end
return total
"""
# KEYS: lru, size, bytes. ARGV: prefix, members... Returns the payloads deleted.
_FORGET = _DROP + """
local gone = 0
for i = 2, #ARGV do gone = gone + drop(ARGV[i]) end
return gone
"""
# KEYS: lru, size, bytes. Drops what is left of the index once nothing is indexed (after a purge of all).
_RESET = """
if redis.call('ZCARD', KEYS[1]) == 0 then redis.call('DEL', KEYS[2], KEYS[3]) end
return 1
"""
# KEYS: payloads. ARGV: most bytes. Each value, or 0 (none) or 1 (not a string, or too large: not sent).
_READ = """
local out = {}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'none' then
    out[i] = 0
  elseif kind ~= 'string' or redis.call('STRLEN', key) > tonumber(ARGV[1]) then
    out[i] = 1
  else
    out[i] = redis.call('GET', key)
  end
end
return out
"""


class RedisTier:
    name = "redis"

    def __init__(self, url: str, max_bytes: int, clock: Callable[[], float],
                 monotonic: Callable[[], float] = time.monotonic, timeout: float = TIMEOUT_SECONDS,
                 prefix: str = PREFIX):
        self.stats = TierStats()
        self.max_bytes = max_bytes
        self.prefix = prefix
        self._clock, self._monotonic = clock, monotonic
        # Over TLS the server's certificate and host name are checked (a URL's own query options still win).
        tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True} if url.startswith("rediss://") else {}
        self._client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                            retry=Retry(NoBackoff(), 0), **tls)
        self._scripts = {name: self._client.register_script(body) for name, body in
                         (("put", _PUT), ("forget", _FORGET), ("reset", _RESET), ("read", _READ))}
        self._index = [prefix + name for name in ("lru", "size", "bytes")]
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
        """``op()``, or ``default`` while the server fails (then retried after a backoff)."""
        with self._lock:
            if self._degraded and self._monotonic() < self._retry_at:
                return default
        try:
            result = op()
        except (redis.RedisError, OSError) as exc:  # every server or connection error, READONLY and OOM too
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
    def contains(self, meta: BlockMeta) -> bool:
        now = self._clock()
        left = self._call("exists", lambda: self._client.pttl(self._payload(member(meta))), -2)  # ms; -1: none
        if left is None or left == -2:
            return False
        return lasts(None if left == -1 else now + left / 1000, meta.expires_at)

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
        name = member(meta)
        keys = [*self._index, self._payload(name)]
        sentinel = object()
        done = self._call("write", lambda: self._scripts["put"](
            keys=keys, args=[self.prefix, name, blob, ttl_ms, now, self.max_bytes]), sentinel)
        if done is sentinel:
            raise TierUnavailable("redis tier unavailable")
        return True

    def load_run(self, metas: Sequence[BlockMeta], codec: BlockCodec) -> list[torch.Tensor]:
        if not metas:
            return []
        members = [member(m) for m in metas]

        def scores():
            pipe = self._client.pipeline(transaction=False)
            for member in members:
                pipe.zscore(self._index[0], member)
            return pipe.execute()

        present = self._call("lookup", scores, [])
        run = 0
        while run < len(present) and present[run] is not None:
            run += 1
        out: list[torch.Tensor] = []
        for at in range(0, run, READ_BATCH):  # a few blocks per reply: no reply waits on a whole prefix
            batch = metas[at : min(at + READ_BATCH, run)]
            got = self._call("read", lambda: self._scripts["read"](
                keys=[self._payload(member(m)) for m in batch], args=[codec.max_bytes]), None)
            if got is None or not self._decode(batch, got, codec, out):
                break
        if out:
            now = self._clock()
            self._call("touch", lambda: self._client.zadd(self._index[0], {m: now for m in members[: len(out)]},
                                                          xx=True), 0)
        return out

    def _decode(self, batch: Sequence[BlockMeta], got: list, codec: BlockCodec, out: list[torch.Tensor]) -> bool:
        """Append the verified KV of ``batch`` to ``out``; False at the first unusable block (then deleted)."""
        for meta, blob in zip(batch, got):
            if blob == _MISSING:  # expired or evicted by the server: the index entry is stale
                self._forget(meta)
                return False
            try:
                if blob == _REFUSED:
                    raise CorruptBlock("not a string, or larger than a block can be; refused unread")
                out.append(codec.decode(blob, meta))
            except CorruptBlock as exc:
                log.warning("redis tier: block %s refused (%s); deleted, recomputing", meta.key.hex()[:12], exc)
                self.stats.add("corrupt_entries")
                self._forget(meta)
                return False
        return len(got) == len(batch)

    def _forget(self, meta: BlockMeta) -> None:
        self._call("delete", lambda: self._scripts["forget"](keys=self._index, args=[self.prefix, member(meta)]), 0)

    def purge(self, tenant: str | None) -> int:
        """Delete ``tenant``'s blocks (a ``BlockKeys.tenant_tag``; every block under the prefix when None), found
        by their names, so a block whose index entries Redis dropped is deleted too. Returns the blocks deleted."""
        if tenant is not None and not _TAG.fullmatch(tenant):
            raise ValueError("purge takes a tenant tag (BlockKeys.tenant_tag)")
        pattern = "*" if tenant is None else f"{tenant}:*"
        payloads = _glob_escape(self.prefix + "b:") + pattern

        def run() -> int:
            members = {name.decode()[len(self.prefix) + 2:] for name in self._client.scan_iter(payloads, count=1000)}
            members.update(m.decode() for m, _ in self._client.zscan_iter(self._index[0], match=pattern, count=1000))
            batch, gone = sorted(members), 0
            for at in range(0, len(batch), PURGE_BATCH):  # each script call stays short: Redis runs scripts alone
                gone += int(self._scripts["forget"](keys=self._index, args=[self.prefix, *batch[at : at + PURGE_BATCH]]))
            if tenant is None:
                self._scripts["reset"](keys=self._index)
            return gone

        deleted = self._call("purge", run, None)
        if deleted is None:
            raise TierUnavailable("redis tier unavailable: purge incomplete")
        return deleted

    def figures(self) -> dict[str, Any]:
        def read():
            pipe = self._client.pipeline(transaction=False)
            pipe.get(self._index[2])
            pipe.zcard(self._index[0])
            nbytes, entries = pipe.execute()
            return {"bytes": int(nbytes or 0), "entries": int(entries)}

        try:
            got = self._call("stats", read, None)
        except ValueError:  # a counter that is not a number: report the last figures
            got = None
        if got is not None:
            self._last = got
        return {**self._last, "budget_bytes": self.max_bytes, "degraded": int(self._degraded)}

    def close(self) -> None:
        self._client.close()

    def _payload(self, member: str) -> str:
        return f"{self.prefix}b:{member}"


def member(meta: BlockMeta) -> str:
    """A block's name in the index and (after ``b:``) of its payload: its tenant tag (``_``: none), then its key."""
    return f"{meta.tenant or NO_TENANT}:{meta.key.hex()}"


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a Redis glob pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
