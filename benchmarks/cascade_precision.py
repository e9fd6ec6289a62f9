"""How exact cascade attention is in a model's dtype, next to plain attention, against float64/float32.

Run: ``python -m benchmarks.cascade_precision [--dtype bfloat16] [--greedy 6]``
(loads the embedded default model in that dtype; prints one JSON object).

- ``layers``: the start-up self-check's packed step (``measure_cascade``), per layer: the
  cascade output's and plain SDPA's max error (both in the dtype) against float64 attention
  of the same inputs, and the bound ``check_cascade`` allows.
- ``logits``: the same step's logits, cascade and plain forwards in the dtype, against a
  float32 copy of the model (its weights upcast, so the difference is rounding alone).
- ``greedy`` (with ``--greedy N``): N prompts on a shared system prompt answered greedily by
  the batching engine (submitted together, so they share packed steps), by the serial engine
  by ``model.generate()``, and by ``generate()`` of a float32 copy (the rounding-free answer);
  for each pair, the tokens that agree before the first difference, summed over the prompts.
"""
from __future__ import annotations

import argparse
import copy
import json
import threading
from collections.abc import Sequence

import torch

from prefixcache.model.hf_cache import CascadeMeasure, enable_cascade_attention, measure_cascade, probe_layout
from prefixcache.model.precision import rounding_factor
from prefixcache.sdk import PrefixCache

SYSTEM = ("You are a concise assistant for a hardware store. Answer in one or two sentences, name the aisle "
          "when you can, and never invent prices.")
QUESTIONS = ("Where are the wood screws?", "Do you sell paint rollers?", "What glue works on ceramic?",
             "How do I fix a leaking tap?", "Which drill bit is for concrete?", "Do you cut keys?",
             "What size nails hang a picture?", "Where is the garden hose?")


def layer_table(m: CascadeMeasure, dtype: torch.dtype) -> list[dict[str, float]]:
    return [{"layer": i, "cascade": e.cascade, "plain": e.plain, "ratio": e.cascade / e.plain if e.plain else 0.0,
             "bound": e.bound(dtype)} for i, e in enumerate(m.layers)]


def logit_errors(model: torch.nn.Module, m: CascadeMeasure) -> dict[str, float]:
    """Cascade and plain logits of the measured step against a float32 copy of ``model``."""
    wide = copy.deepcopy(model).float()
    device = next(wide.parameters()).device
    with torch.no_grad():
        ref = torch.cat([wide(input_ids=torch.tensor([seq], device=device)).logits[0, m.prefix_len:]
                         for seq in m.sequences]).float()
    return {"cascade_vs_plain": float((m.got - m.want).abs().max()),
            "cascade_vs_fp32": float((m.got - ref).abs().max()),
            "plain_vs_fp32": float((m.want - ref).abs().max()),
            "largest_logit": float(ref.abs().max()),
            "argmax_cascade_fp32": int((m.got.argmax(-1) == ref.argmax(-1)).sum()),
            "argmax_plain_fp32": int((m.want.argmax(-1) == ref.argmax(-1)).sum()),
            "rows": int(ref.shape[0])}


def agreed(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> int:
    """Tokens equal before the first difference, summed over pairs of answers."""
    total = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        total += n
    return total


def greedy_answers(model: torch.nn.Module, tokenizer, prompts: Sequence[list[int]],
                   new_tokens: int) -> dict[str, list[list[int]]]:
    """Greedy answers of ``new_tokens`` each (end of sequence ignored) from the three paths."""
    batched: list[list[int]] = [[] for _ in prompts]
    with PrefixCache(model, tokenizer) as pc:
        if pc.batcher is None or pc.batcher.disabled_reason is not None:
            raise RuntimeError(f"batching is disabled: {pc.batcher and pc.batcher.disabled_reason}")

        def ask(i: int) -> None:
            batched[i] = list(pc.answer(prompts[i], max_new_tokens=new_tokens, ignore_eos=True).token_ids)

        threads = [threading.Thread(target=ask, args=(i,), name=f"prefixcache-bench-ask-{i}")
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    with PrefixCache(model, tokenizer, batching=False) as pc:
        serial = [list(pc.answer(p, max_new_tokens=new_tokens, ignore_eos=True).token_ids) for p in prompts]
    wide = copy.deepcopy(model).float()
    return {"batched": batched, "serial": serial, "generate": _generate(model, tokenizer, prompts, new_tokens),
            "generate_fp32": _generate(wide, tokenizer, prompts, new_tokens)}


def _generate(model: torch.nn.Module, tokenizer, prompts: Sequence[list[int]], new_tokens: int) -> list[list[int]]:
    device = next(model.parameters()).device
    answers = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens, pad_token_id=tokenizer.eos_token_id)
            answers.append(out[0, len(p):].tolist())
    return answers


def greedy_agreement(answers: dict[str, list[list[int]]]) -> dict[str, int]:
    """Agreeing tokens of each pair of paths; ``*_vs_fp32``: against the float32 copy's generate()."""
    pairs = [("batched", "serial"), ("serial", "generate"), ("batched", "generate"), ("batched", "generate_fp32"),
             ("serial", "generate_fp32"), ("generate", "generate_fp32")]
    out = {f"{a}_vs_{b.replace('generate_', '')}": agreed(answers[a], answers[b]) for a, b in pairs}
    return out | {"tokens": sum(len(a) for a in answers["generate"])}


def main(argv: list[str] | None = None) -> None:
    from prefixcache import load_default_model
    from prefixcache.loading import DTYPES

    parser = argparse.ArgumentParser(prog="python -m benchmarks.cascade_precision", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--rows", type=int, default=4, help="packed rows of the measured step (at least 4)")
    parser.add_argument("--greedy", type=int, default=0, help="prompts answered greedily by the three paths")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the machine is shared)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    model, tokenizer = load_default_model(dtype=dtype)
    layout = probe_layout(model)
    enable_cascade_attention(model)
    m = measure_cascade(model, layout, rows=args.rows)
    out = {"dtype": args.dtype, "rounding_factor": rounding_factor(dtype), "layers": layer_table(m, dtype),
           "inputs": m.inputs, "machinery_fp32": m.exact, "logits": logit_errors(model, m)}
    if args.greedy:
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                               add_generation_prompt=True, tokenize=False)
                 for i in range(args.greedy)]
        prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
        out["greedy"] = greedy_agreement(greedy_answers(model, tokenizer, prompts, args.new_tokens))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
