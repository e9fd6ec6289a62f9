"""The gap the start-up self-check must see: healthy cascade attention's rounding next to broken cascades' errors.

For each dtype and CPU kernel level (or on a GPU), random attention inputs in the shapes the engine
packs (shared prefix blocks read in place, private KV, chunked prefill, pooled decodes) go through the
real ``cascade_attention``, healthy and with one deliberate bug each. Every output is compared with
float64 attention of the same (dtype-rounded) inputs, next to plain attention in the dtype (SDPA,
``precision.reference_attention``), as ``check_cascade`` compares them.

Broken variants:
  position       private keys rotated one position late (rotary at position + 1)
  mask           causal mask one key ahead: every row also sees the key after its own (the next
                 row's, or the next token's), in chunks and pooled decodes alike
  missing_block  one shared prefix block left out
  merge          log-sum-exp merge with the two parts' weights swapped
  gqa            query head h reads KV head h % Hkv instead of h // g

Mixes (``n`` keys for the longest request, chunks of ``r`` rows):
  shared   one prefix (1-3 blocks) shared by a chunk and two pooled decodes
  partial  as ``_machinery_error``: a decode reading only part of the prefix, a chunk on a prefix of
           its own after held tokens, decodes sharing the main prefix
  private  no prefix: a chunk and decodes over private KV alone

Contexts of 9 keys (6-token prefix, 3-row chunk) are what the self-check runs on; longer ones are
there for the healthy side (rounding grows with context, a bug's effect shrinks). Head dims 32-256,
1-2 KV heads with 1-8 query heads each, scores of std 1, 4 or 12 (flat to peaked attention).

The tiny models (as tests/conftest.py builds them) then run the self-check itself
(``measure_cascade``, ``check_cascade``), healthy and with the same bugs patched into the engine,
so every part of the check shows its value: each layer's statistic in the model's dtype, the float32
machinery check's, and the layer-0 keys/values against a plain forward's.

Printed: per statistic a table of healthy max / p99 and broken minima; ``--json`` also keeps every
case's raw errors (max and RMS against float64 of the cascade and of plain attention, largest output,
largest score), so any other statistic can be computed from it.

Run from the repository root (2 cores, defaults: a few minutes):
    python benchmarks/cascade_gap.py [--json gap.json] [--device cuda] [--more 4]
Kernel levels (``ATEN_CPU_CAPABILITY``, read when torch is imported) each run in a subprocess.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from prefixcache.model import cascade  # noqa: E402
from prefixcache.model.cascade import PrivateBatch, Shared, cascade_attention  # noqa: E402
from prefixcache.model.precision import (  # noqa: E402
    AttentionError,
    largest_score,
    reference_attention,
    rounding_factor,
)
from tests.support.broken_cascades import gqa_modulo, merge_swapped, missing_block, one_ahead  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VARIANTS = ("healthy", "position", "mask", "missing_block", "merge", "gqa")
BROKEN = VARIANTS[1:]
MIXES = ("shared", "partial", "private")
LADDER = ("default", "avx2", "avx512")  # ATEN_CPU_CAPABILITY values on x86, weakest first
SELF_CHECK_KEYS = 16  # contexts up to this many keys are the size the self-check runs on
# (context keys, cases per dtype at --more 1, chunk rows to draw from): fewer cases where they cost more
DEFAULT_CONTEXTS = ((9, 60, (3,)), (64, 30, (2, 3, 16)), (512, 16, (3, 64)), (2048, 6, (3, 64)), (8192, 3, (3, 64)))
HEAD_DIMS = (32, 64, 80, 128, 256)
GQA = (1, 2, 4, 8)
TEMPERATURES = (1.0, 4.0, 12.0)  # std of the attention scores: flat to peaked


# -- statistics: each maps one case's raw errors and the dtype to a number ------------------------------
def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


STATISTICS = {
    # what check_cascade judges (precision.AttentionError.units), against rounding_factor(dtype)
    "units": lambda e, dt: AttentionError(e["cascade"], e["plain"], e["scale"], e["logit"]).units(dt),
    "units_no_logit": lambda e, dt: e["cascade"] / max(e["plain"], _eps(dt) * e["scale"]),
    "old_bound": lambda e, dt: e["cascade"] / (2.0 * e["plain"] + _eps(dt) * e["scale"]),
    "vs_plain": lambda e, dt: e["cascade"] / e["plain"] if e["plain"] else math.inf,
    "eps_scale": lambda e, dt: e["cascade"] / (_eps(dt) * e["scale"]),
    "rms_units": lambda e, dt: e["cascade_rms"] / max(e["plain_rms"], _eps(dt) * e["ref_rms"]),
}
STAT_HELP = {
    "units": "max|cascade-f64| / max(max|plain-f64|, (eps + eps32*max|score|) * max|f64|)  (the check's)",
    "units_no_logit": "max|cascade-f64| / max(max|plain-f64|, eps * max|f64|)",
    "old_bound": "max|cascade-f64| / (2*max|plain-f64| + eps*max|f64|)  (the former check: refused above 1)",
    "vs_plain": "max|cascade-f64| / max|plain-f64|",
    "eps_scale": "max|cascade-f64| / (eps*max|f64|)",
    "rms_units": "rms(cascade-f64) / max(rms(plain-f64), eps*rms(f64))",
}


# -- inputs ---------------------------------------------------------------------------------------
def rotate(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (halves rotated, as Llama) of x [H, n, D] at positions [n], in float64."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)  # [D/2]
    angle = positions.double().unsqueeze(1) * inv  # [n, D/2]
    cos, sin = angle.cos(), angle.sin()
    a, b = x[..., :half].double(), x[..., half:].double()
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


@dataclass(frozen=True)
class Req:
    blocks: tuple[tuple[int, int], ...]  # (prefix block, tokens of it read), in position order
    held: int  # private tokens held before the step
    count: int  # new rows in the step


@dataclass
class Case:
    mix: str
    keys: int  # context of the longest request
    rows: int  # chunk rows
    dim: int
    hkv: int
    g: int
    temperature: float
    seed: int
    reqs: list[Req] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    block_offsets: list[int] = field(default_factory=list)  # first position of each block


def split(total: int, parts: int, gen: torch.Generator) -> list[int]:
    """``total`` tokens in ``parts`` blocks of at least one token (fewer when too short)."""
    parts = max(1, min(parts, total))
    cuts = sorted(torch.randperm(total - 1, generator=gen)[: parts - 1].add(1).tolist()) if parts > 1 else []
    edges = [0, *cuts, total]
    return [b - a for a, b in zip(edges, edges[1:])]


def plan(case: Case, gen: torch.Generator) -> None:
    """Fill in the requests and prefix blocks of ``case`` (see MIXES)."""
    n, r = case.keys, case.rows
    if case.mix == "private":
        case.reqs = [Req((), n - r, r), Req((), n - 1, 1), Req((), max(0, n // 2 - 1), 1)]
        return
    prefix = n - r
    main = split(prefix, 1 + int(torch.randint(3, (1,), generator=gen)), gen)
    case.block_sizes, case.block_offsets = list(main), [sum(main[:i]) for i in range(len(main))]
    full = tuple((i, s) for i, s in enumerate(main))
    if case.mix == "shared":  # the self-check's step: a chunk and decodes on one prefix
        case.reqs = [Req(full, 0, r), Req(full, r - 1, 1), Req(full, 0, 1)]
        return
    other = max(1, prefix // 3)  # a prefix of its own (one block at position 0)
    case.block_sizes.append(other)
    case.block_offsets.append(0)
    part, left = [], max(1, prefix * 2 // 3)  # a decode reading fewer tokens of the main prefix
    for i, s in enumerate(main):
        if left:
            part.append((i, min(s, left)))
            left -= part[-1][1]
    case.reqs = [Req(full, 0, r), Req(tuple(part), 2, 1), Req(((len(main), other),), 1, min(r, 2)),
                 Req(full, 0, 1)]


@dataclass
class Inputs:
    """One case's tensors in the dtype on the device, and what the reference needs."""

    q: torch.Tensor  # [Hq, T, D] packed
    spans: list[tuple[int, int]]
    blocks: list[tuple[torch.Tensor, torch.Tensor]]  # [Hkv, n_b, D] each
    private: list[tuple[torch.Tensor, torch.Tensor]]  # [Hkv, held + count, D], correct positions
    late: list[tuple[torch.Tensor, torch.Tensor]]  # the same keys rotated one position late
    ahead: list[tuple[torch.Tensor, torch.Tensor]]  # private KV and the next token's: [Hkv, held + count + 1, D]
    scale: float


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> Inputs:
    gen = torch.Generator().manual_seed(case.seed)
    hq, dim = case.hkv * case.g, case.dim
    offset = float(torch.randint(2, (1,), generator=gen))  # values off zero stress the merges' lerp

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).to(device)

    blocks = []
    for size, first in zip(case.block_sizes, case.block_offsets):
        k = torch.randn(case.hkv, size, dim, generator=gen)
        v = torch.randn(case.hkv, size, dim, generator=gen) + offset
        blocks.append((cast(rotate(k, torch.arange(first, first + size))), cast(v)))
    qs, private, late, ahead, spans, start = [], [], [], [], [], 0
    for req in case.reqs:
        before = sum(used for _, used in req.blocks)
        m = req.held + req.count
        pos = torch.arange(before, before + m + 1)  # [m + 1]: the last one is the next token's
        k = rotate(torch.randn(case.hkv, m + 1, dim, generator=gen), pos)
        v = cast(torch.randn(case.hkv, m + 1, dim, generator=gen) + offset)
        ahead.append((cast(k), v))
        private.append((cast(k[:, :m]), v[:, :m]))
        late.append((cast(rotate(k[:, :m], torch.ones(m))), v[:, :m]))  # rotated once more: one position on
        # q·k of N(0,1) entries has std sqrt(D); scale D^-0.5 makes it 1, the temperature sets it
        q = torch.randn(hq, req.count, dim, generator=gen) * case.temperature
        qs.append(rotate(q, pos[req.held:m]))
        spans.append((start, start + req.count))
        start += req.count
    return Inputs(cast(torch.cat(qs, 1)), spans, blocks, private, late, ahead, dim ** -0.5)


