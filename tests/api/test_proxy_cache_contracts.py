"""Today's hosted cache contracts through the official clients, unchanged but for ``base_url`` and ``api_key``.

Anthropic's automatic caching (a top-level ``cache_control``) and cache diagnostics;
OpenAI's ``prompt_cache_options`` and ``prompt_cache_breakpoint``. The tiny model's
minimum cacheable length is set low and blocks are 8 tokens.
"""
from __future__ import annotations

import anthropic
import pytest
from prefixcache_api import create_app
from proxy_support import ALPHA, MODEL, live, make_cache, settings

SYSTEM_TEXT = "You are the support assistant of a small bookshop. Be brief and kind. " * 4


def client(url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def srv(tiny_model, tokenizer):
    cache = make_cache(tiny_model, tokenizer, breakpoint_min_tokens=16, block_size=8)
    with live(create_app(settings(), cache=cache)) as server:
        yield server
    cache.close()


@pytest.fixture
def alpha(srv):
    srv.cache.flush()
    return client(srv.url, ALPHA)


# -- Anthropic: automatic caching ----------------------------------------------------------
def test_automatic_caching_writes_the_conversation_then_the_next_turn_reads_it(srv, alpha):
    turn = [{"role": "user", "content": "Do you sell maps of the old town?"}]
    first = alpha.messages.create(model=MODEL, max_tokens=3, system=SYSTEM_TEXT, messages=turn,
                                  cache_control={"type": "ephemeral"})
    u = first.usage
    counted = alpha.messages.count_tokens(model=MODEL, system=SYSTEM_TEXT, messages=turn,
                                          cache_control={"type": "ephemeral"}).input_tokens
    # The marker closes the whole conversation (all but the generation prompt): written, for 5 minutes.
    assert u.cache_read_input_tokens == 0 and u.cache_creation_input_tokens > counted - 8
    assert u.cache_creation.ephemeral_5m_input_tokens == u.cache_creation_input_tokens
    assert u.input_tokens + u.cache_creation_input_tokens == counted

    turn += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "And globes?"}]
    second = alpha.messages.create(model=MODEL, max_tokens=3, system=SYSTEM_TEXT, messages=turn,
                                   cache_control={"type": "ephemeral", "ttl": "1h"})
    v = second.usage
    # The next turn reads what the first wrote, and the marker moves forward: the new turn is written, for 1 hour.
    assert v.cache_read_input_tokens >= u.cache_creation_input_tokens
    assert v.cache_creation_input_tokens > 0 and v.cache_creation.ephemeral_1h_input_tokens == v.cache_creation_input_tokens
    breakpoints = srv.cache.stats("alpha")["breakpoints"]
    assert breakpoints["5m"]["writes"] == 1 and breakpoints["1h"]["writes"] == 1


def test_automatic_caching_counts_within_the_four_breakpoints_and_their_ttl_order(srv, alpha):
    marked = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4"):
        alpha.messages.create(model=MODEL, max_tokens=2, cache_control={"type": "ephemeral"},
                              messages=[{"role": "user", "content": [marked] * 4 + [{"type": "text", "text": "?"}]}])
    with pytest.raises(anthropic.BadRequestError, match="must not come after"):
        alpha.messages.create(model=MODEL, max_tokens=2, cache_control={"type": "ephemeral", "ttl": "1h"},
                              system=[{**marked, "text": SYSTEM_TEXT}], messages=[{"role": "user", "content": "?"}])
    # Four markers with the automatic one on a block that has its own: still four.
    ok = alpha.messages.create(model=MODEL, max_tokens=2, cache_control={"type": "ephemeral"},
                               messages=[{"role": "user", "content": [marked] * 4}])
    assert ok.usage.output_tokens >= 1
