"""SDK quickstart on the embedded default model: a ~1,000-token system prompt, two questions.

Run:  .venv/bin/python examples/sdk_quickstart.py [--model HUB_ID_OR_FOLDER]
(or set PREFIXCACHE_MODEL). Prints the cached tokens and the time to first token of the cold call and of the hit.
"""
from __future__ import annotations

import argparse
import os

from prefixcache import CacheConfig, PrefixCache, load_default_model, load_model

POLICY = (
    "You are the support assistant of Northwind Outfitters, a retailer of hiking and camping gear. "
    "Answer in one or two sentences, politely, and only about our products and policies. "
    "Returns are accepted within 30 days with a receipt; sale items are final. "
    "Shipping is free above 50 euros; express delivery costs 9 euros and takes two working days. "
    "Tents carry a two-year warranty against manufacturing defects; sleeping bags carry one year. "
)


def system_prompt(target_tokens: int, tokenizer) -> str:
    text = POLICY
    while len(tokenizer(text)["input_ids"]) < target_tokens:
        text += POLICY
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--model", default=os.environ.get("PREFIXCACHE_MODEL"),
                        help="hub id or local folder of a causal LM (default: the embedded SmolLM2)")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model) if args.model else load_default_model()
    with PrefixCache(model, tokenizer, CacheConfig()) as cache:  # closed on leaving: its engine stops
        system = {"role": "system", "content": system_prompt(args.system_tokens, tokenizer)}
        for label, question in (("cold", "Can I return a tent I bought three weeks ago?"),
                                ("hit ", "How much does express delivery cost?")):
            res = cache.chat([system, {"role": "user", "content": question}], max_new_tokens=args.max_new_tokens)
            print(f"[{label}] prompt={res.usage.prompt_tokens} cached={res.usage.cached_tokens} "
                  f"ttft={res.stats.ttft_seconds:.3f}s  {res.text!r}")
        print(cache.stats())


if __name__ == "__main__":
    main()
