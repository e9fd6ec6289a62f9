"""Cache diagnostics: why a request could not reuse the prefix of an earlier one, in Anthropic's terms.

A call that asks for diagnostics leaves a fingerprint of its prompt under its id (a
response id); a later call names that id and learns the first place where the two
prompts part, as Anthropic's ``diagnostics.cache_miss_reason`` (the shapes the official
``anthropic`` client reads):

- ``model_changed``: the cache the prompt is read from differs: the model (weights, dtype,
  chat template) or the namespace ``cache_salt`` selects; nothing could be reused.
- ``tools_changed``, ``system_changed``: the tool definitions (added, removed, reordered or
  edited), or the system prompt (OpenAI's leading system and developer messages), differ.
- ``unavailable``: model, tools and system match but another prompt-affecting parameter
  (``tool_choice``) differs, so no diagnosis is given.
- ``messages_changed``: an earlier message differs, instead of messages only appended.
- ``previous_message_not_found``: no fingerprint under that id for this tenant (never
  recorded, expired, pushed out of the bounded record, or another tenant's).

The four ``*_changed`` reasons carry ``cache_missed_input_tokens``: the previous prompt's
tokens after the longest token prefix the two share (the whole previous prompt for
``model_changed``), counted in whole blocks of ``BLOCK`` tokens: an estimate, as
Anthropic's is. No divergence (the same prompt, or messages appended) is no reason:
``None``. They are checked in prompt order: model, tools, system, then the other
parameters, then messages. Cache markers (``cache_control``, ``prompt_cache_breakpoint``,
``prefixcache_chunk``) are not part of a fingerprint: moving one changes no prompt.

A fingerprint holds hashes and token counts only, never prompt text (8 bytes per message and
per ``BLOCK`` prompt tokens). The record is per tenant and bounded: ``PER_TENANT`` ids each,
``TENANTS`` tenants and ``RECORD_BYTES`` of fingerprints in all, the least recently used
tenant's oldest ids dropped first; ids expire ``RETAIN_SECONDS`` after they were recorded, on
the injected clock. The comparison runs before generation, so a stream carries it from its first event.
"""
from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from prefixcache.serving.canonicalize import CHUNK_FIELD
from prefixcache.serving.messages import common_prefix

#: Most ids recorded per tenant, tenants recorded, and how long an id stays, in seconds.
PER_TENANT = 512
TENANTS = 4096
RETAIN_SECONDS = 3600.0
#: Most bytes of fingerprint hashes recorded, all tenants together.
RECORD_BYTES = 64 << 20
#: Tokens per hashed block when estimating the tokens two prompts share.
BLOCK = 16
#: Every ``cache_miss_reason`` type, in the order they are checked (the last one found without a comparison).
REASONS = ("model_changed", "tools_changed", "system_changed", "unavailable", "messages_changed",
           "previous_message_not_found")
