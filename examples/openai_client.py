"""The official ``openai`` client against prefixcache: the second call reports cached tokens.

    source .venv/bin/activate              # after `make serve` or `make test`: the openai client comes
                                           # with the test extra (pip install '.[test]')
    prefixcache serve                      # terminal 1: the embedded default model, local mode (no keys)
    python examples/openai_client.py       # terminal 2

Against a server with API keys, set ``PREFIXCACHE_API_KEY`` (and ``PREFIXCACHE_BASE_URL``).
Nothing here is prefixcache-specific: any app using the openai client works unchanged.
"""
from __future__ import annotations

import os
import sys
import time

from openai import APIConnectionError, OpenAI

SYSTEM = (
    "You are the support assistant of Harbour Freight, a shipping company. Answer in one short "
    "sentence. Policies: parcels ship within two business days; tracking numbers start with HF; "
    "refunds are issued within 30 days of delivery; exchanges within 60 days; fragile items need "
    "the blue label; customs forms are required outside the EU; weekend delivery costs extra. "
) * 4


def main(base_url: str | None = None, api_key: str | None = None) -> list[int]:
    """Ask two questions sharing one long system prompt; return each call's cached tokens."""
    client = OpenAI(base_url=base_url or os.environ.get("PREFIXCACHE_BASE_URL", "http://127.0.0.1:8000/v1"),
                    api_key=api_key or os.environ.get("PREFIXCACHE_API_KEY", "local-mode-needs-no-key"))
    model = client.models.list().data[0].id
    cached = []
    for question in ("How long do refunds take?", "Do I need a customs form for Norway?"):
        start = time.perf_counter()
        reply = client.chat.completions.create(
            model=model, max_tokens=24, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        usage = reply.usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
        print(f"{question}\n  -> {reply.choices[0].message.content!r}\n  prompt {usage.prompt_tokens} tokens, "
              f"cached {cached[-1]}, {time.perf_counter() - start:.2f} s")
    # Streaming: ask for usage, and it arrives in a last chunk with no choices.
    stream = client.chat.completions.create(
        model=model, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is weekend delivery free?"}])
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            cached.append(chunk.usage.prompt_tokens_details.cached_tokens)
            print(f"\n  streamed; cached {cached[-1]} of {chunk.usage.prompt_tokens} prompt tokens")
    return cached


if __name__ == "__main__":
    try:
        main()
    except APIConnectionError as exc:  # the usual first stumble: no server running yet
        sys.exit(f"no server answers at {exc.request.url.scheme}://{exc.request.url.netloc.decode()}: start one with "
                 "`prefixcache serve` in another terminal (or set PREFIXCACHE_BASE_URL to where it listens)")
