"""What the store hands out: leases on matched prefixes, insert results, evicted snapshots."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.cache.trie import Node, Step


@dataclass(frozen=True, slots=True)
class EvictedSnapshot:
    """What the offload hook receives: enough to store the block elsewhere and restore it later.

    ``kv`` (``[L, 2, H, n, D]``) covers ``tokens[start:]``; ``tokens`` is the whole
    prefix from the namespace root, since a block's KV is only valid after it.
    ``expires_at`` is the block's deadline on the store's clock (``math.inf``: none): an
    entry asked to live long (a 1-hour breakpoint, a 24-hour retention) outlives the
    memory tier, so a tier behind this hook keeps it in its lowest persistent level.
    """

    namespace: tuple[str, ...]
    tenant: str
    tokens: tuple[int, ...]
    start: int
    kv: torch.Tensor  # a ``SizedKV`` when the store holds byte sizes (``cache.sized``)
    reason: str
    expires_at: float = math.inf


#: Called once per snapshot just before it is dropped: the one place a tier can take it over.
EvictHook = Callable[[EvictedSnapshot], None]

#: Returns a fresh tensor holding the KV of tokens [start, end), shape [L, 2, H, end-start, D].
KVSlicer = Callable[[int, int], torch.Tensor]


@dataclass(slots=True)
class Lease:
    """A pinned match. ``steps`` stay alive and unchanged until ``KVStore.release``."""

    root: Node | None
    steps: list[Step]
    cached_tokens: int
    released: bool = False


@dataclass(frozen=True, slots=True)
class InsertResult:
    stored_tokens: int  # tokens of the sequence now cached (prefix-closed)
    new_bytes: int
    complete: bool  # False when the budget or quota cut the insert short


def evicted_snapshot(node: Node, reason: str, kv: Any) -> EvictedSnapshot:
    """What ``node`` hands to the eviction hook: its prefix from the namespace root and ``kv``, its own KV
    holding only its bytes (not a view keeping a whole run alive)."""
    chain, cur = [], node
    while cur is not None and not cur.is_root:
        chain.append(cur.tokens)
        cur = cur.parent
    tokens = tuple(t for block in reversed(chain) for t in block)
    namespace = cur.namespace if cur is not None else ()
    return EvictedSnapshot(namespace, node.tenant, tokens, node.start, kv, reason, node.expires_at)
