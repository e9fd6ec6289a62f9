"""The start-up self-check's margins: healthy cascades far below its threshold, broken ones refused.

``check_cascade`` judges attention by its error in rounding units (``AttentionError.units``) against
``rounding_factor(dtype)``; docs/correctness.md has the measured distributions (benchmarks/cascade_gap.py).
Here: many random healthy cases stay 10x below the threshold in every dtype, every deliberately
broken cascade is refused by the check as a whole in every dtype, and the tiny models pass under
every CPU kernel level this machine runs, so a CPU's kernels cannot switch batching off unseen.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefixcache import PrefixCache
from prefixcache.errors import UnsupportedModelError
from prefixcache.model import cascade, hf_cache
from prefixcache.model.cascade import PrivateBatch, Shared, cascade_attention
from prefixcache.model.precision import AttentionError, attention_error, rounding_factor
from tests.conftest import ARCHS, build_tiny
from tests.support.broken_cascades import BROKEN_GROUPS, merge_swapped

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROOT = Path(__file__).resolve().parents[2]
LADDER = ("default", "avx2", "avx512")  # ATEN_CPU_CAPABILITY levels on x86, weakest first


def test_the_measured_false_refusal_is_accepted():
    """An AVX-512 CPU's gpt2 layer 0 in float32, refused by the former bound (2 plain + eps scale = 5.56e-08)."""
    err = AttentionError(cascade=5.74e-08, plain=1.68e-08, scale=0.1846)
    assert err.within(torch.float32) and 2 < err.units(torch.float32) < 3


def test_nan_is_refused():
    nan = float("nan")
    for err in (AttentionError(nan, 1e-8, 1.0), AttentionError(1e-8, nan, 1.0), AttentionError(1e-8, 1e-8, nan),
                AttentionError(1e-8, 1e-8, 1.0, nan)):
        assert not err.within(torch.float32)


# -- healthy: random packed steps, one AttentionError per request ----------------------------------------
def _random_step(gen: torch.Generator, dtype: torch.dtype, requests: int):
    """A packed step of ``requests`` requests on three prefix blocks (two chains, some read in part),
    private KV held from earlier steps, chunks and pooled decodes. Returns (q [Hq, T, D], out, the
    reference's per-request (start, end, keys [Hkv, n, D], values), scale)."""
    def pick(n: int) -> int:
        return int(torch.randint(n, (1,), generator=gen))

    hkv, g, dim = 1 + pick(2), (1, 2, 4)[pick(3)], (16, 32, 64)[pick(3)]
    temperature, offset = (1.0, 4.0, 12.0)[pick(3)], float(pick(2))  # flat to peaked scores; values off zero

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype)

    blocks = [(rand(hkv, n, dim), rand(hkv, n, dim) + offset) for n in (1 + pick(12), 1 + pick(12), 1 + pick(12))]
    chains = ([0, 1], [2], [])  # a request reads one chain of blocks in order, the last maybe in part
    members: dict[tuple[int, int], list[int]] = {}
    qs, spans, private, kvs, decoding, start = [], [], [], [], [], 0  # decoding: (request, k, v) pooled
    for i in range(requests):
        chain = chains[pick(3)]
        reads = [(b, blocks[b][0].shape[1]) for b in chain]
        if reads and pick(3) == 0:
            reads[-1] = (reads[-1][0], 1 + pick(reads[-1][1]))
        for read in reads:
            members.setdefault(read, []).append(i)
        count = 1 if pick(5) < 2 else 1 + pick(5)
        held = pick(7)
        k, v = rand(hkv, held + count, dim), rand(hkv, held + count, dim) + offset  # [Hkv, m, D]
        qs.append(rand(hkv * g, count, dim) * temperature)
        spans.append((start, start + count))
        pooled = count == 1 and pick(2) == 0
        private.append(None if pooled else (k, v))
        if pooled:
            decoding.append((i, k, v))
        kvs.append((start, start + count, torch.cat([blocks[b][0][:, :n] for b, n in reads] + [k], 1),
                    torch.cat([blocks[b][1][:, :n] for b, n in reads] + [v], 1)))
        start += count
    shared = [Shared(blocks[b][0][:, :n], blocks[b][1][:, :n], tuple(ms)) for (b, n), ms in members.items()]
    batches = []
    if decoding:  # the pooled decodes: slots of one zero-padded slab, an idle slot first
        lengths = [k.shape[1] for _, k, _ in decoding]
        slab = torch.zeros((2, len(decoding) + 1, hkv, max(lengths), dim), dtype=dtype)  # [2, S, Hkv, C, D]
        for slot, (_, k, v) in enumerate(decoding, start=1):
            slab[0, slot, :, : k.shape[1]], slab[1, slot, :, : k.shape[1]] = k, v
        batches.append(PrivateBatch.build(slab[0], slab[1], [spans[i][0] for i, _, _ in decoding],
                                          list(range(1, len(decoding) + 1)), lengths))
    q = torch.cat(qs, 1)
    scale = dim ** -0.5
    return q, cascade_attention(q, spans, shared, private, scale, batches), kvs, scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_thousand_healthy_cases_sit_ten_times_below_the_threshold(dtype):
    gen = torch.Generator().manual_seed(1234)
    worst, cases = 0.0, 0
    while cases < 1000:
        q, out, kvs, scale = _random_step(gen, dtype, requests=40)
        for request in kvs:
            err = attention_error(q, out, [request], scale)
            assert err.within(dtype), err.describe(dtype)
            worst = max(worst, err.units(dtype))
        cases += len(kvs)
    assert worst <= rounding_factor(dtype) / 10, f"a healthy case is {worst:.3g} rounding units: the margin is gone"