#: Keys that mark cache breakpoints: not part of the prompt.
_MARKERS = frozenset({"cache_control", "prompt_cache_breakpoint", CHUNK_FIELD})
_SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True, slots=True)
class MissReason:
    """Anthropic's ``cache_miss_reason``: ``type`` (one of ``REASONS``) and, for the ``*_changed`` types,
    ``cache_missed_input_tokens``."""

    type: str
    cache_missed_input_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A prompt as diagnostics compare it: a hash per part, chained hashes per message and per token block."""

    model: int
    tools: int
    system: int
    other: int
    messages: array  # ("Q") message i's hash chains messages 0..i
    blocks: array  # ("Q") block i's hash chains the prompt's tokens [0, (i + 1) * BLOCK)
    prompt_tokens: int

    @property
    def nbytes(self) -> int:
        """Bytes its hashes take (what the record's byte bound counts)."""
        return 8 * (4 + len(self.messages) + len(self.blocks))


def fingerprint(namespace: Sequence[str], chat: Sequence[dict[str, Any]], tools: Sequence[Any] | None,
                other: dict[str, Any], token_ids: Sequence[int]) -> Fingerprint:
    """The fingerprint of an OpenAI-shaped chat (an Anthropic request as ``messages.to_chat`` turns it into
    chat) whose prompt encodes to ``token_ids`` in the cache ``namespace`` (model identity, tenant, salt)."""
    split = 0
    while split < len(chat) and chat[split].get("role") in _SYSTEM_ROLES:
        split += 1
    chained, hashes = 0, array("Q")
    for message in chat[split:]:
        chained = xxhash.xxh3_64_intdigest(_canonical(message), chained)
        hashes.append(chained)
    blocks, key = array("Q"), 0
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        key = xxhash.xxh3_64_intdigest(array("q", token_ids[start: start + BLOCK]).tobytes(), key)
        blocks.append(key)
    return Fingerprint(_hash(list(namespace)), _hash(list(tools or [])), _hash(list(chat[:split])), _hash(other),
                       hashes, blocks, len(token_ids))


def compare(previous: Fingerprint, current: Fingerprint) -> MissReason | None:
    """Why ``current`` could not reuse all of ``previous``'s prompt (None: it could)."""
    if previous.model != current.model:
        return MissReason("model_changed", previous.prompt_tokens)
    missed = previous.prompt_tokens - BLOCK * common_prefix(previous.blocks, current.blocks)
    for kind, same in (("tools_changed", previous.tools == current.tools),
                       ("system_changed", previous.system == current.system)):
        if not same:
            return MissReason(kind, missed)
    if previous.other != current.other:
        return MissReason("unavailable")
    n = len(previous.messages)
    if n > len(current.messages) or (n and previous.messages[-1] != current.messages[n - 1]):
        return MissReason("messages_changed", missed)
    return None


class PromptRecords:
    """Fingerprints of recent calls by tenant and id, bounded; thread-safe."""

    def __init__(self, clock: Callable[[], float], per_tenant: int = PER_TENANT, tenants: int = TENANTS,
                 retain_seconds: float = RETAIN_SECONDS, max_bytes: int = RECORD_BYTES):
        self._clock, self.per_tenant, self.tenants, self.retain_seconds = clock, per_tenant, tenants, retain_seconds
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._records: OrderedDict[str, OrderedDict[str, tuple[float, Fingerprint]]] = OrderedDict()
        self._bytes = 0

    def diagnose(self, tenant: str, current: Fingerprint, previous_id: str | None,
                 record_id: str | None) -> MissReason | None:
        """Compare ``current`` with the fingerprint ``tenant`` recorded under ``previous_id`` (if given), then
        record ``current`` under ``record_id`` (if given)."""
        with self._lock:
            now = self._clock()
            ids = self._records.get(tenant)
            reason = None
            if previous_id is not None:
                found = None if ids is None else ids.get(previous_id)
                if found is None or found[0] <= now:
                    reason = MissReason("previous_message_not_found")
                else:
                    reason = compare(found[1], current)
            if record_id is not None:
                self._record(tenant, record_id, current, now)
            return reason

    def __len__(self) -> int:
        with self._lock:
            return sum(len(ids) for ids in self._records.values())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _record(self, tenant: str, record_id: str, current: Fingerprint, now: float) -> None:
        ids = self._records.pop(tenant, None) or OrderedDict()
        self._records[tenant] = ids  # most recently used last
        self._drop(ids, record_id)
        ids[record_id] = (now + self.retain_seconds, current)
        self._bytes += current.nbytes
        while ids and (len(ids) > self.per_tenant or next(iter(ids.values()))[0] <= now):
            self._drop(ids, next(iter(ids)))  # ids expire in the order they were recorded
        while len(self._records) > self.tenants or self._bytes > self.max_bytes:
            oldest = next(iter(self._records.values()))  # the least recently used tenant's ids, oldest first
            if oldest:
                self._drop(oldest, next(iter(oldest)))
            else:
                self._records.popitem(last=False)

    def _drop(self, ids: OrderedDict[str, tuple[float, Fingerprint]], record_id: str) -> None:
        found = ids.pop(record_id, None)
        if found is not None:
            self._bytes -= found[1].nbytes


def _hash(value: Any) -> int:
    return xxhash.xxh3_64_intdigest(_canonical(value))


def _canonical(value: Any) -> bytes:
    """JSON of ``value`` without cache markers, keys sorted; a list of text parts as the text it renders."""
    return json.dumps(_strip(value), sort_keys=True, ensure_ascii=False, default=str).encode()


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        out = {k: _strip(v) for k, v in value.items() if k not in _MARKERS and v is not None}
        content = out.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            out["content"] = "\n".join(str(p.get("text")) for p in content)
        return out
    if isinstance(value, (list, tuple)):
        return [_strip(v) for v in value]
    return value
