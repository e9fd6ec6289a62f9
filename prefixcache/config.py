"""Cache configuration: one validated dataclass, one source of truth for defaults."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from prefixcache.errors import ConfigError

# Unicode normal forms accepted by ``CacheConfig.unicode_normalization``.
UNICODE_FORMS = ("NFC", "NFKC", "NFD", "NFKD")
#: Without ``max_kv_bytes_total``, running requests may hold this much KV beside a full store at
#: least (more with a large budget: half of it), so a small budget never starves requests.
MIN_REQUEST_KV_BYTES = 256 << 20

#: When blocks are written to the lower tiers (``CacheConfig.tier_write_policy``).
WRITE_POLICIES = ("write-back", "write-through")
#: Without ``tenant_pin_quota_bytes``, a tenant may pin this fraction (1/N) of ``max_bytes``.
PIN_QUOTA_DIVISOR = 8
#: Shortest ``hash_secret`` (UTF-8 bytes): it keys the tiers' block MACs, so it must not be guessable offline.
MIN_HASH_SECRET_BYTES = 32


@dataclass(slots=True)
class CacheConfig:
    """How much KV to keep, for how long, and how requests are canonicalized.

    Every field is checked in ``__post_init__``; a bad value raises ``ConfigError``
    naming the field and its allowed range.
    """

    #: Total bytes of KV snapshots the cache may hold (on the model's device).
    max_bytes: int = 2 << 30
    #: Tokens per stored block. Matching is token-granular whatever the size; blocks bound
    #: hashing work, the size of a copy-on-write split (≤ block_size - 1 duplicated tokens per
    #: branch) and the number of attention calls over a shared prefix in batched decoding.
    block_size: int = 64
    #: Idle time after which a prefix is never matched again and gets freed. None = no TTL.
    ttl_seconds: float | None = 300.0
    #: Per-tenant byte quota. None = only the global budget applies.
    tenant_quota_bytes: int | None = None
    #: Bytes of pinned prefixes a tenant may hold (pins by the operator, ``privileged``, are exempt).
    #: None = ``max_bytes // PIN_QUOTA_DIVISOR`` (1/8 of the budget); set ``max_bytes`` to lift it.
    tenant_pin_quota_bytes: int | None = None
    #: Idle seconds (since the pin or its last read) after which a tenant's pin lapses, whatever the prefix's
    #: TTL: the prefix is then an ordinary entry under that TTL. The operator's pins have no such deadline.
    #: A tenant's pin asked with no TTL or a longer one is also stored with this TTL. None = no deadline.
    pin_ttl_seconds: float | None = 3600.0
    #: All KV memory together: stored snapshots plus what running requests compute into (the batching
    #: engine's private pools, the serial engine's working caches, prewarm buffers). Stored snapshots
    #: give way (unpinned, unread ones are evicted) before a request is made to wait or refused.
    #: None = ``max_bytes`` + the larger of half of it and ``MIN_REQUEST_KV_BYTES`` (256 MiB).
    max_kv_bytes_total: int | None = None
    #: Longest prefix, in tokens, ``warm`` (and the proxy's prewarm) may fill; a longer one is refused
    #: (``ContextLengthExceededError``) before any work. None = the model's context length.
    max_prewarm_tokens: int | None = None
    #: Longest a request waits for KV memory before it is refused (``KVMemoryError``, HTTP 503).
    kv_wait_seconds: float = 5.0
    #: How often the background sweeper frees expired prefixes (seconds).
    sweep_interval_seconds: float = 30.0
    #: Shortest prefix, in tokens, a cache breakpoint (``cache_control`` on a block) keeps for its
    #: TTL; a breakpoint closing a shorter prefix writes nothing and fails nothing. Automatic
    #: prefix reuse is not bounded by it.
    breakpoint_min_tokens: int = 1024
    #: Cache the generated answer with the prompt, so the next chat turn hits.
    cache_generated: bool = True
    #: Reuse the KV of marked chunks (documents) wherever they appear in a prompt, a share of their tokens
    #: recomputed (``blend_recompute_share``); False: marked chunks are prefilled like other text. A request
    #: may turn it off for itself.
    blend: bool = True
    #: Share (0 to 1) of a reused chunk's tokens recomputed in context, those whose KV deviates most from a
    #: full prefill's on an early layer; 1 = a full prefill (docs/benchmarks.md measures the trade).
    blend_recompute_share: float = 0.15
    #: Before tokenizing message content: line breaks become ``\n``, runs of spaces and tabs one
    #: space, spaces at line ends and the text's ends go (opt-in: it changes what the model sees).
    normalize_whitespace: bool = False
    #: Unicode normal form applied to chat content before tokenizing (``NFC``, ``NFKC``, ``NFD``,
    #: ``NFKD``); None leaves the text as sent.
    unicode_normalization: str | None = None
    #: Seed of the block hash chain; None draws a per-process secret.
    hash_seed: int | None = None
    #: Extra namespace component (e.g. a deployment or adapter name).
    namespace_extra: tuple[str, ...] = field(default_factory=tuple)
    #: Bytes of host (CPU) memory for blocks evicted from an accelerator; 0 = no host tier. Ignored
    #: when the model is on the CPU (its KV already lives in host memory).
    tier_host_bytes: int = 0
    #: Directory of the local-disk tier (created if missing); None = no disk tier.
    tier_disk: str | None = None
    #: Byte budget of the disk tier (least recently used blocks go first).
    tier_disk_bytes: int = 16 << 30
    #: URL of the shared Redis tier (``redis://`` or ``rediss://``, credentials in the URL); None = none.
    tier_redis: str | None = None
    #: Byte budget of the Redis tier, shared by every process using the server.
    tier_redis_bytes: int = 4 << 30
    #: When blocks go down to the tiers: ``write-back`` (on eviction and at shutdown) or ``write-through``
    #: (as soon as they are stored). Pinned prefixes are always written through.
    tier_write_policy: str = "write-back"
    #: Bytes of blocks that may wait for the tier writer; beyond it a block is dropped and counted.
    tier_queue_bytes: int = 256 << 20
    #: Encrypt every block written to disk and Redis (AES-256-GCM, a key derived from the hash secret), so they
    #: hold no token ids or KV in the clear. Blocks are MAC-checked either way; readers open both kinds.
    tier_encrypt: bool = False
    #: Prefix of every Redis key of the tier; its ``{hash tag}`` keeps them in one Redis Cluster slot. Deployments
    #: sharing a server but not blocks use different prefixes.
    tier_redis_prefix: str = "{prefixcache}:kv:"
    #: Secret of the tiers' keyed block hashes and block MACs (at least 32 bytes); required with a Redis tier
    #: (processes with the same secret share blocks). None: a disk tier keeps a random secret in its
    #: directory, else per process.
    hash_secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_int("max_bytes", self.max_bytes, 0, None)
        check_int("block_size", self.block_size, 1, 4096)
        if self.ttl_seconds is not None:
            check_positive("ttl_seconds", self.ttl_seconds)
        if self.tenant_quota_bytes is not None:
            check_int("tenant_quota_bytes", self.tenant_quota_bytes, 0, None)
        if self.tenant_pin_quota_bytes is not None:
            check_int("tenant_pin_quota_bytes", self.tenant_pin_quota_bytes, 0, None)
        if self.pin_ttl_seconds is not None:
            check_positive("pin_ttl_seconds", self.pin_ttl_seconds)
        if self.max_kv_bytes_total is not None:
            check_int("max_kv_bytes_total", self.max_kv_bytes_total, 0, None)
        if self.max_prewarm_tokens is not None:
            check_int("max_prewarm_tokens", self.max_prewarm_tokens, 1, None)
        check_positive("kv_wait_seconds", self.kv_wait_seconds)
        check_positive("sweep_interval_seconds", self.sweep_interval_seconds)
        check_int("breakpoint_min_tokens", self.breakpoint_min_tokens, 1, None)
        for name in ("cache_generated", "blend", "normalize_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, getattr(self, name), "True or False")
        check_share("blend_recompute_share", self.blend_recompute_share)
        if self.unicode_normalization is not None and self.unicode_normalization not in UNICODE_FORMS:
            raise ConfigError("unicode_normalization", self.unicode_normalization, f"None or one of {UNICODE_FORMS}")
        if self.hash_seed is not None:
            check_int("hash_seed", self.hash_seed, 0, 2**64 - 1)
        if not isinstance(self.namespace_extra, tuple) or not all(isinstance(s, str) for s in self.namespace_extra):
            raise ConfigError("namespace_extra", self.namespace_extra, "a tuple of strings")
        self._check_tiers()

    def _check_tiers(self) -> None:
        for name in ("tier_host_bytes", "tier_disk_bytes", "tier_redis_bytes", "tier_queue_bytes"):
            check_int(name, getattr(self, name), 0, None)
        if self.tier_disk is not None and (not isinstance(self.tier_disk, str) or not self.tier_disk):
            raise ConfigError("tier_disk", self.tier_disk, "None or a directory path")
        if self.tier_redis is not None and (not isinstance(self.tier_redis, str)
                                            or not self.tier_redis.startswith(("redis://", "rediss://"))):
            raise ConfigError("tier_redis", "<url>", "None or a redis:// or rediss:// URL")
        if self.tier_write_policy not in WRITE_POLICIES:
            raise ConfigError("tier_write_policy", self.tier_write_policy, f"one of {WRITE_POLICIES}")
        if self.hash_secret is not None and (not isinstance(self.hash_secret, str)
                                             or len(self.hash_secret.encode()) < MIN_HASH_SECRET_BYTES):
            raise ConfigError("hash_secret", "<secret>", f"None or a string of at least {MIN_HASH_SECRET_BYTES} "
                              "bytes (e.g. `openssl rand -hex 32`)")
        if not isinstance(self.tier_encrypt, bool):
            raise ConfigError("tier_encrypt", self.tier_encrypt, "True or False")
        if not _redis_prefix_ok(self.tier_redis_prefix):
            raise ConfigError("tier_redis_prefix", self.tier_redis_prefix,
                              "1 to 128 printable ASCII characters without spaces, with a non-empty {hash tag}")
        if self.tier_redis is not None and self.hash_secret is None:
            raise ConfigError("hash_secret", None, "a secret shared by the processes using the Redis tier "
                              "(required with tier_redis)")

    @property
    def kv_total_bytes(self) -> int:
        """The bound on all KV memory in force (``max_kv_bytes_total``, or room for requests beside a full store)."""
        if self.max_kv_bytes_total is not None:
            return self.max_kv_bytes_total
        return self.max_bytes + max(self.max_bytes // 2, MIN_REQUEST_KV_BYTES)

    @property
    def pin_quota_bytes(self) -> int:
        """The per-tenant pin quota in force (``tenant_pin_quota_bytes`` or its default share of the budget)."""
        if self.tenant_pin_quota_bytes is not None:
            return self.tenant_pin_quota_bytes
        return self.max_bytes // PIN_QUOTA_DIVISOR


def _redis_prefix_ok(prefix: object) -> bool:
    if not isinstance(prefix, str) or not 0 < len(prefix) <= 128:
        return False
    if not all(33 <= ord(c) <= 126 for c in prefix):
        return False
    start = prefix.find("{")
    end = prefix.find("}", start + 1)
    return start >= 0 and end > start + 1  # Redis hashes only what the first {...} holds


def check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        raise ConfigError(name, value, f"an integer in [{lo}, {hi if hi is not None else 'inf'}]")


def check_positive(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 and math.isfinite(value)
    if not ok:
        raise ConfigError(name, value, "a finite number > 0")


def check_share(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1
    if not ok:
        raise ConfigError(name, value, "a number in [0, 1]")