# -- the cascade, healthy or broken ---------------------------------------------------------------
@contextlib.contextmanager
def patched(module, name: str, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def applicable(case: Case, variant: str) -> bool:
    if variant in ("missing_block", "merge"):
        return case.mix != "private"  # no prefix: no block to miss, no merge
    if variant == "gqa":
        return case.g > 1 and case.hkv > 1  # h // g == h % Hkv for every h otherwise
    return True


def run_cascade(case: Case, x: Inputs, variant: str) -> torch.Tensor:
    """The packed cascade output [Hq, T, D] of ``case`` with ``variant``'s bug."""
    members: dict[tuple[int, int], list[int]] = {}
    for i, req in enumerate(case.reqs):
        for block, used in req.blocks:
            members.setdefault((block, used), []).append(i)
    shared = [Shared(x.blocks[b][0][:, :used], x.blocks[b][1][:, :used], tuple(ms))
              for (b, used), ms in members.items()]
    if variant == "missing_block":
        shared = shared[1:]
    kv = {"position": x.late, "mask": x.ahead}.get(variant, x.private)
    # One-row requests decode through one pooled call, as the engine's ``DecodeGroup``: slots of a
    # zero-padded slab (an idle slot first, so slots are not 0..n-1), one key of padding at least.
    decoding = [i for i, req in enumerate(case.reqs) if req.count == 1]
    private: list[tuple[torch.Tensor, torch.Tensor] | None] = [None if i in decoding else kv[i]
                                                                for i in range(len(case.reqs))]
    batches = []
    if decoding:
        capacity = max(kv[i][0].shape[1] for i in decoding) + 1
        slab = x.q.new_zeros((2, len(decoding) + 1, case.hkv, capacity, case.dim))  # [2, S, Hkv, C, D]
        lengths = []
        for slot, i in enumerate(decoding, start=1):
            m = kv[i][0].shape[1]
            slab[0, slot, :, :m], slab[1, slot, :, :m] = kv[i]
            lengths.append(m)
        batches.append(PrivateBatch.build(slab[0], slab[1], [x.spans[i][0] for i in decoding],
                                          list(range(1, len(decoding) + 1)), lengths))
    q = x.q
    if variant == "gqa":
        # cascade maps head h' to KV head h' // g; put query head h at h' = (h % Hkv) g + h // Hkv
        hq = q.shape[0]
        to = torch.tensor([(h % case.hkv) * case.g + h // case.hkv for h in range(hq)], device=q.device)
        moved = torch.empty_like(q)
        moved[to] = q
        return cascade_attention(moved, x.spans, shared, private, x.scale, batches)[to]
    with patched(cascade, "merge_two", merge_swapped) if variant == "merge" else contextlib.nullcontext():
        return cascade_attention(q, x.spans, shared, private, x.scale, batches)


def request_kv(case: Case, x: Inputs) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """(start, end, keys [Hkv, n, D], values) of each request, its own rows last: the correct keys."""
    out = []
    for req, (s, e), (pk, pv) in zip(case.reqs, x.spans, x.private):
        keys = [x.blocks[b][0][:, :used] for b, used in req.blocks] + [pk]
        values = [x.blocks[b][1][:, :used] for b, used in req.blocks] + [pv]
        out.append((s, e, torch.cat(keys, 1), torch.cat(values, 1)))
    return out


def measure(case: Case, dtype: torch.dtype, device: torch.device) -> dict:
    """Raw errors of plain attention and of every applicable variant of the cascade, against float64."""
    x = make_inputs(case, dtype, device)
    requests = request_kv(case, x)
    exact, plain, logit = [], [], 0.0
    for s, e, keys, values in requests:
        rows = x.q[:, s:e]
        exact.append(reference_attention(rows, keys, values, x.scale, torch.float64))  # [Hq, r, D]
        plain.append(reference_attention(rows, keys, values, x.scale).double())
        logit = max(logit, float(largest_score(rows, keys, x.scale)))
    ref = torch.cat(exact, 1)  # [Hq, T, D]
    same = torch.cat(plain, 1)
    # per request max, as precision.attention_error, then the max over requests; RMS over all rows
    row = {"plain": float((same - ref).abs().max()), "scale": float(ref.abs().max()), "logit": logit,
           "plain_rms": float((same - ref).pow(2).mean().sqrt()), "ref_rms": float(ref.pow(2).mean().sqrt())}
    errors = {}
    for variant in VARIANTS:
        if not applicable(case, variant):
            continue
        out = run_cascade(case, x, variant).double()
        diff = out - ref
        errors[variant] = {"cascade": float(diff.abs().max()), "cascade_rms": float(diff.pow(2).mean().sqrt())}
    return {"mix": case.mix, "keys": case.keys, "rows": case.rows, "dim": case.dim, "hkv": case.hkv, "g": case.g,
            "temperature": case.temperature, "seed": case.seed, **row, "variants": errors}


def cases(more: float, contexts, seed: int) -> list[Case]:
    """The case grid: per context a number of cases, each with shapes and mix drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    out = []

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    for keys, count, chunk_rows in contexts:
        for _ in range(max(1, round(count * more))):
            case = Case(mix=pick(MIXES), keys=keys, rows=pick(chunk_rows), dim=pick(HEAD_DIMS), hkv=pick((1, 2)),
                        g=pick(GQA), temperature=pick(TEMPERATURES),
                        seed=int(torch.randint(2 ** 31, (1,), generator=gen)))
            if case.g > 1 and keys <= SELF_CHECK_KEYS:
                case.hkv = 2  # the self-check size also tells the GQA mapping in every case
            plan(case, torch.Generator().manual_seed(case.seed))
            out.append(case)
    return out


# -- tiny models: the self-check itself (the check as a whole: every part's value) ------------------
def model_rows(dtype_name: str, device: torch.device) -> list[dict]:
    """``measure_cascade`` on tiny random models (as tests/conftest.py builds), healthy and broken."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from prefixcache.errors import UnsupportedModelError
    from prefixcache.model import hf_cache

    archs = {
        "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2)),
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2)),
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=320, n_embd=64, n_layer=2, n_head=4, bos_token_id=1,
                                                   eos_token_id=1)),
    }
    real_groups = hf_cache.attend_groups
    breaks = {"mask": (hf_cache, "attend_groups", one_ahead(real_groups)),
              "merge": (cascade, "merge_two", merge_swapped),
              "missing_block": (hf_cache, "attend_groups", missing_block(real_groups)),
              "gqa": (hf_cache, "attend_groups", gqa_modulo(real_groups))}
    dtype = DTYPES[dtype_name]
    rows = []
    for arch, build in archs.items():
        for seed in range(3):
            torch.manual_seed(seed)
            model = build().eval().to(device=device, dtype=dtype)
            layout = hf_cache.probe_layout(model)
            hf_cache.enable_cascade_attention(model)

            def shifted(ids, pos, cache, keep):  # a step one position late (rotary or absolute)
                return model(input_ids=ids.unsqueeze(0), position_ids=(pos + 1).unsqueeze(0), past_key_values=cache,
                             use_cache=True, **{hf_cache.CASCADE_KWARG: cache}).logits[0, keep]

            gqa = model.config.num_attention_heads != layout.num_kv_heads
            for variant in ("healthy", "position", *(b for b in breaks if gqa or b != "gqa")):
                with patched(*breaks[variant]) if variant in breaks else contextlib.nullcontext():
                    m = hf_cache.measure_cascade(model, layout, shifted if variant == "position" else None)
                verdict = None
                if variant == "healthy":  # the check itself, as the engine runs it at start-up
                    try:
                        hf_cache.check_cascade(model, layout)
                        verdict = "accepted"
                    except UnsupportedModelError as exc:
                        verdict = str(exc)
                rows.append({"arch": arch, "seed": seed, "variant": variant, "inputs": m.inputs, "check": verdict,
                             "layers": [[e.cascade, e.plain, e.scale, e.logit] for e in m.layers],
                             "machinery": [m.machinery.cascade, m.machinery.plain, m.machinery.scale,
                                           m.machinery.logit],
                             "logits": float((m.got - m.want).abs().max() / m.want.abs().max())})
    return rows


