"""KV snapshot store: the trie plus refcounts, byte accounting and the memory policy.

A snapshot (``node.kv``) is published once, when its node is added, and never written
again: readers copy from it, writers create new nodes. All methods take the store's
lock, so lookups, inserts and evictions from many threads are serialised; model work
happens outside it. Lock order: the store's lock, then the KV ledger's (``ledger``), never
the reverse: a block is added under both, so no reservation lands between the check of
``bytes + ledger.reserved`` against the ledger's total and the bytes it admits.

Work under the lock does not grow with what is stored: evictable leaves (by last access)
and TTL candidates (by deadline) live in keyed heaps, and the figures ``snapshot_stats``
reports are running totals. ``index.sync(node)`` keeps both up to date and is called after
every change to a node's refcount, pins, pin deadline or children, and to a leaf's access time or deadline.
The budget, quotas and TTL are enforced by ``eviction``, through the store's public methods
(``now``, ``free``, ``reindex``); ``integrity`` audits it through them too, under its lock.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from prefixcache.cache.eviction import (
    evict_to,
    expire,
    flush_all,
    lapse_pins,
    make_room,
    make_room_for_tail,
    room,
)
from prefixcache.cache.handles import (
    EvictedSnapshot,
    EvictHook,
    FlushedMeanwhile,
    InsertResult,
    KVSlicer,
    Lease,
    LowerTiers,
    evicted_snapshot,
)
from prefixcache.cache.hashing import BlockHasher
from prefixcache.cache.index import StoreIndex
from prefixcache.cache.integrity import audit_store, check_store
from prefixcache.cache.ledger import KVLedger, Reservation
from prefixcache.cache.policy import OFFLOAD_REASONS, evictable, expiry, tenant_pins
from prefixcache.cache.run_book import RunBook
from prefixcache.cache.runs import RunOps, TensorRuns
from prefixcache.cache.scope import Scope
from prefixcache.cache.trie import Node, PrefixTrie
from prefixcache.config import CacheConfig
from prefixcache.errors import PinQuotaExceededError

log = logging.getLogger(__name__)


class KVStore:
    def __init__(self, config: CacheConfig, hasher: BlockHasher, clock: Callable[[], float],
                 on_evict: EvictHook | None = None, kv_ops: RunOps | None = None):
        self.config = config
        # What snapshot payloads are: tensors by default, byte sizes for a replay (``cache.sized``).
        self._kv: RunOps = TensorRuns() if kv_ops is None else kv_ops
        # All KV memory: these snapshots plus what running requests reserve (``ledger.reserved``).
        self.ledger = KVLedger(config.kv_total_bytes, config.kv_wait_seconds)
        self.trie = PrefixTrie(config.block_size, hasher)
        self._clock = clock
        self._on_evict = on_evict
        self.lower: LowerTiers | None = None  # the tier chain (``attach``)
        self._lock = threading.RLock()
        #: Inserts, counted under the lock: only an insert can lengthen a match (it adds blocks, or gives an
        #: expired one in use a new deadline), so a lease taken at the current count is still the longest
        #: match (``Lease.version``).
        self.writes = 0
        self.flushes = 0  # flushes so far: a restore that read the tiers across one stores nothing
        self.bytes = 0
        self.tenant_bytes: Counter[str] = Counter()
        # Eviction and expiry candidates and per-tenant totals (evictions too), kept in step with every node change.
        self.index = StoreIndex(by_tenant=config.tenant_quota_bytes is not None)
        # Run tensors (see ``_grow``) and the live blocks viewing each (``run_book``).
        self.runs = RunBook(self._kv)
        self.ledger.attach(self)

    def now(self) -> float:
        """The store's clock (monotonic seconds): what TTL deadlines are measured against."""
        return self._clock()

    @property
    def payloads(self) -> RunOps:
        """What snapshot payloads are (tensors, or byte sizes for a replay) and how they are measured."""
        return self._kv

    def attach(self, lower: LowerTiers | None) -> None:
        """Put ``lower`` (a tier chain) below the store: evicted blocks go down, misses look there."""
        self.lower = lower

    # -- read path -----------------------------------------------------------------
    def acquire(self, scope: Scope, tokens: Sequence[int], limit: int, restore: bool = False) -> Lease:
        """Match the longest live prefix of ``tokens[:limit]`` in ``scope`` and pin it (refcount walk);
        the matched blocks' deadlines move to at least ``scope.ttl_seconds`` from now.

        With ``restore`` and lower tiers attached, full blocks past the device match are first
        looked up there (outside the store's lock: this may read a disk or the network) and
        stored, so the lease covers them too. Anything failing there leaves the device match.
        """
        lease = self._acquire(scope, tokens, limit)
        if not restore or self.lower is None:
            return lease
        from prefixcache.cache.tiers.restore import restore_below  # the tiers (and torch) load only when attached

        return restore_below(self, self.lower, lease, scope, tokens, limit)

    def _acquire(self, scope: Scope, tokens: Sequence[int], limit: int) -> Lease:
        with self._lock:
            now = self._clock()
            root = self.trie.root(scope.namespace, scope.tenant, create=False)
            if root is None or limit <= 0:
                return Lease(None, [], 0, version=self.writes)
            steps = self.trie.match(root, tokens, limit, lambda n: _usable(n, now))
            root.refcount += 1
            for step in steps:
                self._ref(step.node, +1)
            self._touch([s.node for s in steps], now, scope.ttl_seconds)
            return Lease(root, steps, sum(s.used for s in steps), version=self.writes)

    def peek(self, scope: Scope, tokens: Sequence[int], limit: int) -> int:
        """Tokens of ``tokens[:limit]`` a lookup in ``scope`` would match now; pins, touches and frees nothing."""
        with self._lock:
            now = self._clock()
            root = self.trie.root(scope.namespace, scope.tenant, create=False)
            if root is None or limit <= 0:
                return 0
            return sum(s.used for s in self.trie.match(root, tokens, limit, lambda n: _usable(n, now)))

    def retain(self, scope: Scope, tokens: Sequence[int]) -> int:
        """Keep the stored path of ``tokens`` for at least ``scope.ttl_seconds`` more (a later deadline stays).

        Returns the tokens of ``tokens`` the path covers (fewer when part of it is not stored).
        The blocks are touched root-first, as a lookup touches them, so a parent never expires
        before its child.
        """
        with self._lock:  # touches usable blocks only: no match grows (``writes`` stays)
            now = self._clock()
            root = self.trie.root(scope.namespace, scope.tenant, create=False)
            if root is None or not tokens:
                return 0
            steps = self.trie.match(root, tokens, len(tokens), lambda n: _usable(n, now))
            self._touch([s.node for s in steps], now, scope.ttl_seconds)
            return sum(s.used for s in steps)

    def release(self, lease: Lease) -> None:
        """Drop a lease's refcounts; nodes flushed or expired meanwhile are freed now."""
        with self._lock:
            already, lease.released = lease.released, True
            if already or lease.root is None:
                return
            for step in lease.steps:
                self._ref(step.node, -1)
            lease.root.refcount -= 1
            now = self._clock()
            for step in reversed(lease.steps):
                node = step.node
                if node.alive and node.refcount == 0 and node.num_children == 0 and not _usable(node, now):
                    self.free(node, "flush" if node.doomed else "ttl")
            self.trie.drop_root_if_empty(lease.root)
            self._compact()

    # -- write path ----------------------------------------------------------------
    def insert(self, scope: Scope, tokens: Sequence[int], slice_kv: KVSlicer, pin: bool = False,
               privileged: bool = False, own: Reservation | None = None, _restoring: bool = False,
               _flushes: int | None = None) -> InsertResult:
        """Store the KV of ``tokens`` (all of them) in ``scope``, block by block, kept for ``scope.ttl_seconds``.

        Blocks are added root-first, so what is stored is always a prefix of
        ``tokens``; under budget or quota pressure the tail is dropped, never an error.
        With ``pin``, the whole stored path is pinned (``unpin`` with the same ``privileged`` undoes it) until
        the pin's own deadline, ``config.pin_ttl_seconds`` from now (renewed by reads; none if ``privileged``;
        the two kinds of pins are counted apart). Unless
        ``privileged``, a pin whose newly pinned bytes would take the tenant's pinned
        bytes over ``config.pin_quota_bytes`` raises ``PinQuotaExceededError`` before
        anything is stored or evicted. With lower tiers attached, new blocks (write-through
        policy) or the whole pinned path are queued for them. ``own`` is the calling request's reservation of
        the buffer ``slice_kv`` copies from, when that buffer is freed right after: each block added takes over its
        bytes (from ``own`` to the stored bytes, so ``stored + reserved`` never grows), so what the request
        computed is stored as it would be once its buffer is gone, not squeezed out by that buffer. A restore
        passes ``_flushes``, the count it saw before reading the tiers: after a flush since, ``FlushedMeanwhile``
        (nothing stored).
        """
        with self._lock:
            if _flushes is not None and _flushes != self.flushes:
                raise FlushedMeanwhile("a flush came between this restore's tier read and its insert")
            self.writes += 1
            now = self._clock()
            tenant = scope.tenant
            root = self.trie.root(scope.namespace, tenant, create=True)
            root.refcount += 1  # the root outlives the insert even if nothing is stored
            lapse_pins(self, now)  # a lapsed pin counts against no quota
            pin_room = None if not pin or privileged else self._pin_room(tenant)
            path: list[Node] = []
            try:
                added, pos = self._grow(root, tokens, slice_kv, tenant, path, now, pin_room, own)
            finally:
                root.refcount -= 1
                self.trie.drop_root_if_empty(root)
            self._touch(path, now, scope.ttl_seconds)
            complete = pos == len(tokens)
            if pin and complete:
                # Counted apart: the operator's pins have no deadline; a tenant's have their own, whatever the
                # blocks' TTL (after pin_ttl_seconds unless a read renews it), and the operator's never move it.
                pin_until = expiry(now, self.config.pin_ttl_seconds)
                for node in path:
                    if privileged:
                        node.operator_pins += 1
                    else:
                        node.pin_until = pin_until if not tenant_pins(node) else max(node.pin_until, pin_until)
                    node.pins += 1
                    self.reindex(node)
            if self.lower is not None and not _restoring and (pin or self.lower.write_through):
                down = path if pin and complete else added
                self.lower.stored([evicted_snapshot(n, "stored", n.kv, now) for n in down])
            self._compact()
            return InsertResult(pos, sum(n.nbytes for n in added), complete)

    def _grow(self, root: Node, tokens: Sequence[int], slice_kv: KVSlicer, tenant: str,
              path: list[Node], now: float, pin_room: int | None,
              own: Reservation | None = None) -> tuple[list[Node], int]:
        """Walk existing blocks, then add the missing tail; returns (new blocks, tokens covered).

        ``path`` receives every block of the stored prefix, root-first. Eviction and expiry
        free only leaves the indexes offer, so while blocks are added (and others evicted to
        make room) the path is safe if its deepest walked block is held (refcount) and the new
        blocks are not indexed yet: they enter the indexes when the insert ends (``_touch``
        syncs the new leaf; the blocks above it have a child and belong to no index). Blocks
        walked past cost no index update.

        New blocks always form the tail of the path (a new node has no children yet), so
        their KV is sliced once into one *run* tensor and each block holds a view of it:
        consecutive blocks of a run are adjacent in memory and read as one (``coalesce``).
        ``pin_room`` (None: no limit) bounds the bytes a pin of the whole path may newly pin.
        """
        bs, n = self.config.block_size, len(tokens)
        attach, pos = self._walk(root, tokens, path, now)
        run = slice_kv(pos, n) if pos < n else None
        if pin_room is not None:
            missing = 0 if run is None else (n - pos) * self._kv.per_token(run)
            self._check_pin_room(path, missing, pin_room)
        if run is None or (path and len(path[-1].tokens) < bs):
            return [], pos
        first = pos
        per_token = self._kv.per_token(run)
        full = bs * per_token  # one int shared by every full block (a replay holds millions)
        added: list[Node] = []
        walked = attach
        one_pass, limit = self.config.tenant_quota_bytes is None, None  # no quota: ``make_room_for_tail``
        ledger = self.ledger  # its lock is taken under the store's (``ledger``: the lock order)
        self._ref(walked, +1)
        try:
            while pos < n:
                chunk = tuple(tokens[pos : pos + bs])
                nbytes = full if len(chunk) == bs else len(chunk) * per_token
                if limit is not None:
                    if self.bytes + nbytes > limit:
                        break
                elif not make_room(self, nbytes, tenant, 0 if own is None else own.nbytes):
                    break
                # Copy-on-write: shorter partial siblings are replaced if unused (a new node has no children).
                for old in self.trie.superseded(attach, chunk) if attach.num_children else ():
                    if evictable(old):
                        self.free(old, None)
                with ledger.lock:  # a reservation may have landed since the room was planned
                    taken = 0 if own is None else min(nbytes, own.nbytes)
                    if not ledger.fits_stored(nbytes - taken):
                        break
                    node = self.trie.add_child(attach, chunk)
                    node.kv, node.nbytes = self._kv.view(run, pos - first, pos - first + len(chunk)), nbytes
                    self._account(node, +1)
                    if taken:
                        own.hand_over(taken)
                if attach is walked:  # it has a child now: no longer a leaf, and safe without the hold
                    walked = None
                    self._ref(attach, -1)
                path.append(node)
                added.append(node)
                pos += len(chunk)
                attach = node
                if one_pass and limit is None and pos < n:
                    limit = make_room_for_tail(self, (n - pos) * per_token, 0 if own is None else own.nbytes)
        except BaseException:
            for node in added:
                self.reindex(node)
            raise
        finally:
            if walked is not None:
                self._ref(walked, -1)
        if added and pos < n:  # cut short: keep only the bytes of the blocks stored
            run = self._kv.copy(run, pos - first)
            for node in added:
                node.kv = self._kv.view(run, node.start - first, node.end - first)
        if added:
            self.runs.add(run, added)
        return added, pos

    def _walk(self, root: Node, tokens: Sequence[int], path: list[Node], now: float) -> tuple[Node, int]:
        """Append the live stored blocks of ``tokens`` to ``path``; returns (the last full one or root, tokens covered)."""
        bs, pos, attach = self.config.block_size, 0, root
        usable = lambda node: _usable(node, now)  # noqa: E731
        while pos < len(tokens):
            chunk = tuple(tokens[pos : pos + bs])
            node = self.trie.covering(attach, chunk, usable)
            if node is None:
                break
            path.append(node)
            pos += len(chunk)
            if len(chunk) < bs or len(node.tokens) < bs:
                break
            attach = node
        return attach, pos

    def check_pin(self, scope: Scope, tokens: Sequence[int], per_token: int) -> None:
        """Raise ``PinQuotaExceededError`` now if a tenant's pin of ``tokens`` in ``scope`` would (as ``insert``
        decides it) newly pin more than the tenant's pin quota leaves: before any work, nothing stored or
        evicted. The tokens not stored yet are counted at ``per_token`` bytes each."""
        with self._lock:
            now = self._clock()
            lapse_pins(self, now)
            path: list[Node] = []
            root = self.trie.root(scope.namespace, scope.tenant, create=False)
            pos = 0 if root is None else self._walk(root, tokens, path, now)[1]
            self._check_pin_room(path, (len(tokens) - pos) * per_token, self._pin_room(scope.tenant))

    def _pin_room(self, tenant: str) -> int:
        """Bytes a tenant's pins may still newly pin under its pin quota."""
        return self.config.pin_quota_bytes - self.index.pinned_bytes[tenant]

    def _check_pin_room(self, existing: list[Node], missing: int, room: int) -> None:
        """Refuse a pin that would newly pin more than ``room`` bytes (the tenant's own figures only)."""
        need = missing + sum(n.nbytes for n in existing if n.pins == 0)
        if need > room:
            quota = self.config.pin_quota_bytes
            raise PinQuotaExceededError.of(quota - room, quota, need)

    def unpin(self, scope: Scope, tokens: Sequence[int], privileged: bool = False) -> int:
        """Undo one ``pin`` of exactly this token path in ``scope``: the tenant's, or with ``privileged`` the
        operator's (each undoes its own pins only). Returns the tokens unpinned (0 if it was not pinned so, or
        the tenant's pin lapsed)."""
        mine = (lambda n: n.operator_pins) if privileged else tenant_pins
        with self._lock:
            lapse_pins(self, self._clock())
            root = self.trie.root(scope.namespace, scope.tenant, create=False)
            if root is None:
                return 0
            steps = self.trie.match(root, tokens, len(tokens), lambda n: n.alive)
            if sum(s.used for s in steps) != len(tokens) or any(mine(s.node) == 0 for s in steps):
                return 0
            # A pin of a longer path counts once in its last block here and once in a child: only pins that end
            # in that block are this path's to undo (a shorter path would strand its continuation's pin).
            last = steps[-1].node
            if mine(last) - sum(mine(child) for child in last.children() if child.alive) < 1:
                return 0
            for step in steps:
                step.node.pins -= 1
                if privileged:
                    step.node.operator_pins -= 1
                self.reindex(step.node)
            return len(tokens)

    # -- policy --------------------------------------------------------------------
    def reclaim(self, limit: int) -> bool:
        """Give way to a request's KV: free expired, then unpinned unread snapshots until at most ``limit``
        bytes are stored. Whether that was reached (pinned and leased ones stay)."""
        with self._lock:
            if self.bytes <= limit:
                return True
            expire(self, self._clock())
            done = evict_to(self, limit)
            self._compact()
            return done

    def can_admit(self, need: int, tenant: str) -> bool:
        """Whether ``need`` more bytes could be stored for ``tenant`` now, evicting only what may go."""
        with self._lock:
            lapse_pins(self, self._clock())
            cfg = self.config
            # Pinned and leased nodes are closed upwards (a pin or lease covers the path from the
            # root), so everything else can go, leaves first: only protected bytes stay.
            if cfg.tenant_quota_bytes is not None and self.index.protected_bytes[tenant] + need > cfg.tenant_quota_bytes:
                return False
            return sum(self.index.protected_bytes.values()) + need <= room(self)

    def sweep(self) -> int:
        """Free every expired prefix nobody is reading. Returns bytes freed."""
        with self._lock:
            freed = expire(self, self._clock())
            self._compact()
            return freed

    def flush(self, tenant: str | None = None) -> int:
        """Drop every prefix (of one tenant, or all). Prefixes in use die on release."""
        with self._lock:
            self.flushes += 1
            freed = flush_all(self, tenant)
            self._compact()
            return freed

    # -- bookkeeping ---------------------------------------------------------------
    def _touch(self, nodes: list[Node], now: float, ttl_seconds: float | None) -> None:
        """Refresh access time, deadline and pin deadline. Access time and deadline only key the heaps
        of leaves, so only leaves are re-indexed for them (callers sync any other change themselves)."""
        until = expiry(now, ttl_seconds)
        # A pin's deadline is its own, apart from the block's: an access renews it to pin_ttl_seconds from
        # now whatever TTL it asks, so a tenant's pin idles out; the operator's pins, without one, keep none.
        pin_until = expiry(now, self.config.pin_ttl_seconds)
        sync = self.index.sync
        for node in nodes:  # root-first, so a parent never expires (or loses its pin) before its child
            node.last_access = now
            # New (or expired but still in use) nodes take the new deadline; live ones keep the later one.
            expires = node.expires_at
            node.expires_at = until if expires <= now else (expires if expires > until else until)
            if node.pins > node.operator_pins and node.pin_until < pin_until:
                node.pin_until = pin_until
                sync(node)  # the pin deadline heap holds inner nodes too
            elif not node.num_children:
                sync(node)

    def _ref(self, node: Node, delta: int) -> None:
        node.refcount += delta
        self.reindex(node)

    def reindex(self, node: Node) -> None:
        """Bring the eviction and expiry indexes in line with ``node`` after a change to its refcount,
        pins or children (``index.sync``, O(log n)). The caller holds the store's lock."""
        self.index.sync(node)

    def _account(self, node: Node, sign: int) -> None:
        nbytes, tenant = sign * node.nbytes, node.tenant
        self.bytes += nbytes
        self.tenant_bytes[tenant] += nbytes
        self.index.count(node, sign)

    def free(self, node: Node, reason: str | None) -> None:
        """Drop ``node``, a leaf nobody reads: its bytes leave the totals and the indexes, its parent may
        become a leaf, the offload hook and (for ``OFFLOAD_REASONS``) the lower tiers get a copy, and
        the eviction is counted under ``reason`` (None: superseded by a longer copy of itself, not an
        eviction). The caller holds the store's lock (``eviction`` runs inside store operations)."""
        lower = self.lower if self.lower is not None and reason in OFFLOAD_REASONS else None
        if (self._on_evict is not None or lower is not None) and reason is not None:
            snap = evicted_snapshot(node, reason, self._kv.own(node.kv, node.nbytes), self._clock())
            for hook in (self._on_evict, None if lower is None else lower.offload):
                try:
                    if hook is not None:
                        hook(snap)
                except Exception:  # a failing tier must never break eviction or a request
                    log.exception("offload hook failed; snapshot dropped")
        self.trie.remove_leaf(node)
        self._account(node, -1)
        sync = self.index.sync
        sync(node)
        sync(node.parent)  # may have become a leaf
        if reason is not None:
            self.index.evicted(node, reason)
        self.runs.drop(node)
        node.kv = None

    def _compact(self) -> None:
        self.runs.compact()

    def snapshots(self) -> list[EvictedSnapshot]:
        """Every live block (views, no copies; snapshots never change), e.g. to keep them at shutdown."""
        with self._lock:
            now = self._clock()
            return [evicted_snapshot(n, "shutdown", n.kv, now) for n in self.trie.iter_nodes()
                    if _usable(n, now)]

    @property
    def evictions(self) -> dict[str, int]:
        """Blocks evicted so far, by reason, over all tenants."""
        with self._lock:
            return self.index.by_reason(self.index.evictions, None)

    def snapshot_stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Memory figures for one tenant's entries, or (None) the whole store: running totals, O(tenants)."""
        with self._lock:
            lapse_pins(self, self._clock())  # lapsed pins are not reported as pinned
            return {
                "bytes": self.bytes if tenant is None else self.tenant_bytes[tenant],
                "budget_bytes": self.config.max_bytes,
                "tenant_quota_bytes": self.config.tenant_quota_bytes,
                "pin_quota_bytes": self.config.pin_quota_bytes,
                "tenant_bytes": {t: b for t, b in self.tenant_bytes.items() if b and (tenant in (None, t))},
                **self.index.figures(tenant),
            }

    def audit(self) -> dict[str, int]:
        """Recount by walking every node (``integrity.audit_store``; for checks, not for stats)."""
        with self._lock:
            return audit_store(self)

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the store is broken (``integrity.check_store``)."""
        with self._lock:
            check_store(self)


def _usable(node: Node, now: float) -> bool:
    return node.alive and not node.doomed and node.expires_at > now  # expired from its deadline on
