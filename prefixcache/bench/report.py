"""Writes a run as a markdown table, a JSON file and a PNG plot."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from prefixcache.bench import metrics, runner
from prefixcache.bench.options import describe
from prefixcache.bench.plot import plot as draw
from prefixcache.plotting import PlottingUnavailable

_COLUMNS = ("system", "TTFT mean s", "TTFT p50 s", "TTFT p99 s", "TPOT ms", "out tok/s", "req/s", "hit rate",
            "peak KV MB", "= generate()", "TTFT speed-up", "tok/s vs generate()")


def markdown(result: runner.BenchResult) -> str:
    opts, m = result.options, result.machine
    lines = [f"# prefixcache bench — preset `{opts.preset}`", "",
             f"- machine: {m['cpu']}, {m['cpus']} CPUs, torch threads {m['torch_threads']}; torch {m['torch']}, "
             f"transformers {m['transformers']}, Python {m['python']}; prefixcache commit {m.get('commit')}",
             f"- load average (1, 5, 15 min) before: {m['load_average']}, after: {result.load_after}; "
             f"run took {result.elapsed:.0f} s",
             *[f"- model ({d}): {label}; KV {result.bytes_per_token[d] / 1024:.1f} KB/token"
               for d, label in result.models.items()],
             *[f"- {note}" for note in result.notes],
             "", "```", describe(opts), "```", ""]
    for run in result.runs:
        lines += _workload_table(run)
    lines += _targets_table(result)
    lines += ["Columns: TTFT = time to first token (first logits ready); TPOT = time per output token after the "
              "first; tok/s and req/s over the system's own serving time; hit rate = cached prompt tokens / prompt "
              "tokens; peak KV = KV kept between requests (max) + the largest request in flight (prefixcache-batched: "
              "peak of stored + in-flight KV; generate-batch: the paged pool it pre-allocates, sized to fit every "
              "request unshared); `= generate()` = share of answers token-identical to plain generate(). "
              "generate-batch gets each round's requests in one call and its TTFT counts from that call "
              f"(all requests queue at once); prefixcache-batched is fed by {result.options.concurrency} concurrent "
              "clients, closed loop, TTFT from each request's submission. `limit` = bare forward of the question "
              "against the already-cached system prompt: no decode. `http-*` = the same model served by a subprocess "
              "(`prefixcache serve` with one worker per client; `transformers serve --continuous-batching`), fed by "
              f"{result.options.concurrency} concurrent streaming clients over /v1/completions: TTFT from sending the "
              "request to the first chunk with text, tokens as the server counts them, `= generate()` compares the "
              "streamed text with generate()'s answer decoded (the servers return no ids); req/s and tok/s over wall time per round.", "",
              f"Token identity of prefixcache with generate() is asserted in {runner.STRICT_DTYPE} (the run fails "
              "otherwise). In reduced precision a cached prefix changes the order of roundings, so greedy answers "
              "may part after a near-tie (transformers' own deepcopy reuse parts the same way); there it is "
              "reported, not asserted.", ""]
    return "\n".join(lines)


def _workload_table(run) -> list[str]:
    ideal = metrics.ideal_hit_rate(run)
    head = f"## {run.workload} ({run.dtype})"
    notes = []
    if run.formula_hit_rate is not None and run.workload == "shared-prefix":
        notes.append(f"ideal token hit rate (1 − 1/P)·S/(S+Q) = {run.formula_hit_rate:.3f}")
    if ideal is not None:
        notes.append(f"achievable from the actual prompts = {ideal:.3f}")
    rows = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for s in metrics.summarize(run):
        rows.append("| " + " | ".join([
            s.system, _f(s.ttft_mean), _f(s.ttft_p50), _f(s.ttft_p99), _f(s.tpot, 1000), _f(s.tokens_per_s),
            _f(s.requests_per_s), _f(s.hit_rate), _f(s.peak_kv_bytes, 1 / 2**20),
            "—" if s.match_vs_generate is None else f"{s.match_vs_generate:.0%}",
            _x(s.ttft_speedup), _x(s.throughput_vs_generate)]) + " |")
    extra = [f"- {name}: {note}" for name, s in run.systems.items() for note in s.notes]
    if run.speed:
        extra.append("- machine speed (ms of one fixed 512×576 by 576×1,536 fp32 product; lower = faster): "
                     + " · ".join(f"{moment} {ms:.1f}" for moment, ms in run.speed))
    return [head, "", "; ".join(notes), "", *rows, "", *extra, *([""] if extra else [])]


def _targets_table(result: runner.BenchResult) -> list[str]:
    rows = ["## Targets (reported, not asserted)", "",
            "| dtype | hit TTFT s | limit TTFT s | hit / limit (median, target ≤ "
            f"{metrics.TARGET_HIT_OVER_LIMIT:.2f}) | hit / limit (means) | cold / hit | no-reuse overhead (median, "
            f"target ≤ {metrics.TARGET_NO_REUSE_OVERHEAD:.0%}) | no-reuse overhead (total) | shared-prefix tok/s vs "
            f"generate-batch (target ≥ {metrics.TARGET_VS_GENERATE_BATCH:.0f}×): prefixcache | prefixcache-batched |",
            "|" + "---|" * 10]
    for t in _targets(result):
        rows.append(f"| {t.dtype} | {_f(t.hit_ttft)} | {_f(t.limit_ttft)} | {_x(t.hit_over_limit)} | "
                    f"{_x(t.hit_over_limit_means)} | {_x(t.cold_over_hit)} | {_pct(t.no_reuse_overhead)} | "
                    f"{_pct(t.no_reuse_overhead_wall)} | {_x(t.vs_generate_batch)} | "
                    f"{_x(t.batched_vs_generate_batch)} |")
    return rows + [""]


def _targets(result: runner.BenchResult) -> list[metrics.Targets]:
    return [metrics.targets(d, [r for r in result.runs if r.dtype == d]) for d in result.options.dtypes]


def to_json(result: runner.BenchResult) -> dict:
    opts = dataclasses.asdict(result.options)
    opts["out"] = str(opts["out"])
    runs = []
    for run in result.runs:
        runs.append({"workload": run.workload, "dtype": run.dtype, "formula_hit_rate": run.formula_hit_rate,
                     "ideal_hit_rate": metrics.ideal_hit_rate(run),
                     "summaries": [s.as_dict() for s in metrics.summarize(run)],
                     "records": {name: [dataclasses.asdict(r) for r in s.records] for name, s in run.systems.items()},
                     "notes": {name: s.notes for name, s in run.systems.items() if s.notes},
                     "speed_ms": [{"moment": moment, "ms": ms} for moment, ms in run.speed]})
    return {"options": opts, "machine": result.machine, "load_after": result.load_after, "elapsed": result.elapsed,
            "notes": result.notes, "models": result.models, "kv_bytes_per_token": result.bytes_per_token, "runs": runs,
            "targets": [t.as_dict() for t in _targets(result)]}


def write(result: runner.BenchResult, out: Path, plot: bool = True) -> dict[str, Path]:
    """Write ``results.md``, ``results.json`` and (unless ``plot`` is off) ``results.png`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "results.md", "json": out / "results.json"}
    paths["md"].write_text(markdown(result) + "\n")
    paths["json"].write_text(json.dumps(to_json(result), indent=1) + "\n")
    if plot:
        try:
            paths["png"] = draw(result, out / "results.png")
        except PlottingUnavailable as exc:  # matplotlib is the optional `bench` extra
            print(exc, file=sys.stderr)
    return paths


def _f(value: float | None, scale: float = 1.0) -> str:
    if value is None:
        return "—"
    v = value * scale
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1%}"
