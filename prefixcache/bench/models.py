"""The model under test and the token space prompts are drawn from, per preset and dtype."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from prefixcache.bench.options import BenchOptions
from prefixcache.bench.workloads import TokenSpace
from prefixcache.loading import load_default_model, load_model

#: The small preset's model: a random-weight Llama with grouped-query attention.
TINY_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
TINY_SPECIAL = (0, 1)  # pad, eos/bos


@dataclass(frozen=True, slots=True)
class ModelUnderTest:
    model: torch.nn.Module
    space: TokenSpace
    label: str


def load(opts: BenchOptions, dtype: str) -> ModelUnderTest:
    torch_dtype = getattr(torch, dtype)
    if opts.model is not None:
        model, tokenizer = load_model(opts.model, dtype=torch_dtype)
        return ModelUnderTest(model, _space(model, tokenizer), opts.model)
    if opts.preset == "default":
        model, tokenizer = load_default_model(dtype=torch_dtype)
        return ModelUnderTest(model, _space(model, tokenizer), "SmolLM2-135M-Instruct (embedded default)")
    torch.manual_seed(opts.seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).to(torch_dtype).eval()
    model.generation_config.pad_token_id = TINY_SPECIAL[0]
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = TINY_SPECIAL[1]
    return ModelUnderTest(model, TokenSpace(TINY_CONFIG["vocab_size"], frozenset(TINY_SPECIAL)),
                          "tiny random Llama (2 layers, hidden 64, vocab 512)")


def _space(model: torch.nn.Module, tokenizer) -> TokenSpace:
    vocab = model.get_input_embeddings().num_embeddings
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
        special = frozenset(getattr(tokenizer, "all_special_ids", ()))
    else:
        special = frozenset()
    return TokenSpace(vocab, special)


def speed_probe(clock: Callable[[], float] = time.perf_counter, calls: int = 20) -> float:
    """Milliseconds of one fixed fp32 product (512 × 576 by 576 × 1,536, the default model's MLP
    shape at a prefill chunk; median of ``calls``): how fast the machine runs right now.

    A shared VM's speed can change by 2-3× for minutes at a time; taken around the timed runs,
    it shows whether two systems of one run were measured on the same machine speed."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(512, 576, generator=gen), torch.randn(1536, 576, generator=gen)
    times = []
    with torch.no_grad():
        for i in range(calls + 3):
            t0 = clock()
            torch.nn.functional.linear(x, w)
            elapsed = clock() - t0
            if i >= 3:  # the first calls warm the caches and threads
                times.append(elapsed)
    return statistics.median(times) * 1000


def machine() -> dict[str, object]:
    """What the numbers were measured on."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        cpu = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")), "")
    except (OSError, subprocess.SubprocessError):
        cpu = ""
    import transformers

    return {"cpu": cpu or platform.processor(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": _commit(), "load_average": _load()}


def _commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes); None outside a git checkout."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
