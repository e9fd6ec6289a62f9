"""What a ``response_format`` costs on the host: building the tokenizer's llguidance index once, a call's
matcher, and each token's mask (advance the grammar, compute its allowed tokens, set the others to -inf).

Run: ``python -m benchmarks.structured_cost [--rounds 5]`` (the embedded default model's tokenizer, 49,152
tokens; no weights are loaded). Each round writes a fixed JSON answer token by token through the call's
``GrammarLogits`` against random logits, for a json_schema format (an order: required keys, enums, bounds, a
pattern, a date, nested objects, an array of objects) and for json_object; the first round is left out of the per-token figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from prefixcache.loading import load_default_tokenizer
from prefixcache.serving.structured import Vocabulary, parse_response_format

#: An order as a shop's API would take it: nested objects, an array of them, enums, bounds, formats.
ITEM = {"type": "object", "additionalProperties": False, "required": ["sku", "quantity", "price"],
        "properties": {"sku": {"type": "string", "pattern": "[A-Z]{3}-[0-9]{4}"},
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                       "price": {"type": "number", "minimum": 0}}}
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["customer", "status", "placed", "items", "address"],
          "properties": {"customer": {"type": "string", "maxLength": 60},
                         "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
                         "placed": {"type": "string", "format": "date"},
                         "items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 20},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}}}}
ANSWER = {"customer": "Bartholomew the Magnificent", "status": "paid", "placed": "2026-11-27",
          "items": [{"sku": "OWL-0007", "quantity": 2, "price": 19.99}, {"sku": "CAT-1234", "quantity": 1, "price": 5}],
          "address": {"city": "Amsterdam", "zip": "1011 AB"}}
FORMATS = {"json_schema": {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA, "strict": True}},
           "json_object": {"type": "json_object"}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first is left out of the per-token figures)")
    tokenizer = load_default_tokenizer()
    vocab = Vocabulary(tokenizer, len(tokenizer))
    eos = {tokenizer.eos_token_id}
    ids = tokenizer.encode(json.dumps(ANSWER, separators=(",", ":")), add_special_tokens=False) + [tokenizer.eos_token_id]
    started = time.perf_counter()
    vocab.constraint(parse_response_format(FORMATS["json_object"]), eos)
    print(f"vocabulary of {len(tokenizer):,} tokens: index built in {1e3 * (time.perf_counter() - started):.0f} ms")
    scores = torch.randn(1, len(tokenizer), generator=torch.Generator().manual_seed(0))
    for name, fmt in FORMATS.items():
        constraint = vocab.constraint(parse_response_format(fmt), eos)
        matchers, steps = [], []
        for round_ in range(args.rounds):
            started = time.perf_counter()
            grammar = constraint.processor(0)
            matchers.append(time.perf_counter() - started)
            for i, token in enumerate(ids):
                started = time.perf_counter()
                out = grammar(torch.tensor([ids[:i]]), scores)
                if round_:
                    steps.append(time.perf_counter() - started)
                assert torch.isfinite(out[0, token]), f"token {i} of the answer refused"
        print(f"{name}: matcher {1e3 * statistics.median(matchers):.2f} ms; per token mean "
              f"{1e3 * statistics.mean(steps):.3f} ms, median {1e3 * statistics.median(steps):.3f} ms, max "
              f"{1e3 * max(steps):.2f} ms ({len(ids)} tokens x {args.rounds - 1} rounds)")


if __name__ == "__main__":
    main()
