"""The read side of the tiers as the store uses it: on a device miss, restore the longest run below."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefixcache.cache.handles import FlushedMeanwhile, KVSlicer, Lease, LowerTiers
from prefixcache.cache.scope import Scope

if TYPE_CHECKING:
    from prefixcache.cache.store import KVStore

log = logging.getLogger(__name__)


def restore_below(store: KVStore, lower: LowerTiers, lease: Lease, scope: Scope, tokens: Sequence[int],
                  limit: int) -> Lease:
    """``lease`` (the device match), or a lease that also covers full blocks restored from ``lower``.

    Called outside the store's lock: the lookup may read a disk or the network. Restored
    blocks are stored like computed ones (``insert``), so the budget, quotas and accounting
    hold; anything failing leaves the device match (the rest is recomputed), and so does a flush
    between the tier read and the insert (what was read may be what the flush purged).
    """
    bs = store.config.block_size
    first = lease.cached_tokens // bs * bs
    if limit - first < bs:
        return lease
    flushes = store.flushes  # a flush after this read must not be undone by its insert
    try:
        found = lower.restore(scope.namespace, tokens, first, limit, scope.tenant)
        if found is None:
            return lease
        end, kv = found
        store.insert(scope, tokens[:end], restored_slicer(first, kv), _restoring=True, _flushes=flushes)
    except FlushedMeanwhile:
        log.debug("a flush came during a restore: the restored blocks are dropped")
        return lease
    except Exception as exc:  # noqa: BLE001 - a tier problem costs a recompute, never the request
        log.warning("restoring a prefix from the lower tiers failed: %s", exc)
        return lease
    more = store.acquire(scope, tokens, limit)
    store.release(lease)
    return more


def restored_slicer(first: int, kv: Any) -> KVSlicer:
    """Slices of ``kv`` (the KV of tokens from ``first``) as ``insert`` asks for them, each owning its bytes."""
    def slice_kv(start: int, end: int) -> Any:
        if start < first:  # the device lost a block meanwhile: the restored run no longer attaches
            raise LookupError("a restored run no longer attaches to the device prefix")
        if start == first and end - first == kv.shape[3]:
            return kv
        return kv[:, :, :, start - first : end - first].clone()
    return slice_kv
