"""Per-system figures for one workload, their ratios to plain ``generate()``, and the issue's targets."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

import numpy as np

from prefixcache.bench.runner import Record, SystemRun, WorkloadRun

#: Targets from the issue (reported, never asserted): one definition each.
TARGET_HIT_OVER_LIMIT = 1.10  # hit TTFT ≤ 1.10 × the bare suffix forward
TARGET_NO_REUSE_OVERHEAD = 0.03  # ≤ 3 % slower than generate() when nothing can be reused
TARGET_VS_GENERATE_BATCH = 3.0  # shared-prefix throughput ≥ 3 × generate_batch with block sharing


@dataclass(slots=True)
class Summary:
    system: str
    requests: int
    output_tokens: int
    ttft_mean: float
    ttft_p50: float
    ttft_p99: float
    tpot: float | None  # mean seconds per output token after the first
    tokens_per_s: float | None  # output tokens / serving time
    requests_per_s: float | None
    hit_rate: float | None  # achieved: cached prompt tokens / prompt tokens
    peak_kv_bytes: int | None  # retained between requests + the largest request in flight (batch: its pool)
    match_vs_generate: float | None  # share of requests whose output equals generate()'s
    ttft_speedup: float | None  # generate()'s mean TTFT / this system's (higher is better)
    throughput_vs_generate: float | None  # this system's tokens/s / generate()'s (higher is better)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(slots=True)
class Targets:
    dtype: str
    hit_over_limit: float | None  # median over hit requests of prefixcache TTFT / limit TTFT (same request)
    hit_over_limit_means: float | None  # ratio of the means over those requests
    hit_ttft: float | None  # prefixcache mean TTFT on hits (shared-prefix)
    limit_ttft: float | None
    cold_over_hit: float | None  # generate() mean TTFT / prefixcache hit mean TTFT
    no_reuse_overhead: float | None  # median over requests of prefixcache time / generate()'s − 1 (no-reuse)
    no_reuse_overhead_wall: float | None  # total serving time ratio − 1 (noisier)
    vs_generate_batch: float | None  # prefixcache tokens/s / generate-batch's (shared-prefix)
    batched_vs_generate_batch: float | None  # prefixcache-batched tokens/s / generate-batch's (shared-prefix)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def summarize(run: WorkloadRun) -> list[Summary]:
    base = run.systems.get("generate")
    base_sum = _summary(base, base) if base is not None else None
    return [_summary(s, base, base_sum) for s in run.systems.values()]


def _summary(s: SystemRun, base: SystemRun | None, base_sum: Summary | None = None) -> Summary:
    ttft = np.array([r.ttft for r in s.records])
    counts = [generated(r) for r in s.records]
    out = sum(counts)
    decodes = [(r.total - r.ttft) / (n - 1) for r, n in zip(s.records, counts, strict=True) if n > 1]
    forward_only = out == 0  # the physical limit: no decode, no throughput
    cached = [r.cached_tokens for r in s.records]
    hit = None if None in cached else sum(cached) / max(1, sum(r.prompt_tokens for r in s.records))
    summary = Summary(
        system=s.name, requests=len(s.records), output_tokens=out, ttft_mean=float(ttft.mean()),
        ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
        tpot=statistics.fmean(decodes) if decodes else None,
        tokens_per_s=None if forward_only else out / s.wall, requests_per_s=None if forward_only else len(
            s.records) / s.wall,
        hit_rate=None if forward_only else hit,
        peak_kv_bytes=None if forward_only or s.retained_peak is None else s.retained_peak + (
            0 if s.batched else s.inflight_peak),
        match_vs_generate=None, ttft_speedup=None, throughput_vs_generate=None)
    if base is not None and base_sum is not None and not forward_only:
        same = sum(_same(a, b) for a, b in zip(s.records, base.records, strict=True))
        summary.match_vs_generate = same / max(1, len(s.records))
        summary.ttft_speedup = base_sum.ttft_mean / summary.ttft_mean
        summary.throughput_vs_generate = summary.tokens_per_s / base_sum.tokens_per_s
    elif base_sum is not None:
        summary.ttft_speedup = base_sum.ttft_mean / summary.ttft_mean
    return summary


def _same(a: Record, b: Record) -> bool:
    """Same answer: as text when both carry it (HTTP answers come as text), else token for token."""
    return a.text == b.text if a.text is not None and b.text is not None else a.output == b.output


def generated(record: Record) -> int:
    """Output tokens of one request: the server's count over HTTP, else the ids returned."""
    return record.completion_tokens if record.completion_tokens is not None else len(record.output)


def ideal_hit_rate(run: WorkloadRun) -> float | None:
    """Achievable by a token-granular cache with unlimited memory, from the actual prompts."""
    return sum(run.ideal_cached) / sum(run.prompt_tokens) if run.prompt_tokens else None


def targets(dtype: str, runs: list[WorkloadRun]) -> Targets:
    by_name = {r.workload: r for r in runs}
    t = Targets(dtype, *([None] * 9))
    shared = by_name.get("shared-prefix")
    if shared is not None and "prefixcache" in shared.systems:
        pc = shared.systems["prefixcache"].records
        hits = [r for r in pc if r.cached_tokens]  # a shared system prompt was reused
        if hits:
            t.hit_ttft = statistics.fmean(r.ttft for r in hits)
            if "generate" in shared.systems:
                t.cold_over_hit = statistics.fmean(r.ttft for r in shared.systems["generate"].records) / t.hit_ttft
        if hits and "limit" in shared.systems:
            limit = {r.index: r.ttft for r in shared.systems["limit"].records}
            t.limit_ttft = statistics.fmean(limit[r.index] for r in hits)
            t.hit_over_limit = statistics.median(r.ttft / limit[r.index] for r in hits)
            t.hit_over_limit_means = t.hit_ttft / t.limit_ttft
    if shared is not None and "generate-batch" in shared.systems:
        tput = {s.system: s.tokens_per_s for s in summarize(shared)}
        if "prefixcache" in tput:
            t.vs_generate_batch = tput["prefixcache"] / tput["generate-batch"]
        if "prefixcache-batched" in tput:
            t.batched_vs_generate_batch = tput["prefixcache-batched"] / tput["generate-batch"]
    unique = by_name.get("no-reuse")
    if unique is not None and {"prefixcache", "generate"} <= set(unique.systems):
        pc, gen = unique.systems["prefixcache"], unique.systems["generate"]
        pairs = zip(pc.records, gen.records, strict=True)  # same requests, run back to back
        t.no_reuse_overhead = statistics.median(a.total / b.total for a, b in pairs) - 1
        t.no_reuse_overhead_wall = pc.wall / gen.wall - 1
    return t
