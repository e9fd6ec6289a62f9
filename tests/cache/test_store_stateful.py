"""Random interleavings of every store operation; invariants checked after each step."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.cache.ledger import Reservation
from prefixcache.cache.policy import tenant_pins
from prefixcache.errors import PinQuotaExceededError
from tests.cache.store_helpers import BYTES_PER_TOKEN, NS, insert, kv_value, lease_values, make_store, scope
from tests.conftest import FakeClock

TENANTS = st.sampled_from(["a", "b", "c"])
# Few distinct tokens and short sequences: prefixes collide and share constantly.
SEQS = st.lists(st.integers(0, 3), min_size=1, max_size=14)
TTLS = st.sampled_from([None, 5.0, 30.0, 300.0])


class StoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        # All KV within 16 blocks: a request's reservation (``serve``) beyond 4 squeezes the store's room.
        self.store = make_store(self.clock, blocks_budget=12, block_size=3, quota_blocks=7, pin_quota_blocks=2,
                                total_blocks=16)
        self.leases: list[tuple[list[int], object, int]] = []  # tokens, lease, limit
        self.pins: list[tuple[str, list[int], bool]] = []  # tenant, tokens, the operator's
        self.operator_pins: set[tuple[str, tuple[int, ...]]] = set()  # kept through unpins: a superset

    @rule(tenant=TENANTS, tokens=SEQS, ttl=TTLS, pin=st.booleans(), privileged=st.booleans())
    def insert(self, tenant, tokens, ttl, pin, privileged):
        before = self.store.snapshot_stats()
        mine = self.store.snapshot_stats(tenant)["pinned_bytes"]
        try:
            result = insert(self.store, tenant, tokens, ttl=ttl, pin=pin, privileged=privileged)
        except PinQuotaExceededError:
            assert pin and not privileged
            after = self.store.snapshot_stats()  # refused before anything was stored or evicted
            assert (after["tenant_bytes"], after["evictions"]) == (before["tenant_bytes"], before["evictions"])
            return
        assert 0 <= result.stored_tokens <= len(tokens)
        if pin and not privileged:
            assert self.store.snapshot_stats(tenant)["pinned_bytes"] <= max(
                self.store.config.pin_quota_bytes, mine)
        if pin and result.complete:
            self.pins.append((tenant, tokens, privileged))
            if privileged:
                self.operator_pins.add((tenant, tuple(tokens)))

    @rule(tenant=TENANTS, tokens=SEQS, hold=st.booleans(), cut=st.integers(0, 3), ttl=TTLS)
    def lookup(self, tenant, tokens, hold, cut, ttl):
        deadlines = {id(n): n.expires_at for n in self.store.trie.iter_nodes()}
        limit = max(len(tokens) - cut, 0)  # the engine asks for len - 1; 0 happens for 1-token prompts
        lease = self.store.acquire(scope(tenant, ttl), tokens, limit)
        assert lease.cached_tokens <= limit
        # Whatever matched is exactly the KV of these tokens (never a colliding neighbour's).
        assert lease_values(lease) == [kv_value(tokens, i) for i in range(lease.cached_tokens)]
        for step in lease.steps:
            assert deadlines[id(step.node)] > self.clock.now, "an expired prefix was matched"
            assert not step.node.doomed, "a flushed prefix was matched"
        if hold:  # a concurrent reader keeps it while the rest goes on
            self.leases.append((tokens, lease, limit))
        else:
            self.store.release(lease)

    @rule(tenant=TENANTS, tokens=SEQS, blocks=st.integers(0, 8), own=st.booleans(), pin=st.booleans())
    def serve(self, tenant, tokens, blocks, own, pin):
        """A request reserves its buffer (if the total allows, evicting what may go), then stores what it computed
        there, its reservation taken over by the blocks stored (``own``) or not."""
        ledger = self.store.ledger
        nbytes = blocks * self.store.config.block_size * BYTES_PER_TOKEN
        if not ledger.try_set("serial", nbytes):
            return
        held = Reservation(ledger, "serial", nbytes)
        try:
            result = insert(self.store, tenant, tokens, pin=pin, privileged=True, own=held if own else None)
            assert self.store.bytes + ledger.reserved <= ledger.total
            assert nbytes - held.nbytes == (min(nbytes, result.new_bytes) if own else 0)
        finally:
            held.release()
        if pin and result.complete:
            self.pins.append((tenant, tokens, True))
            self.operator_pins.add((tenant, tuple(tokens)))

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), then_insert=st.booleans())
    def finish_request(self, data, then_insert):
        """A request ends: normally (insert, then release) or by raising mid-decode (release only)."""
        tokens, lease, _ = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        assert lease_values(lease) == [kv_value(tokens, i) for i in range(lease.cached_tokens)]
        if then_insert:
            tenant = next(t for t, ns in NS.items() if ns == lease.root.namespace) if lease.root else "a"
            insert(self.store, tenant, tokens + [9])
        self.store.release(lease)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        tenant, tokens, privileged = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.store.snapshot_stats()  # lapses what is due: the unpin below changes nothing else
        theirs = tenant_pins if privileged else (lambda n: n.operator_pins)  # the other caller's pins
        others = [(n, theirs(n)) for n in self.store.trie.iter_nodes()]
        self.store.unpin(scope(tenant), tokens, privileged=privileged)
        assert all(theirs(n) == k for n, k in others), "an unpin undid another caller's pin"

    @rule(seconds=st.sampled_from([0.5, 4.0, 10.0, 100.0, 1000.0, 4000.0]))  # pin_ttl_seconds: 3600
    def clock_jump(self, seconds):
        self.clock.advance(seconds)

    @rule()
    def sweep(self):
        self.store.sweep()

    @rule(tenant=st.one_of(st.none(), TENANTS))
    def flush(self, tenant):
        self.store.flush(tenant)
        if tenant is None:
            self.pins.clear()
        else:
            self.pins = [p for p in self.pins if p[0] != tenant]
        self.operator_pins = {(t, s) for t, s in self.operator_pins if tenant not in (None, t)}

    @invariant()
    def only_the_operator_pins_without_a_deadline(self):
        """A tenant's pin lapses pin_ttl_seconds after it was made or last read (``check_integrity``), whatever TTL
        the block was stored or read with; only the operator's pins have no deadline, and only its own pins count so."""
        for node in self.store.trie.iter_nodes():
            assert node.pins == node.operator_pins or node.pin_until < math.inf, "a tenant's pin without a deadline"
            if node.operator_pins:
                path, up = [], node
                while up.parent is not None:
                    path[:0], up = up.tokens, up.parent
                # A pin of a path ending inside a block pins that whole block.
                assert any(t == node.tenant and len(s) > node.start and list(s[: node.end]) == path[: len(s)]
                           for t, s in self.operator_pins), "an operator pin the operator never made"

    @invariant()
    def integrity(self):
        self.store.check_integrity()
        if not self.leases:
            assert all(n.refcount == 0 for n in self.store.trie.iter_nodes())
            assert all(r.refcount == 0 for r in self.store.trie.roots())
        assert self.store.bytes <= self.store.config.max_bytes
        quota = self.store.config.tenant_quota_bytes
        assert all(b <= quota for b in self.store.tenant_bytes.values())
        for tokens, lease, limit in self.leases:  # an unchanged write count: no longer match exists (admission skips it)
            if lease.version == self.store.writes and lease.root is not None:
                tenant = next(t for t, ns in NS.items() if ns == lease.root.namespace)
                assert self.store.peek(scope(tenant), tokens, limit) <= lease.cached_tokens

    def teardown(self):
        for _, lease, _ in self.leases:
            self.store.release(lease)
        self.store.flush()
        assert self.store.bytes == 0
        self.store.check_integrity()


StoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestStore = StoreMachine.TestCase
