"""Batch invariance: does a greedy answer depend on what else is being served?

Run: ``python -m benchmarks.batch_invariance [--dtype bfloat16 float32] [--callers 8]``
(loads the embedded default model; prints one JSON object per dtype).

For each dtype and each engine (``batched``: the continuous-batching engine; ``serial``:
``PrefixCache(batching=False)``) it asks C questions after one shared system prompt, greedily:

- ``alone``: one after another on a cache holding only the warmed system prompt;
- ``together``: C threads calling ``chat()`` at the same moment on a fresh cache holding
  only the warmed system prompt.

It reports how many of the C answers are token-identical between the two, how many equal
plain ``model.generate()`` on the whole prompt, the first position where each differing
pair parts, and the cached-token counts each way (a different split between cached and
computed tokens is one source of a difference). ``--probe`` adds, for the model's linear
layers, whether a row's output bits depend on how many rows share the matrix product
(the other source). ``--attention-cost`` times what row-invariant attention over the shared
prefix would cost: the prefix part of one decode step for C rows as one product (what the
cascade does) against one product per row (what a batch-invariant mode would do).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from prefixcache.loading import load_default_model
from prefixcache.sdk import PrefixCache

SYSTEM = (
    "You are the support assistant of a small bicycle shop. The shop sells city bikes, "
    "road bikes and cargo bikes, repairs every brand, rents bikes by the day and offers a "
    "yearly maintenance plan. Opening hours are Monday to Saturday from nine to six. "
    "Answer briefly, politely and only about the shop. "
) * 6
QUESTIONS = (
    "Do you repair electric bikes?",
    "How much does renting a cargo bike for a weekend cost?",
    "What is included in the yearly maintenance plan?",
    "Can I test ride a road bike before buying it?",
    "Are you open on Sunday?",
    "My chain keeps slipping. What should I do?",
    "Do you sell helmets for children?",
    "How long does a wheel truing take?",
    "Can you deliver a bike to my home?",
    "Do you buy used bikes?",
    "What tyre pressure should a city bike have?",
    "Is there a student discount?",
)


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _answers(model: torch.nn.Module, tokenizer: Any, batching: bool, questions: Sequence[str],
             together: bool, new_tokens: int) -> list[tuple[tuple[int, ...], int]]:
    """(token ids, cached tokens) per question, on a cache holding only the warmed system prompt."""
    with PrefixCache(model, tokenizer, batching=batching) as cache:
        cache.warm([{"role": "system", "content": SYSTEM}])
        out: list[tuple[tuple[int, ...], int]] = [((), 0)] * len(questions)

        def ask(i: int, barrier: threading.Barrier | None = None) -> None:
            if barrier is not None:
                barrier.wait()
            result = cache.chat(_messages(questions[i]), max_new_tokens=new_tokens, temperature=0,
                                ignore_eos=True)
            out[i] = (result.token_ids, result.usage.cached_tokens)

        if together:
            barrier = threading.Barrier(len(questions))
            threads = [threading.Thread(target=ask, args=(i, barrier), name=f"prefixcache-bench-ask-{i}")
                       for i in range(len(questions))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for i in range(len(questions)):
                ask(i)
        return out


def _plain(model: torch.nn.Module, tokenizer: Any, questions: Sequence[str], new_tokens: int) -> list[tuple[int, ...]]:
    answers = []
    for q in questions:
        ids = tokenizer.apply_chat_template(_messages(q), add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=tokenizer.pad_token_id or 0)
        answers.append(tuple(out[0, ids.shape[1]:].tolist()))
    return answers


def linear_probe(model: torch.nn.Module, rows: Sequence[int] = (1, 2, 4, 8, 16)) -> dict[str, Any]:
    """For each distinct linear shape: do row 0's output bits change with the number of rows?"""
    seen: dict[tuple[int, int], list[int]] = {}
    gen = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            shape = (module.out_features, module.in_features)
            if shape in seen:
                continue
            x = torch.randn(max(rows), module.in_features, generator=gen).to(module.weight.dtype)
            with torch.inference_mode():
                ref = module(x[:1])[0]
                seen[shape] = [m for m in rows if not torch.equal(module(x[:m])[0], ref)]
    return {f"{o}x{i}": {"row counts changing row 0": bad} for (o, i), bad in seen.items()}


def prefix_attention_cost(model: torch.nn.Module, rows: int, prefix: int, repeats: int = 30) -> dict[str, float]:
    """Median seconds of one layer's attention over a shared prefix: all rows at once vs row by row."""
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    group, dim = cfg.num_attention_heads // kv_heads, cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(kv_heads, prefix, dim, generator=gen) for _ in range(2))
    q = torch.randn(rows, kv_heads, group, dim, generator=gen)

    def together() -> object:
        return (q.transpose(0, 1).reshape(kv_heads, rows * group, dim) @ k.transpose(1, 2)).softmax(-1) @ v

    def row_by_row() -> object:
        return [(q[r] @ k.transpose(1, 2)).softmax(-1) @ v for r in range(rows)]

    def median(fn: Any) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    one, each = median(together), median(row_by_row)
    return {"rows": rows, "prefix": prefix, "layers": cfg.num_hidden_layers, "one_product_s": one,
            "row_by_row_s": each, "ratio": each / one, "extra_per_step_s": (each - one) * cfg.num_hidden_layers}


def measure(model: torch.nn.Module, tokenizer: Any, callers: int, new_tokens: int, probe: bool) -> dict[str, Any]:
    """Agreement of alone and together answers on both engines (see the module's docstring)."""
    questions = QUESTIONS[:callers]
    plain = _plain(model, tokenizer, questions, new_tokens)
    report: dict[str, Any] = {"dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                              "callers": callers, "new_tokens": new_tokens}
    for engine, batching in (("batched", True), ("serial", False)):
        alone = _answers(model, tokenizer, batching, questions, False, new_tokens)
        together = _answers(model, tokenizer, batching, questions, True, new_tokens)
        report[engine] = {
            "alone == together": sum(a[0] == t[0] for a, t in zip(alone, together)),
            "alone == generate()": sum(a[0] == p for a, p in zip(alone, plain)),
            "together == generate()": sum(t[0] == p for t, p in zip(together, plain)),
            "first difference alone/together": [_first_difference(a[0], t[0]) for a, t in zip(alone, together)],
            "cached tokens alone": [a[1] for a in alone],
            "cached tokens together": [t[1] for t in together],
        }
    if probe:
        report["linear probe"] = linear_probe(model)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--callers", type=int, default=8, choices=range(1, len(QUESTIONS) + 1), metavar="N")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--probe", action="store_true", help="also probe the linear layers' row invariance")
    ap.add_argument("--attention-cost", type=int, metavar="PREFIX", default=0,
                    help="also time the shared-prefix attention of C rows at once vs row by row")
    args = ap.parse_args(argv)
    for dtype in args.dtype:
        model, tokenizer = load_default_model(dtype=dtype)
        report = measure(model, tokenizer, args.callers, args.new_tokens, args.probe)
        if args.attention_cost:
            report["attention cost"] = prefix_attention_cost(model, args.callers, args.attention_cost)
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
