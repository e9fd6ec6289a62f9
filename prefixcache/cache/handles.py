"""What the store hands out: leases on matched prefixes, insert results, evicted snapshots."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prefixcache.cache.trie import Node, Step

if TYPE_CHECKING:  # annotations only: a replay on byte sizes never loads torch
    import torch


@dataclass(frozen=True, slots=True)
class EvictedSnapshot:
    """What the offload hook receives: enough to store the block elsewhere and restore it later.

    ``kv`` (``[L, 2, H, n, D]``) covers ``tokens[start:]``; ``tokens`` is the whole
    prefix from the namespace root, since a block's KV is only valid after it.
    ``expires_in`` is the TTL the block has left (None: none), so an entry asked to live long
    (a 1-hour breakpoint, a 24-hour retention) keeps its deadline in the lower tiers.
    """

    namespace: tuple[str, ...]
    tenant: str
    tokens: tuple[int, ...]
    start: int
    kv: torch.Tensor  # a ``SizedKV`` when the store holds byte sizes (``cache.sized``)
    reason: str  # an eviction reason, or "stored" (written through) / "shutdown" (kept at close)
    expires_in: float | None = None  # seconds of TTL left (None: no TTL)
    pinned: bool = False


#: Called once per snapshot just before it is dropped: the one place a tier can take it over.
EvictHook = Callable[[EvictedSnapshot], None]


class LowerTiers(Protocol):
    """The tier chain below the store, as the store sees it (``prefixcache.cache.tiers.TierChain``)."""

    write_through: bool

    def offload(self, snap: EvictedSnapshot) -> None:
        """A block leaving the device (called under the store's lock: must not block)."""

    def stored(self, snaps: Sequence[EvictedSnapshot]) -> None:
        """Blocks just stored (write-through) or pinned (called under the store's lock: must not block)."""

    def restore(self, namespace: tuple[str, ...], tokens: Sequence[int], first: int,
                limit: int, tenant: str) -> tuple[int, torch.Tensor] | None:
        """``(end, kv)``: the KV of ``tokens[first:end]`` (of ``tenant``'s namespace) from the tiers
        (``end <= limit``), or None."""


#: Returns a fresh tensor holding the KV of tokens [start, end), shape [L, 2, H, end-start, D].
KVSlicer = Callable[[int, int], "torch.Tensor"]


@dataclass(slots=True)
class Lease:
    """A pinned match. ``steps`` stay alive and unchanged until ``KVStore.release``."""

    root: Node | None
    steps: list[Step]
    cached_tokens: int
    released: bool = False
    #: ``KVStore.writes`` when the match was taken: while it is unchanged, a new match finds no more.
    version: int = -1

    @property
    def segments(self) -> list[tuple[torch.Tensor, int]]:
        """The matched snapshots and the tokens used of each, in order (a ``WorkingCache``'s segments)."""
        return [(step.node.kv, step.used) for step in self.steps]


class FlushedMeanwhile(LookupError):
    """A restore's tier read came before a flush that its insert would come after: nothing is stored."""


@dataclass(frozen=True, slots=True)
class InsertResult:
    stored_tokens: int  # tokens of the sequence now cached (prefix-closed)
    new_bytes: int
    complete: bool  # False when the budget or quota cut the insert short


def evicted_snapshot(node: Node, reason: str, kv: Any, now: float = 0.0) -> EvictedSnapshot:
    """What ``node`` hands to the eviction hook or the tiers: its prefix from the namespace root and
    ``kv`` (on eviction its own KV holding only its bytes, not a view keeping a whole run alive)."""
    chain, cur = [], node
    while cur is not None and not cur.is_root:
        chain.append(cur.tokens)
        cur = cur.parent
    tokens = tuple(t for block in reversed(chain) for t in block)
    namespace = cur.namespace if cur is not None else ()
    left = None if math.isinf(node.expires_at) else max(0.0, node.expires_at - now)
    return EvictedSnapshot(namespace, node.tenant, tokens, node.start, kv, reason, left, node.pins > 0)
