"""Prometheus metrics: every name defined once, here, in a registry owned by one app.

Request-path metrics (counters, histograms) are recorded as requests finish; cache
state (bytes, entries, evictions, hit ratio) and queue depth are read from the engine
at scrape time, so they can never drift from it. Counters are exposed with a
``_total`` suffix and histograms as ``_bucket``/``_sum``/``_count`` series.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from prefixcache.serving.diagnostics import REASONS
from prefixcache.serving.request import CallStats
from prefixcache.serving.stats import CacheReport

CONTENT_TYPE = CONTENT_TYPE_LATEST

# -- every metric name, once ---------------------------------------------------------
REQUESTS = "prefixcache_requests"  # counter{endpoint, tenant, outcome}: hit | partial | miss | bypass
EXECUTOR = "prefixcache_executor_requests"  # counter{executor}: batched | serial
ERRORS = "prefixcache_request_errors"  # counter{route, status}
PROMPT_TOKENS = "prefixcache_prompt_tokens"  # counter{tenant}
CACHED_TOKENS = "prefixcache_cached_tokens"  # counter{tenant}
COMPLETION_TOKENS = "prefixcache_completion_tokens"  # counter{tenant}
CHUNK_TOKENS = "prefixcache_chunk_tokens"  # counter{tenant, kind}: reused | recomputed | stored (marked chunks)
BLENDS = "prefixcache_blend_requests"  # counter{outcome}: blended | prefilled (marked chunks not blended)
TTFT = "prefixcache_time_to_first_token_seconds"  # histogram
TPOT = "prefixcache_time_per_output_token_seconds"  # histogram
LOOKUP = "prefixcache_lookup_seconds"  # histogram
QUEUE_WAIT = "prefixcache_queue_wait_seconds"  # histogram
DURATION = "prefixcache_request_duration_seconds"  # histogram{endpoint}
HIT_RATIO = "prefixcache_hit_ratio"  # gauge{basis}: requests | hits | tokens, since start, cut-short generations included
CACHE_BYTES = "prefixcache_cache_bytes"  # gauge
BUDGET_BYTES = "prefixcache_cache_budget_bytes"  # gauge
PINNED_BYTES = "prefixcache_cache_pinned_bytes"  # gauge
TENANT_BYTES = "prefixcache_cache_tenant_bytes"  # gauge{tenant}
ENTRIES = "prefixcache_cache_entries"  # gauge
KV_BYTES = "prefixcache_kv_bytes"  # gauge{kind}: stored | private | serial | prewarm
KV_TOTAL = "prefixcache_kv_total_bytes"  # gauge: the bound on all KV memory
EVICTIONS = "prefixcache_evictions"  # counter{reason}
RECLAIMED = "prefixcache_reclaimed_bytes"  # counter{reason}
BREAKPOINTS = "prefixcache_breakpoints"  # counter{ttl, event}: read | write | short | dropped
BREAKPOINT_TOKENS = "prefixcache_breakpoint_tokens"  # counter{ttl, kind}: read | write
CACHE_KEY = "prefixcache_prompt_cache_key_requests"  # counter{tenant, outcome}: requests carrying prompt_cache_key
RETENTION = "prefixcache_prompt_cache_retention_requests"  # counter{retention}: in_memory | 24h
MISS_REASONS = "prefixcache_cache_miss_reasons"  # counter{reason}: cache diagnostics' cache_miss_reason types
BATCHING = "prefixcache_batching_enabled"  # gauge: 1 when the batching engine serves, 0 when every call is serial
QUEUE_DEPTH = "prefixcache_queue_depth"  # gauge: admitted, waiting for a worker
RUNNING = "prefixcache_requests_running"  # gauge
# Lower tiers (host, disk, redis), each labelled {tier}: read from the tier chain at scrape time.
TIER_BYTES = "prefixcache_tier_bytes"  # gauge{tier}
TIER_BUDGET = "prefixcache_tier_budget_bytes"  # gauge{tier}
TIER_ENTRIES = "prefixcache_tier_entries"  # gauge{tier}
TIER_DEGRADED = "prefixcache_tier_degraded"  # gauge{tier}: 1 while unreachable (Redis) or full (disk)
TIER_QUEUED = "prefixcache_tier_queued_bytes"  # gauge{tier}: the writer's backlog (shared by the tiers)
TIER_HITS = "prefixcache_tier_hits"  # counter{tier}
TIER_MISSES = "prefixcache_tier_misses"  # counter{tier}
TIER_RESTORES = "prefixcache_tier_restores"  # counter{tier}
TIER_RESTORED_BYTES = "prefixcache_tier_restored_bytes"  # counter{tier}
TIER_WRITE_BACKS = "prefixcache_tier_write_backs"  # counter{tier}
TIER_FAILED_WRITES = "prefixcache_tier_failed_writes"  # counter{tier}
TIER_CORRUPT = "prefixcache_tier_corrupt_entries"  # counter{tier}
TIER_RESTORE_SECONDS = "prefixcache_tier_restore_seconds"  # histogram{tier}

#: Tier counters: (metric name, key in the tier's stats, help).
_TIER_COUNTERS = (
    (TIER_HITS, "hits", "Device misses a tier served (at least one block)."),
    (TIER_MISSES, "misses", "Device misses a tier was asked about and could not serve."),
    (TIER_RESTORES, "restores", "Restores from a tier into the device store."),
    (TIER_RESTORED_BYTES, "restored_bytes", "Bytes of KV restored from a tier."),
    (TIER_WRITE_BACKS, "write_backs", "Blocks written to a tier (evicted, written through, or kept at shutdown)."),
    (TIER_FAILED_WRITES, "failed_writes", "Blocks not written to a tier: the tier failed, or the writer's queue "
     "was full."),
    (TIER_CORRUPT, "corrupt_entries", "Blocks a tier held that failed verification (size, MAC, token ids, model, "
     "dtype, layout or namespace), deleted and recomputed."),
)
_TIER_GAUGES = (
    (TIER_BYTES, "bytes", "Bytes a tier holds."),
    (TIER_BUDGET, "budget_bytes", "Byte budget of a tier."),
    (TIER_ENTRIES, "entries", "Blocks a tier holds."),
    (TIER_DEGRADED, "degraded", "1 while a tier is degraded (Redis unreachable or slow: requests recompute and it "
     "is retried with backoff; disk full: writes stop, reads go on)."),
    (TIER_QUEUED, "queued_bytes", "Bytes of blocks queued for the tiers (written through, evicted or pinned) and not "
     "yet written: the one writer's backlog, the same for every tier; a replica reads from a shared tier only "
     "what has been written."),
)

COUNTERS = (REQUESTS, EXECUTOR, ERRORS, PROMPT_TOKENS, CACHED_TOKENS, COMPLETION_TOKENS, CHUNK_TOKENS, BLENDS,
            EVICTIONS, RECLAIMED, BREAKPOINTS, BREAKPOINT_TOKENS, CACHE_KEY, RETENTION, MISS_REASONS,
            *(name for name, _, _ in _TIER_COUNTERS))
HISTOGRAMS = (TTFT, TPOT, LOOKUP, QUEUE_WAIT, DURATION, TIER_RESTORE_SECONDS)
GAUGES = (HIT_RATIO, CACHE_BYTES, BUDGET_BYTES, PINNED_BYTES, TENANT_BYTES, ENTRIES, KV_BYTES, KV_TOTAL, BATCHING,
          QUEUE_DEPTH, RUNNING, *(name for name, _, _ in _TIER_GAUGES))
NAMES = COUNTERS + HISTOGRAMS + GAUGES

#: Series names as they appear in the exposition (what PromQL and dashboards use).
SERIES = frozenset(
    [f"{n}_total" for n in COUNTERS] + [f"{n}_{s}" for n in HISTOGRAMS for s in ("bucket", "sum", "count")]
    + list(GAUGES))

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_LOOKUP = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
_LONG = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: Returns the engine's state at scrape time: (cache.report() of all tenants, running, waiting); None before load.
StateSource = Callable[[], "tuple[CacheReport, int, int] | None"]


class Metrics:
    """The proxy's metrics in their own ``CollectorRegistry`` (two apps in one process never clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(REQUESTS, "Generations served, by cache outcome: hit (the whole prompt but at most "
                                "its last token came from the cache), partial (some of it did), miss (none did) or "
                                "bypass (the cache was not used). A request of `n` choices counts once, by what its "
                                "one prefill of the prompt read.", ["endpoint", "tenant", "outcome"],
                                registry=r)
        self.executor = Counter(EXECUTOR, "Generations served, by engine: batched (shared steps) or serial.",
                                ["executor"], registry=r)
        self.errors = Counter(ERRORS, "Error responses, by route template and status.", ["route", "status"],
                              registry=r)
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens received.", ["tenant"], registry=r)
        self.cached_tokens = Counter(CACHED_TOKENS, "Prompt tokens served from the prefix cache.", ["tenant"],
                                     registry=r)
        self.completion_tokens = Counter(COMPLETION_TOKENS, "Tokens generated.", ["tenant"], registry=r)
        self.chunk_tokens = Counter(CHUNK_TOKENS, "Prompt tokens of marked chunks (documents): reused from their "
                                    "stored KV at a new place, recomputed in context, or computed alone and stored.",
                                    ["tenant", "kind"], registry=r)
        self.blends = Counter(BLENDS, "Requests with marked chunks: blended, or prefilled (blending off, or the "
                              "model or an option cannot blend; the reason is in the request's stats).",
                              ["outcome"], registry=r)
        self.ttft = Histogram(TTFT, "Time from engine start to the first token.", buckets=_LATENCY, registry=r)
        self.tpot = Histogram(TPOT, "Decode time per output token after the first.", buckets=_PER_TOKEN, registry=r)
        self.lookup = Histogram(LOOKUP, "Prefix lookup and pin time.", buckets=_LOOKUP, registry=r)
        self.queue_wait = Histogram(QUEUE_WAIT, "Time a request waited for a worker.", buckets=_LONG, registry=r)
        self.duration = Histogram(DURATION, "Request time, queue included.", ["endpoint"], buckets=_LONG, registry=r)
        self.cache_key = Counter(CACHE_KEY, "OpenAI requests carrying a prompt_cache_key, by cache outcome.",
                                 ["tenant", "outcome"], registry=r)
        self.retention = Counter(RETENTION, "OpenAI requests carrying a prompt_cache_retention, by value.",
                                 ["retention"], registry=r)
        self.miss_reasons = Counter(MISS_REASONS, "Requests with cache diagnostics (diagnostics.previous_message_id) "
                                    "by why they could not reuse all of the named request's prompt "
                                    "(cache_miss_reason.type).", ["reason"], registry=r)
        for reason in REASONS:  # every reason exposed from the start, at 0
            self.miss_reasons.labels(reason)
        self._state = _EngineCollector()
        r.register(self._state)

    def bind(self, source: StateSource | None) -> None:
        """Read cache and queue state from ``source`` at scrape time (None: not loaded)."""
        self._state.source = source

    def observe(self, endpoint: str, tenant: str, stats: CallStats) -> None:
        outcome = "bypass" if stats.bypass_reason else stats.outcome
        self.requests.labels(endpoint, tenant, outcome).inc()
        self.executor.labels(stats.executor).inc()
        self.prompt_tokens.labels(tenant).inc(stats.prompt_tokens)
        self.cached_tokens.labels(tenant).inc(stats.cached_tokens)
        self.completion_tokens.labels(tenant).inc(stats.completion_tokens)
        for kind, tokens in (("reused", stats.chunk_reused_tokens), ("recomputed", stats.chunk_recomputed_tokens),
                             ("stored", stats.chunk_stored_tokens)):
            if tokens:
                self.chunk_tokens.labels(tenant, kind).inc(tokens)
        if stats.chunk_reused_tokens or stats.chunk_recomputed_tokens or stats.blend_reason:
            self.blends.labels("prefilled" if stats.blend_reason else "blended").inc()
        self.lookup.observe(stats.lookup_seconds)
        if stats.miss_reason is not None:
            self.miss_reasons.labels(stats.miss_reason).inc()
        if stats.ttft_seconds is not None:
            self.ttft.observe(stats.ttft_seconds)
            if stats.completion_tokens > 1:
                self.tpot.observe((stats.total_seconds - stats.ttft_seconds) / (stats.completion_tokens - 1))

    def observe_cache_hints(self, tenant: str, cache_key: str | None, retention: str | None,
                            stats: CallStats) -> None:
        """Count a request's OpenAI cache parameters (the key itself is no label: unbounded values)."""
        if cache_key is not None:
            self.cache_key.labels(tenant, "bypass" if stats.bypass_reason else stats.outcome).inc()
        if retention is not None:
            self.retention.labels(retention).inc()

    def error(self, route: str, status: int) -> None:
        self.errors.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges and counters read from the engine when Prometheus scrapes."""

    def __init__(self) -> None:
        self.source: StateSource | None = None

    def describe(self) -> list[Metric]:
        return []  # names are fixed above; nothing to pre-declare

    def collect(self) -> Iterator[Metric]:
        state = self.source() if self.source is not None else None
        if state is None:
            return
        r, running, waiting = state
        server = r.server
        ratio = GaugeMetricFamily(HIT_RATIO, "Share served from cache since start, by basis: requests, of "
                                  "generations that read any prompt token from it (hit or partial; the chat "
                                  "template's opening every prompt shares is enough, so it nears 1 on unrelated "
                                  "prompts); hits, of generations that read all of the prompt but at most its last "
                                  "token; tokens, of their prompt tokens. Every generation the engine ran, those "
                                  "cut short included (as /v1/cache/stats' hit_rate and token_hit_rate), where "
                                  f"{REQUESTS}_total holds answers delivered.", labels=["basis"])
        ratio.add_metric(["requests"], r.counts.hit_rate)
        ratio.add_metric(["hits"], r.counts.whole_hit_rate)
        ratio.add_metric(["tokens"], r.counts.token_hit_rate)
        yield ratio
        yield GaugeMetricFamily(CACHE_BYTES, "Bytes of KV held.", value=r.bytes)
        yield GaugeMetricFamily(BUDGET_BYTES, "Byte budget of cached KV.", value=r.budget_bytes)
        yield GaugeMetricFamily(PINNED_BYTES, "Bytes held by pinned prefixes.", value=r.pinned_bytes)
        per_tenant = GaugeMetricFamily(TENANT_BYTES, "Bytes of KV held per tenant.", labels=["tenant"])
        for tenant, nbytes in sorted(r.tenant_bytes.items()):
            per_tenant.add_metric([tenant], nbytes)
        yield per_tenant
        yield GaugeMetricFamily(ENTRIES, "Cached blocks (trie nodes).", value=r.entries)
        kv = GaugeMetricFamily(KV_BYTES, "All KV memory, by kind: stored snapshots, and what running requests "
                               "reserve for their buffers (private: batching pools, and on CUDA staging slabs; serial: "
                               "working caches; prewarm).",
                               labels=["kind"])
        for kind, nbytes in server.kv_bytes.items():
            kv.add_metric([kind], nbytes)
        yield kv
        yield GaugeMetricFamily(KV_TOTAL, "The bound on all KV memory together (max_kv_bytes_total).",
                                value=server.kv_total_bytes)
        for name, counts, doc in ((EVICTIONS, r.evictions, "Blocks evicted, by reason."),
                                  (RECLAIMED, r.reclaimed_bytes, "Bytes freed by eviction, by reason.")):
            family = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, value in sorted(counts.items()):
                family.add_metric([reason], value)
            yield family
        events = CounterMetricFamily(BREAKPOINTS, "Cache breakpoints (cache_control; prompt_cache_breakpoint and OpenAI's implicit one) by TTL: read (the whole prefix "
                                     "came from the cache), write (kept now), short (below breakpoint_min_tokens), "
                                     "dropped (not stored: memory pressure).", labels=["ttl", "event"])
        tokens = CounterMetricFamily(BREAKPOINT_TOKENS, "Prompt tokens read from and written at cache breakpoints, "
                                     "by TTL.", labels=["ttl", "kind"])
        for ttl, counts in sorted(r.breakpoints.items()):
            for event, name in (("reads", "read"), ("writes", "write"), ("short", "short"), ("dropped", "dropped")):
                events.add_metric([ttl, name], counts[event])
            tokens.add_metric([ttl, "read"], counts["read_tokens"])
            tokens.add_metric([ttl, "write"], counts["write_tokens"])
        yield events
        yield tokens
        yield GaugeMetricFamily(BATCHING, "1 when the batching engine serves the model, 0 when every request runs "
                                "one at a time on the serial engine (the reason: /readyz, admin cache stats).",
                                value=int(server.batching_enabled))
        yield GaugeMetricFamily(QUEUE_DEPTH, "Requests admitted and waiting for a worker.", value=waiting)
        yield GaugeMetricFamily(RUNNING, "Requests running on a worker.", value=running)
        yield from _tier_families(server.tiers or {})


def _tier_families(tiers: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per-tier gauges, counters and the restore-time histogram (families exist even with no tiers)."""
    for kind, table in ((GaugeMetricFamily, _TIER_GAUGES), (CounterMetricFamily, _TIER_COUNTERS)):
        for name, key, doc in table:
            family = kind(name, doc, labels=["tier"])
            for tier, figures in sorted(tiers.items()):
                family.add_metric([tier], figures[key])
            yield family
    hist = HistogramMetricFamily(TIER_RESTORE_SECONDS, "Time to read and verify the blocks a tier restored.",
                                 labels=["tier"])
    for tier, figures in sorted(tiers.items()):
        h = figures["restore_seconds"]
        hist.add_metric([tier], buckets=list(h["buckets"].items()), sum_value=h["sum"])
    yield hist