# -- broken: each refused by the check as a whole, and by the part that should ----------------------------




@pytest.fixture(scope="module", params=DTYPES, ids=str)
def llama(request):
    model = build_tiny("llama-gqa").to(request.param)  # GQA: 4 query heads on 2 KV heads
    layout = hf_cache.probe_layout(model)
    hf_cache.enable_cascade_attention(model)
    return model, layout


@pytest.mark.parametrize("bug", [*BROKEN_GROUPS, "log-sum-exp weights swapped"])
def test_a_broken_cascade_is_refused_in_every_dtype(bug, llama, monkeypatch):
    """In any dtype the float32 machinery check is 10x over the threshold; in float32 every layer is too."""
    model, layout = llama
    hf_cache.check_cascade(model, layout)  # the real one passes
    if bug == "log-sum-exp weights swapped":
        monkeypatch.setattr(cascade, "merge_two", merge_swapped)
    else:
        monkeypatch.setattr(hf_cache, "attend_groups", BROKEN_GROUPS[bug](hf_cache.attend_groups))
    m = hf_cache.measure_cascade(model, layout)
    with pytest.raises(UnsupportedModelError, match="rounding units"):
        hf_cache.check_cascade(model, layout)
    assert m.machinery.units(torch.float32) >= 10 * rounding_factor(torch.float32)
    if layout.dtype == torch.float32:
        assert min(err.units(torch.float32) for err in m.layers) >= 10 * rounding_factor(torch.float32)


def test_keys_at_the_wrong_position_are_refused_in_every_dtype(llama):
    """A step one position late (rotary keys rotated at position + 1): the layer-0 keys check."""
    model, layout = llama

    def late(ids, pos, cache, keep):
        return model(input_ids=ids.unsqueeze(0), position_ids=(pos + 1).unsqueeze(0), past_key_values=cache,
                     use_cache=True, **{hf_cache.CASCADE_KWARG: cache}).logits[0, keep]

    with pytest.raises(UnsupportedModelError, match="rows or positions"):
        hf_cache.check_cascade(model, layout, late)


# -- every architecture, every kernel level ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("arch", ARCHS)
def test_batching_is_enabled_for_every_tiny_architecture(arch, dtype):
    with PrefixCache(build_tiny(arch).to(dtype), batching=True, start_sweeper=False) as pc:
        assert pc.batcher is not None and pc.batcher.disabled_reason is None, pc.batcher.disabled_reason


def _levels_below_native() -> list[str]:
    native = torch.backends.cpu.get_cpu_capability().lower()
    return list(LADDER[: LADDER.index(native)]) if native in LADDER else ["default"]


_AT_LEVEL = """
import json, torch
from prefixcache import PrefixCache
from prefixcache.errors import UnsupportedModelError
from prefixcache.model.hf_cache import check_cascade, enable_cascade_attention, probe_layout
from tests.conftest import ARCHS, build_tiny
from tests.support.broken_cascades import BROKEN_GROUPS, merge_swapped
out = {"capability": torch.backends.cpu.get_cpu_capability(), "check": {}, "batching": {}}
for arch in ARCHS:
    for dtype in (torch.float32, torch.bfloat16):
        model = build_tiny(arch).to(dtype)
        layout = probe_layout(model)
        enable_cascade_attention(model)
        try:
            check_cascade(model, layout)
            out["check"][f"{arch} {dtype}"] = None
        except UnsupportedModelError as exc:
            out["check"][f"{arch} {dtype}"] = str(exc)
        with PrefixCache(build_tiny(arch).to(dtype), batching=True, start_sweeper=False) as pc:
            out["batching"][f"{arch} {dtype}"] = pc.batcher.disabled_reason
print(json.dumps(out))
"""


@pytest.mark.parametrize("level", _levels_below_native())
def test_the_self_check_passes_under_every_kernel_level(level):
    """ATEN_CPU_CAPABILITY is read when torch is imported, so each level runs in a subprocess: the tiny
    models pass check_cascade and batch in float32 and bfloat16 with that level's kernels too."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": level, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _AT_LEVEL], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["capability"].lower() == level
    refused = {case: why for case, why in out["check"].items() if why is not None}
    assert not refused, f"under ATEN_CPU_CAPABILITY={level} the self-check refuses: {refused}"
    disabled = {case: why for case, why in out["batching"].items() if why is not None}
    assert not disabled, f"under ATEN_CPU_CAPABILITY={level} batching is off: {disabled}"
