"""``prefixcache bench --preset gpu``: the batching engine on an accelerator, beside transformers.

A random-weight model of a named shape (nothing to download), token ids through
``PrefixCache.generate`` (threads for concurrent clients), greedy, every answer exactly
``new`` tokens long. Four workloads, each system measured in the same process:

- ``cold``: a prompt nobody has seen, time to first token, against ``model.generate``'s;
- ``hit``: a cached prefix plus new tokens, time to first token, against the bare forward
  of the new tokens on a ready cache (the limit any reuse can reach); timed once hits of that
  size on that prefix have been seen twice (the second is captured: ``captured_prompt_tokens``),
  the first such hit's time reported beside it;
- ``clients``: many clients on one warm prefix with distinct questions, tokens/s, against
  ``model.generate`` of all prompts as one static batch and transformers' ``generate_batch``
  (continuous batching with block sharing); with a float32 copy of the model, the batched
  answers must equal the serial engine's;
- ``memory``: clients on a long warm prefix, the peak memory above the weights against the
  prefix's KV, the requests' own KV and one step's activations (CUDA only: the allocator's peak).

Prints one table of ratios and writes ``gpu.json`` into ``--out``.
"""
from __future__ import annotations

import copy
import gc
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

#: Model shapes (transformers ``LlamaConfig`` fields); "llama-1b" is Llama-3.2-1B's with a 49,152-token vocabulary.
SHAPES: dict[str, dict[str, int | float]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=49152, max_position_embeddings=32768, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=4096),
}

#: Targets the preset is judged by (ratios; see docs/benchmarks.md).
COLD_VS_GENERATE = 1.2
HIT_VS_BARE = 1.1
CLIENTS_VS_BASELINES = 5.0
MEMORY_VS_NEEDED = 1.3
#: Hits of the timed size run before the timed ones: the first runs kernel by kernel, the second is captured.
WARM_HITS = 2


@dataclass(frozen=True, slots=True)
class GpuSpec:
    shape: str = "llama-1b"
    dtype: str = "bfloat16"
    cold_tokens: int = 8192
    hit_new: int = 128
    clients: int = 64
    client_prefix: int = 2048
    client_question: int = 64
    client_new: int = 128
    parity_clients: int = 16  # float32 answers compared with the serial engine's
    parity_new: int = 32
    long_clients: int = 16
    long_prefix: int = 16384
    reps: int = 3
    seed: int = 0


#: Sizes small enough for a CPU: the tests run the whole preset with them.
SMOKE = GpuSpec(shape="tiny", dtype="float32", cold_tokens=96, hit_new=8, clients=4, client_prefix=48,
                client_question=8, client_new=4, parity_clients=3, parity_new=4, long_clients=2, long_prefix=64,
                reps=2)


