"""Cache diagnostics: the first place two prompts part, the bounded per-tenant record, the SDK's call stats."""
from __future__ import annotations

from prefixcache import CacheConfig
from prefixcache.serving.diagnostics import BLOCK, MissReason, PromptRecords, compare, fingerprint

NS = ("tenant", "model")
SYSTEM = {"role": "system", "content": "You keep a bookshop."}
ASK = {"role": "user", "content": "Maps?"}
TOOL = {"type": "function", "function": {"name": "stock", "parameters": {"type": "object"}}}


def fp(chat=(SYSTEM, ASK), tools=None, choice=None, ids=tuple(range(100)), ns=NS):
    return fingerprint(ns, list(chat), tools, {"tool_choice": choice}, list(ids))


def test_the_first_divergence_in_prompt_order_names_the_reason():
    base = fp()
    assert compare(base, fp()) is None
    assert compare(base, fp(chat=(SYSTEM, ASK, {"role": "assistant", "content": "Yes."}, ASK))) is None
    # The cache moved: nothing is readable, whatever else changed.
    assert compare(base, fp(ns=("tenant", "model", "salt"), tools=[TOOL])) == MissReason("model_changed", 100)
    # Tools come before the system prompt, and both before messages.
    other_system = {"role": "system", "content": "Another shop."}
    assert compare(base, fp(chat=(other_system, {"role": "user", "content": "?"}), tools=[TOOL])).type == "tools_changed"
    assert compare(base, fp(chat=(other_system, ASK))).type == "system_changed"
    assert compare(base, fp(choice="none")) == MissReason("unavailable")
    assert compare(base, fp(chat=(SYSTEM, {"role": "user", "content": "Globes?"}))).type == "messages_changed"
    assert compare(base, fp(chat=(SYSTEM,))).type == "messages_changed"  # fewer messages: one was dropped
    # Text parts render as the text, and cache markers are no part of a prompt.
    parts = {"role": "user", "content": [{"type": "text", "text": "Maps?", "cache_control": {"type": "ephemeral"},
                                          "prefixcache_chunk": True}]}
    assert compare(base, fp(chat=(SYSTEM, parts))) is None


def test_missed_tokens_are_the_previous_prompt_after_the_shared_blocks():
    before = fp(ids=range(100))
    changed = list(range(100))
    changed[40] = -1
    miss = compare(before, fp(chat=(SYSTEM, {"role": "user", "content": "Else"}), ids=changed))
    assert miss == MissReason("messages_changed", 100 - BLOCK * (40 // BLOCK))


def test_the_record_is_per_tenant_bounded_and_expires(clock):
    records = PromptRecords(clock, per_tenant=2, tenants=2, retain_seconds=60)
    base = fp()
    assert records.diagnose("a", base, None, "r1") is None
    assert records.diagnose("a", base, "r1", "r2") is None
    assert records.diagnose("b", base, "r1", None) == MissReason("previous_message_not_found")  # a's, not b's
    records.diagnose("a", base, None, "r3")  # a keeps its last 2 ids
    assert records.diagnose("a", base, "r1", None).type == "previous_message_not_found"
    assert records.diagnose("a", base, "r2", None) is None
    clock.advance(61)
    assert records.diagnose("a", base, "r3", None).type == "previous_message_not_found"
    for tenant in ("b", "c", "d"):  # at most 2 tenants: the least recently recorded goes
        records.diagnose(tenant, base, None, "x")
    assert records.diagnose("b", base, "x", None).type == "previous_message_not_found"
    assert records.diagnose("d", base, "x", None) is None and len(records) == 2


def test_the_record_is_bounded_in_bytes_the_least_recently_used_tenant_first(clock):
    base = fp(ids=range(1600))  # 100 blocks
    records = PromptRecords(clock, max_bytes=3 * base.nbytes)
    for tenant, record_id in (("a", "1"), ("b", "1"), ("a", "2"), ("b", "2")):
        records.diagnose(tenant, base, None, record_id)
    assert len(records) == 3 and records.nbytes == 3 * base.nbytes
    assert records.diagnose("a", base, "1", None).type == "previous_message_not_found"  # a's oldest went first
    assert records.diagnose("b", base, "1", None) is None
    records.diagnose("c", fp(ids=range(16000)), None, "big")  # larger than the bound: recorded, then dropped
    assert records.nbytes <= 3 * base.nbytes


def test_sdk_call_stats_carry_the_miss_reason(new_cache, chat_llama, tokenizer, clock):
    cache = new_cache(chat_llama, tokenizer, CacheConfig(block_size=8), clock=clock, start_sweeper=False)
    first = cache.chat([SYSTEM, ASK], max_new_tokens=2, record_id="turn-1")
    assert first.stats.miss_reason is None
    again = cache.chat([{"role": "system", "content": "Another shop."}, ASK], max_new_tokens=2, previous_id="turn-1")
    assert again.stats.miss_reason == "system_changed" and again.stats.cache_missed_tokens > 0
    assert cache.last_call.miss_reason == "system_changed"
    assert cache.chat([SYSTEM, ASK], max_new_tokens=2, previous_id="turn-1").stats.miss_reason is None
    assert cache.chat([SYSTEM, ASK], max_new_tokens=2, previous_id="turn-1",
                      tenant="other").stats.miss_reason == "previous_message_not_found"
    # Anthropic-shaped calls too; the fingerprint compares the chat they become.
    cache.messages([ASK], system=SYSTEM["content"], max_tokens=2, record_id="m-1")
    edited = cache.messages([{"role": "user", "content": "Globes?"}], system=SYSTEM["content"], max_tokens=2,
                            previous_id="m-1")
    assert edited.stats.miss_reason == "messages_changed" and edited.cache is not None
    assert cache.messages([ASK], system=SYSTEM["content"], max_tokens=2, previous_id="turn-1").stats.miss_reason is None