# -- driver ---------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    grid = cases(args.more, args.contexts, args.seed)
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "synthetic": {},
           "models": {}}
    for name in args.dtypes:
        t0 = time.perf_counter()
        out["synthetic"][name] = rows = []
        for case in grid:
            try:
                rows.append(measure(case, DTYPES[name], device))
            except Exception as exc:  # noqa: BLE001 - a kernel that fails on one shape is reported, not fatal
                rows.append({"mix": case.mix, "keys": case.keys, "dim": case.dim, "hkv": case.hkv, "g": case.g,
                             "seed": case.seed, "error": f"{type(exc).__name__}: {exc}"})
                print(f"  {name} {case}: {rows[-1]['error']}", file=sys.stderr)
        if args.models:
            try:
                out["models"][name] = model_rows(name, device)
            except Exception as exc:  # noqa: BLE001 - another transformers may not build them; the rest stands
                print(f"  tiny models skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
        print(f"  {name}: {len(grid)} cases in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def levels_here() -> list[str]:
    """Kernel levels this CPU runs: every ladder step up to the one torch picks by itself."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    if native in LADDER:
        return list(LADDER[: LADDER.index(native) + 1])
    return ["default", native]


def quantile(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(p * len(ordered)) - 1)]


def summarize(run: dict, stat: str) -> dict:
    """Per dtype: the statistic's healthy max and p99; each broken variant's min at the self-check's size
    with scores of std 1 (as the machinery check draws them) and with any; the broken min per context."""
    f = STATISTICS[stat]
    table = {}
    for name, rows in run["synthetic"].items():
        dtype = DTYPES[name]
        rows = [row for row in rows if "error" not in row]
        healthy, by_keys = [], {}
        flat, peaked = {v: [] for v in BROKEN}, {v: [] for v in BROKEN}
        for row in rows:
            for variant, err in row["variants"].items():
                value = f({**row, **err}, dtype)
                if variant == "healthy":
                    healthy.append(value)
                    continue
                by_keys.setdefault(row["keys"], []).append(value)
                if row["keys"] <= SELF_CHECK_KEYS:
                    (flat if row["temperature"] == 1.0 else peaked)[variant].append(value)
        table[name] = {"cases": len(healthy), "errors": sum("error" in row for row in run["synthetic"][name]),
                       "healthy_max": max(healthy), "healthy_p99": quantile(healthy, 0.99),
                       "broken_min_self_check": {v: min(xs, default=math.nan) for v, xs in flat.items()},
                       "broken_min_self_check_peaked": {v: min(xs, default=math.nan) for v, xs in peaked.items()},
                       "broken_min_by_keys": {k: min(xs) for k, xs in sorted(by_keys.items())}}
    return table


def model_summary(run: dict) -> dict:
    """Per dtype and variant, on the tiny models: the largest per-layer statistic, the float32 machinery's,
    the layer-0 K/V difference (healthy: the max; broken: the min) and how many healthy ones the check refused."""
    out = {}
    for name, rows in run["models"].items():
        dtype = DTYPES[name]
        per = {}
        for row in rows:
            agg = per.setdefault(row["variant"], {"layer": [], "machinery": [], "inputs": []})
            agg["layer"].append(max(AttentionError(*e).units(dtype) for e in row["layers"]))
            agg["machinery"].append(AttentionError(*row["machinery"]).units(torch.float32))
            agg["inputs"].append(row["inputs"])
        out[name] = {v: {k: (max if v == "healthy" else min)(xs) for k, xs in agg.items()} for v, agg in per.items()}
        out[name]["refused_healthy"] = [f"{r['arch']} seed {r['seed']}: {r['check']}" for r in rows
                                        if r["variant"] == "healthy" and r["check"] != "accepted"]
    return out


def fmt(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.3g}"


def print_tables(runs: dict[str, dict], stats: list[str]) -> None:
    for stat in stats:
        print(f"\n## {stat}: {STAT_HELP[stat]}" + ("; threshold " + ", ".join(
            f"{name} {rounding_factor(dtype):g}" for name, dtype in DTYPES.items()) if stat == "units" else ""))
        print(f"broken: min at the self-check's size (<= {SELF_CHECK_KEYS} keys) with scores of std 1; then any "
              "variant there with peaked scores (std 4, 12), and any variant at any context")
        print("| level | dtype | cases | healthy max | healthy p99 | " + " | ".join(BROKEN)
              + " | peaked | all contexts |")
        print("|---|---|---|---|---|" + "---|" * len(BROKEN) + "---|---|")
        for level, run in runs.items():
            for name, t in summarize(run, stat).items():
                small = t["broken_min_self_check"]
                print(f"| {level} | {name} | {t['cases']} | {fmt(t['healthy_max'])} | {fmt(t['healthy_p99'])} | "
                      + " | ".join(fmt(small[v]) for v in BROKEN)
                      + f" | {fmt(min(t['broken_min_self_check_peaked'].values()))}"
                      + f" | {fmt(min(t['broken_min_by_keys'].values()))} |"
                      + (f" ({t['errors']} cases failed to run)" if t["errors"] else ""))
    print("\n## 'units', broken min by context (keys), any variant")
    for level, run in runs.items():
        for name, t in summarize(run, "units").items():
            print(f"{level} {name}: " + ", ".join(f"{k}: {fmt(v)}" for k, v in t["broken_min_by_keys"].items()))
    if not any(run["models"] for run in runs.values()):
        return
    print("\n## tiny models, the self-check itself: largest per-layer 'units' in the model's dtype | the float32 "
          "machinery's 'units' | layer-0 K/V difference (of their largest); healthy: max, broken: min")
    variants = ("healthy", "position", *BROKEN[1:])
    print("| level | dtype | refused healthy | " + " | ".join(variants) + " |")
    print("|---|---|---|" + "---|" * len(variants))
    for level, run in runs.items():
        for name, per in model_summary(run).items():
            cells = [" / ".join(fmt(per[v][k]) for k in ("layer", "machinery", "inputs")) if v in per else "n/a"
                     for v in variants]
            print(f"| {level} | {name} | {len(per['refused_healthy'])} | " + " | ".join(cells) + " |")
            for why in per["refused_healthy"]:
                print(f"    refused: {why}")


def parse_contexts(text: str) -> tuple:
    """'9:60:3,512:16:3/64' → ((9, 60, (3,)), (512, 16, (3, 64)))."""
    out = []
    for part in text.split(","):
        keys, count, rows = part.split(":")
        out.append((int(keys), int(count), tuple(int(r) for r in rows.split("/"))))
    return tuple(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--levels", default=None,
                        help="ATEN_CPU_CAPABILITY levels, comma-separated (default: every level this CPU runs; "
                             "ignored off the CPU)")
    parser.add_argument("--more", type=float, default=1.0, help="multiply the cases per context")
    parser.add_argument("--contexts", type=parse_contexts, default=DEFAULT_CONTEXTS,
                        help="keys:cases:rows/rows,... (default: 9:60:3,64:30:2/3/16,512:16:3/64,2048:6:3/64,"
                             "8192:3:3/64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))
    parser.add_argument("--no-models", dest="models", action="store_false",
                        help="skip the tiny-model self-check rows (they need transformers)")
    parser.add_argument("--stats", default=",".join(STATISTICS), help="comma-separated, of: " + ", ".join(STATISTICS))
    parser.add_argument("--json", type=Path, help="write every raw error and the summaries here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    if args.worker:
        json.dump(worker(args), sys.stdout)
        return
    runs: dict[str, dict] = {}
    if torch.device(args.device).type != "cpu":
        runs[args.device] = worker(args)
    else:
        for level in (args.levels.split(",") if args.levels else levels_here()):
            t0 = time.perf_counter()
            print(f"level {level}", file=sys.stderr)
            cmd = [sys.executable, __file__, "--worker", *(argv if argv is not None else sys.argv[1:])]
            env = {**os.environ, "ATEN_CPU_CAPABILITY": level}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                sys.exit(f"level {level} failed:\n{done.stderr}")
            run = json.loads(done.stdout)
            print(done.stderr.strip() + f"\n  ({run['capability']}, {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            if run["capability"].lower() != level:
                print(f"  asked for {level}, torch ran {run['capability']}", file=sys.stderr)
            runs[level] = run
    stats = args.stats.split(",")
    print_tables(runs, stats)
    if args.json:
        summary = {level: {stat: summarize(run, stat) for stat in stats} for level, run in runs.items()}
        models = {level: model_summary(run) for level, run in runs.items() if run["models"]}
        thresholds = {name: rounding_factor(dtype) for name, dtype in DTYPES.items()}
        args.json.write_text(json.dumps({"argv": sys.argv[1:], "threshold": thresholds, "summary": summary,
                                         "models": models, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