def build_model(spec: GpuSpec, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A random-weight Llama of ``spec.shape`` (seeded: the same weights in every dtype)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[spec.shape], tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


class _Clock:
    """Wall time with the device drained first, so a timing covers the kernels it launched."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def time(self, fn: Callable[[], object]) -> float:
        start = self()
        fn()
        return self() - start


def _ids(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


def _generate(cache, prompt: list[int], new: int, streamer: _FirstToken | None = None) -> list[int]:
    out = cache.generate([prompt], max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=streamer)
    return out[0, len(prompt):].tolist()


class _FirstToken:
    """A ``generate()`` streamer that notes when the first generated token arrives (the prompt comes first)."""

    def __init__(self) -> None:
        self.puts, self.at = 0, None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2 and self.at is None:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _ttft(clock: _Clock, call: Callable[[_FirstToken], object]) -> float:
    """Seconds from the call to its first generated token (a token on the host: the device is done)."""
    first = _FirstToken()
    start = clock()
    call(first)
    if first.at is None:
        raise RuntimeError("no token was streamed")
    return first.at - start


def _concurrently(fn: Callable[[int], object], n: int) -> tuple[list, float]:
    """``fn(i)`` on ``n`` threads released together; their results and the wall time of all."""
    results: list = [None] * n
    errors: list[BaseException] = []
    gate = threading.Barrier(n + 1)

    def client(i: int) -> None:
        gate.wait()
        try:
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), name=f"bench-client-{i}") for i in range(n)]
    for t in threads:
        t.start()
    gate.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return results, wall


def cold(cache, model, spec: GpuSpec, clock: _Clock, gen: torch.Generator) -> dict:
    vocab = model.config.vocab_size
    ours, theirs = [], []
    for _ in range(spec.reps):
        prompt = _ids(gen, spec.cold_tokens, vocab)
        ours.append(_ttft(clock, lambda first: _generate(cache, prompt, 1, first)))
        ids = torch.tensor([prompt], device=clock.device)
        theirs.append(_ttft(clock, lambda first: model.generate(ids, max_new_tokens=1, do_sample=False,
                                                                streamer=first)))
    return {"prefixcache_s": statistics.median(ours), "generate_s": statistics.median(theirs),
            "ratio": statistics.median(ours) / statistics.median(theirs), "target": COLD_VS_GENERATE}


def hit(cache, model, spec: GpuSpec, clock: _Clock, gen: torch.Generator) -> dict:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    prefix = _ids(gen, spec.cold_tokens, vocab)
    _generate(cache, prefix, 1)  # the prefix is cached from here on
    ready = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.tensor([prefix], device=clock.device), past_key_values=ready, use_cache=True)
    ours, bare, cached, warming = [], [], [], []
    for _ in range(WARM_HITS):  # the first hits of this size on this prefix run kernel by kernel; then captured
        suffix = _ids(gen, spec.hit_new, vocab)
        warming.append(_ttft(clock, lambda first: _generate(cache, prefix + suffix, 1, first)))
    for _ in range(spec.reps):
        suffix = _ids(gen, spec.hit_new, vocab)
        ours.append(_ttft(clock, lambda first: _generate(cache, prefix + suffix, 1, first)))
        cached.append(cache.last_call.cached_tokens)
        kv = copy.deepcopy(ready)
        ids = torch.tensor([suffix], device=clock.device)

        def forward() -> int:
            with torch.inference_mode():
                return int(model(input_ids=ids, past_key_values=kv, use_cache=True).logits[0, -1].argmax())

        bare.append(clock.time(forward))
    if min(cached) < spec.cold_tokens:
        raise RuntimeError(f"the hit reused only {min(cached)} of {spec.cold_tokens} cached tokens")
    graphs = cache.batcher.runner.graphs
    staged = {} if graphs is None else {"replayed_prompt_steps": graphs.staged_replays,
                                        "prompt_capture_off_reason": graphs.prefill_disabled}
    return {"prefixcache_s": statistics.median(ours), "bare_forward_s": statistics.median(bare),
            "ratio": statistics.median(ours) / statistics.median(bare), "cached_tokens": min(cached),
            "first_hit_s": warming[0], "target": HIT_VS_BARE, **staged}


def clients(cache, model, spec: GpuSpec, clock: _Clock, gen: torch.Generator) -> dict:
    from prefixcache.bench.batch import GenerateBatch

    vocab, n, new = model.config.vocab_size, spec.clients, spec.client_new
    prefix = _ids(gen, spec.client_prefix, vocab)
    prompts = [prefix + _ids(gen, spec.client_question, vocab) for _ in range(n)]
    _generate(cache, prefix, 1)  # warm
    answers, wall = _concurrently(lambda i: _generate(cache, prompts[i], new), n)
    if any(len(a) != new for a in answers):
        raise RuntimeError("a client got fewer tokens than asked")
    ours = n * new / wall
    graphs = cache.batcher.runner.graphs
    captured = {} if graphs is None else {"captured_steps": graphs.captures, "replayed_steps": graphs.replays,
                                          "capture_off_reason": graphs.disabled}
    ids = torch.tensor(prompts, device=clock.device)
    model.generate(ids[:2, :16], max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
    static = clock.time(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False))
    out = {"prefixcache_tok_s": ours, "static_batch_tok_s": n * new / static, **captured}
    previous = model.config._attn_implementation
    try:  # generate_batch takes only transformers' own attention implementations
        model.set_attn_implementation("sdpa")
        batcher = GenerateBatch(model, new, sharing=True, max_batch_tokens=spec.client_prefix + spec.client_question,
                                bytes_per_token=_bytes_per_token(model))
        batcher.call([p[:16] for p in prompts[:2]])  # warm-up
        call = batcher.call(prompts)
        out["generate_batch_tok_s"] = n * new / call.wall
    except Exception as exc:  # noqa: BLE001 - a failing baseline is reported, not fatal
        out["generate_batch_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        model.set_attn_implementation(previous)
    baselines = [out[k] for k in ("static_batch_tok_s", "generate_batch_tok_s") if k in out]
    out["ratio"] = ours / max(baselines)
    out["target"] = CLIENTS_VS_BASELINES
    return out


def parity(spec: GpuSpec, device: torch.device, gen: torch.Generator) -> dict:
    """float32: the batched answers of concurrent clients equal the serial engine's, token for token."""
    from prefixcache import PrefixCache

    model = build_model(spec, torch.float32, device)
    vocab, n = model.config.vocab_size, spec.parity_clients
    prefix = _ids(gen, spec.client_prefix, vocab)
    prompts = [prefix + _ids(gen, spec.client_question, vocab) for _ in range(n)]
    with PrefixCache(model, start_sweeper=False) as cache:
        if cache.batching_disabled_reason is not None:
            raise RuntimeError(f"batching disabled in float32: {cache.batching_disabled_reason}")
        _generate(cache, prefix, 1)
        batched, _ = _concurrently(lambda i: _generate(cache, prompts[i], spec.parity_new), n)
    with PrefixCache(model, batching=False, start_sweeper=False) as serial:
        alone = [_generate(serial, p, spec.parity_new) for p in prompts]
    same = sum(a == b for a, b in zip(batched, alone))
    del model
    return {"equal": same, "of": n}


def memory(cache, model, spec: GpuSpec, clock: _Clock, gen: torch.Generator) -> dict:
    device = clock.device
    if device.type != "cuda":
        return {"skipped": "peak memory is read from the CUDA allocator"}
    vocab, n, new = model.config.vocab_size, spec.long_clients, spec.client_new
    prefix = _ids(gen, spec.long_prefix, vocab)
    prompts = [prefix + _ids(gen, spec.client_question, vocab) for _ in range(n)]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    per_token = _bytes_per_token(model)
    # One step's activations: a bare forward of as many tokens as the clients' questions (one step feeds them all).
    rows = min(n * spec.client_question, cache.batcher.config.token_budget)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, rows), dtype=torch.long, device=device), use_cache=False,
              logits_to_keep=n)
    activations = torch.cuda.max_memory_allocated(device) - base
    _generate(cache, prefix, 1)  # warm
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    held_before = torch.cuda.memory_allocated(device)
    store_before = cache.store.bytes
    most_kv = [0]

    def client(i: int) -> list[int]:
        out = _generate(cache, prompts[i], new)
        most_kv[0] = max(most_kv[0], cache.batcher.kv_bytes())
        return out

    _concurrently(client, n)
    peak = torch.cuda.max_memory_allocated(device) - weights
    needed = (spec.long_prefix + n * (spec.client_question + new)) * per_token + activations
    return {"peak_above_weights_bytes": peak, "held_before_bytes": held_before - weights, "needed_bytes": needed,
            "store_before_bytes": store_before, "kv_bytes_seen": most_kv[0],
            "prefix_kv_bytes": spec.long_prefix * per_token, "activation_bytes": activations,
            "ratio": peak / needed, "target": MEMORY_VS_NEEDED}


