"""Runs every workload against every system in one process and checks the answers agree.

Sequential systems are interleaved request by request, in an order that rotates per
request, so background noise lands on all of them alike. They serve the first half of
a workload's requests, then the batch systems take the whole workload round by round,
then the HTTP systems (a server subprocess each, fed by a pool of streaming clients) the
same way, and then the sequential systems serve the second half: the halves bracket the
batch runs, so a steady drift of the machine's speed over the minutes of a run weighs on
the ratios between them alike. With ``--warmup-requests N`` each system first serves the
first N session-opening requests untimed (SGLang's bench_serving warms up this way and keeps
its cache). After each request, prefixcache's output must equal plain
``generate()``'s token for token (same greedy workload); otherwise the run stops.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from prefixcache.bench import models, workloads
from prefixcache.bench.batch import GenerateBatch
from prefixcache.bench.concurrent import PrefixCacheBatched
from prefixcache.bench.http import HttpHarness, HttpServed
from prefixcache.bench.options import BATCH_SYSTEMS, HTTP_SYSTEMS, BenchOptions
from prefixcache.bench.systems import (
    SEQUENTIAL,
    PlainGenerate,
    PrefixCacheSystem,
    Served,
    kv_bytes_per_token,
)
from prefixcache.bench.workloads import Request, Workload

Progress = Callable[[int], None]


#: Token identity with generate() is asserted in float32. In reduced precision a cached
#: prefix changes the order of roundings, so greedy answers may part after a near-tie;
#: transformers' own deepcopy reuse parts from generate() the same way. There the
#: agreement is reported (the `= generate()` column), not asserted.
STRICT_DTYPE = "float32"


class CorrectnessError(RuntimeError):
    """prefixcache and plain generate() disagreed on a greedy answer."""


@dataclass(slots=True)
class Record:
    index: int
    prompt_tokens: int
    output: tuple[int, ...]
    ttft: float
    total: float
    cached_tokens: int | None
    completion_tokens: int | None = None  # HTTP: the server's count (output = the streamed text re-encoded)
    text: str | None = None  # HTTP: the streamed answer; generate(): its output decoded, to compare with it


@dataclass(slots=True)
class SystemRun:
    name: str
    records: list[Record] = field(default_factory=list)
    wall: float = 0.0  # seconds serving: sum over requests, or over batch calls
    retained_peak: int | None = 0  # KV bytes kept between requests, max over the run; None: unknown
    inflight_peak: int = 0  # KV bytes of the largest request being served
    batched: bool = False  # a batch system: retained_peak is its peak KV during a call
    notes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WorkloadRun:
    workload: str
    dtype: str
    systems: dict[str, SystemRun]
    prompt_tokens: list[int]  # per request, as plain generate() saw them
    ideal_cached: list[int]  # per request: the most any token-granular cache could reuse
    formula_hit_rate: float | None
    #: (moment, ms of ``models.speed_probe``) at the start, around each batch/HTTP run, at the end
    speed: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class BenchResult:
    options: BenchOptions
    runs: list[WorkloadRun]
    models: dict[str, str]  # dtype -> model label
    bytes_per_token: dict[str, int]  # dtype -> KV bytes per token
    machine: dict[str, object]
    load_after: list[float] | None = None
    elapsed: float = 0.0
    notes: list[str] = field(default_factory=list)  # run-wide (e.g. how HTTP prompts were drawn)


def run_benchmark(opts: BenchOptions, progress: Progress, clock: Callable[[], float] = time.perf_counter,
                  ) -> BenchResult:
    """Every dtype × workload × system. Raises ``CorrectnessError`` if prefixcache ever
    answers differently from plain ``generate()``."""
    start = clock()
    result = BenchResult(opts, [], {}, {}, models.machine())
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    for dtype in opts.dtypes:
        mut = models.load(opts, dtype)
        harness = HttpHarness(opts, mut.model, dtype) if set(opts.systems) & set(HTTP_SYSTEMS) else None
        try:
            space = mut.space if harness is None else harness.text_space(mut.space)
            built = [workloads.build(name, opts, space) for name in opts.workloads]
            if harness is not None:
                harness.plan(built)
            _warm_up(mut.model, max((len(r.new_tokens) for w in built for r in w.requests), default=1))
            bpt = kv_bytes_per_token(mut.model)
            result.models[dtype], result.bytes_per_token[dtype] = mut.label, bpt
            result.runs += [run_workload(opts, mut.model, dtype, w, bpt, progress, harness) for w in built]
        finally:
            if harness is not None:
                harness.close()
                result.notes += [f"{dtype}: {n}" for n in harness.notes]
        del mut
    result.load_after = models.machine()["load_average"]
    result.elapsed = clock() - start
    return result


def total_steps(opts: BenchOptions) -> int:
    """Requests served over the whole run (for the progress bar)."""
    per_dtype = 0
    for name in opts.workloads:
        seq = [n for n in opts.systems if n in SEQUENTIAL and (n != "limit" or name == "shared-prefix")]
        rounds = sum(n in BATCH_SYSTEMS or n in HTTP_SYSTEMS for n in opts.systems)
        per_dtype += opts.spec(name).requests * (len(seq) + rounds)
    return per_dtype * len(opts.dtypes)


def run_workload(opts: BenchOptions, model: torch.nn.Module, dtype: str, workload: Workload, bpt: int,
                 progress: Progress, harness: HttpHarness | None = None) -> WorkloadRun:
    seq = {n: SEQUENTIAL[n](model, opts.output_tokens) for n in opts.systems if n in SEQUENTIAL}
    seq = {n: s for n, s in seq.items() if s.applies(workload)}
    runs = {n: SystemRun(n) for n in seq}
    reference = next((n for n in ("generate", "prefixcache", "manual-reuse") if n in seq), None)
    prompts: list[int] = []
    ideal: list[int] = []
    histories: dict[str, dict[str, list[int]]] = {n: {} for n in seq}
    warm = warmup_requests(workload, opts.warmup_requests)
    # the reference's prompt + answer sequences so far (warm-up prompts count: a cache may hold them)
    finished: list[list[int]] = [list(r.new_tokens) for r in warm]
    requests = workload.requests if seq else ()  # none: only batch/HTTP systems were chosen
    half = len(requests) // 2
    speed: list[tuple[str, float]] = []

    def serve_sequential(req: Request) -> None:
        names = list(seq)
        k = req.index % len(names)
        for name in names[k:] + names[:k]:
            prompt = histories[name].get(req.session, []) + list(req.new_tokens)
            served = seq[name].serve(req, prompt)
            histories[name][req.session] = prompt + list(served.output)
            _record(runs[name], req, prompt, served, (len(prompt) + opts.output_tokens) * bpt)
            runs[name].retained_peak = max(runs[name].retained_peak, seq[name].retained_bytes())
            progress(1)
            if name == reference:
                prompts.append(len(prompt))
                ideal.append(workloads.ideal_cached(prompt, finished))
                finished.append(histories[name][req.session])
        if dtype == STRICT_DTYPE:
            _check(workload, req, runs)

    for s in seq.values():
        s.start(workload)
    try:
        for s in seq.values():
            for r in warm:  # untimed, unrecorded
                s.serve(r, list(r.new_tokens))
        speed.append(("start", models.speed_probe()))
        for req in requests[:half]:
            serve_sequential(req)
        # The batch runs, bracketed by the two halves (see the module's docstring). They add
        # their runs after the sequential ones, the order the report shows.
        for name in (n for n in opts.systems if n in BATCH_SYSTEMS or n in HTTP_SYSTEMS):
            speed.append((f"before {name}", models.speed_probe()))
            runs[name] = _run_batch(name, model, opts, workload, bpt, progress, harness)
            speed.append((f"after {name}", models.speed_probe()))
        for req in requests[half:]:
            serve_sequential(req)
        speed.append(("end", models.speed_probe()))
    finally:
        for s in seq.values():
            s.finish()
    if harness is not None and "generate" in runs:  # HTTP answers are compared as text (ids do not round-trip)
        for rec in runs["generate"].records:
            rec.text = harness.decode(rec.output)
    return WorkloadRun(workload.name, dtype, runs, prompts, ideal, workload.formula_hit_rate, speed)


def warmup_requests(workload: Workload, n: int) -> list[Request]:
    """The first ``n`` requests that open a session (their prompt is their own tokens): what a
    system serves untimed before its timed run with ``--warmup-requests n``."""
    return [r for r in workload.requests if r.round == 0][:n]


def _record(run: SystemRun, req: Request, prompt: list[int], served: Served, inflight: int) -> None:
    run.records.append(Record(req.index, len(prompt), served.output, served.ttft, served.total, served.cached_tokens))
    run.wall += served.total
    run.inflight_peak = max(run.inflight_peak, inflight)


def _check(workload: Workload, req: Request, runs: dict[str, SystemRun]) -> None:
    if "prefixcache" not in runs or "generate" not in runs:
        return
    got, want = runs["prefixcache"].records[-1], runs["generate"].records[-1]
    if got.output != want.output:
        pairs = zip(got.output, want.output, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(got.output), len(want.output)))
        raise CorrectnessError(
            f"{workload.name} request {req.index} (session {req.session}, {got.prompt_tokens} prompt tokens, "
            f"{got.cached_tokens} cached): prefixcache output differs from plain generate() at output token {first}:"
            f"\n  prefixcache: {list(got.output)}\n  generate():  {list(want.output)}")


def _run_batch(name: str, model: torch.nn.Module, opts: BenchOptions, workload: Workload, bpt: int,
               progress: Progress, harness: HttpHarness | None = None) -> SystemRun:
    """One call per round (a multi-turn round needs the previous round's answers)."""
    if name in HTTP_SYSTEMS:
        system = harness.system(name)
    elif name == "prefixcache-batched":
        system = PrefixCacheBatched(model, opts.output_tokens, opts.concurrency)
    else:
        system = GenerateBatch(model, opts.output_tokens, sharing=name == "generate-batch",
                               max_batch_tokens=opts.cb_max_batch_tokens, bytes_per_token=bpt)
    run = SystemRun(name, batched=True)
    history: dict[str, list[int]] = {}
    by_index: dict[int, Record] = {}
    system.start()
    try:
        warm = warmup_requests(workload, opts.warmup_requests)
        if warm:
            system.call([list(r.new_tokens) for r in warm])  # untimed, unrecorded
        for batch in workload.rounds():
            prompts = [history.get(r.session, []) + list(r.new_tokens) for r in batch]
            call = system.call(prompts)
            run.wall += call.wall
            run.retained_peak = None if call.kv_bytes is None else max(run.retained_peak or 0, call.kv_bytes)
            for req, prompt, served in zip(batch, prompts, call.served, strict=True):
                history[req.session] = prompt + list(served.output)
                http = isinstance(served, HttpServed)
                by_index[req.index] = Record(req.index, served.prompt_tokens if http else len(prompt), served.output,
                                             served.ttft, served.total, served.cached_tokens,
                                             served.completion_tokens if http else None,
                                             served.text if http else None)
                run.inflight_peak = max(run.inflight_peak, (len(prompt) + opts.output_tokens) * bpt)
            progress(len(batch))
    finally:
        system.finish()
    run.records = [by_index[i] for i in sorted(by_index)]
    run.notes = list(system.notes)
    return run


def _warm_up(model: torch.nn.Module, longest: int) -> None:
    """Untimed calls so first-call costs land on no system: each sequential code path once
    on a short prompt, then plain generate() on a prompt as long as the longest one
    (large-shape first-time costs showed up as a 5x slower first request otherwise)."""
    device = next(model.parameters()).device
    short = torch.arange(2, 34, dtype=torch.long, device=device).tolist()
    pc = PrefixCacheSystem(model, 2)
    pc.start(Workload("warm-up", (), {}))
    for _ in range(2):  # a miss, then a hit
        pc.serve(Request(0, "w", (), None), short)
    pc.finish()
    long = (torch.arange(longest, dtype=torch.long) % 30 + 2).tolist()
    PlainGenerate(model, 4).serve(Request(0, "w", (), None), long)