def _bytes_per_token(model: torch.nn.Module) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem


def run_gpu(spec: GpuSpec, out: Path, device: torch.device | None = None,
            workloads: tuple[str, ...] = ("cold", "hit", "clients", "parity", "memory")) -> dict:
    """Run the preset's workloads; return (and write ``out/gpu.json``) their figures."""
    from prefixcache import CacheConfig, PrefixCache

    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, spec.dtype)
    clock = _Clock(device)
    gen = torch.Generator().manual_seed(spec.seed)
    result: dict = {"spec": asdict(spec), "device": _device_name(device), "torch": torch.__version__}
    started = time.perf_counter()
    model = build_model(spec, dtype, device)
    config = CacheConfig(max_bytes=8 << 30 if device.type == "cuda" else 1 << 30)
    for name in workloads:
        t0 = time.perf_counter()
        if name == "parity":
            figures = parity(spec, device, gen)
        else:
            with PrefixCache(model, config=config, start_sweeper=False) as cache:
                if cache.batching_disabled_reason is not None:
                    raise RuntimeError(f"batching disabled: {cache.batching_disabled_reason}")
                result.setdefault("batch_config", asdict(cache.batcher.config))
                _generate(cache, _ids(gen, 32, model.config.vocab_size), 2)  # warm-up of kernels
                figures = {"cold": cold, "hit": hit, "clients": clients, "memory": memory}[name](
                    cache, model, spec, clock, gen)
            del cache  # its snapshots must not count in the next workload's memory
        gc.collect()  # the closed cache's snapshots go before the next workload measures
        figures["seconds"] = round(time.perf_counter() - t0, 1)
        result[name] = figures
        print(f"{name}: {json.dumps(figures)}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    return result


def table(result: dict) -> str:
    """The preset's figures as a markdown table: each workload's ratio and its target."""
    rows = ["| workload | prefixcache | baseline | ratio | target |", "|---|---|---|---|---|"]
    if "cold" in result:
        c = result["cold"]
        rows.append(f"| cold {result['spec']['cold_tokens']} tokens, first token | {c['prefixcache_s'] * 1e3:.1f} ms | "
                    f"generate {c['generate_s'] * 1e3:.1f} ms | {c['ratio']:.2f}x | <= {c['target']}x |")
    if "hit" in result:
        h = result["hit"]
        rows.append(f"| hit {h['cached_tokens']} cached + {result['spec']['hit_new']} new, first token | "
                    f"{h['prefixcache_s'] * 1e3:.1f} ms (the first of its size: {h['first_hit_s'] * 1e3:.1f} ms) | "
                    f"bare forward {h['bare_forward_s'] * 1e3:.1f} ms | {h['ratio']:.2f}x | <= {h['target']}x |")
    if "clients" in result:
        c = result["clients"]
        cb = c.get("generate_batch_tok_s")
        base = f"static {c['static_batch_tok_s']:.0f}, generate_batch " + (f"{cb:.0f}" if cb else "failed")
        rows.append(f"| {result['spec']['clients']} clients, tok/s | {c['prefixcache_tok_s']:.0f} | {base} | "
                    f"{c['ratio']:.2f}x of the best | >= {c['target']}x |")
    if "parity" in result:
        p = result["parity"]
        rows.append(f"| float32 answers equal to the serial engine's | {p['equal']}/{p['of']} | | | all |")
    if "memory" in result and "ratio" in result["memory"]:
        m = result["memory"]
        rows.append(f"| {result['spec']['long_clients']} clients on {result['spec']['long_prefix']} tokens, peak "
                    f"above weights | {m['peak_above_weights_bytes'] / 2**30:.2f} GiB | needed "
                    f"{m['needed_bytes'] / 2**30:.2f} GiB | {m['ratio']:.2f}x | <= {m['target']}x |")
    return "\n".join(rows)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or "cpu"


def spec_from(shape: str | None, dtypes: list[str] | None, seed: int) -> GpuSpec:
    """The preset's spec with the command line's model shape, dtype (the first given) and seed."""
    spec = replace(GpuSpec(), seed=seed)
    if shape:
        spec = replace(spec, shape=shape)
    if dtypes:
        spec = replace(spec, dtype=dtypes[0])
    return spec
