"""The Responses API's stored responses under random interleavings of put (continuing any response a request
found, dropped since or not), get, delete and time: the counts ``check_integrity`` asserts, the byte budget,
each tenant's own ids, and every kept response's whole conversation."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from prefixcache_api.responses.store import ResponseStore

from tests.conftest import FakeClock

TENANTS = st.sampled_from(["a", "b", "c"])
MAX_BYTES = 2400


class ResponseStoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.store = ResponseStore(self.clock, per_tenant=3, tenants=2, retain_seconds=60, max_bytes=MAX_BYTES)
        self.conversations: dict[tuple[str, str], list] = {}  # (tenant, id): the conversation it was stored with
        self.found: dict[str, list] = {"a": [], "b": [], "c": []}  # what each tenant's requests found (get)
        self.gone: set[tuple[str, str]] = set()  # found once, then not: never found again
        self.next = 0

    @rule(tenant=TENANTS, size=st.integers(0, 900), pick=st.integers(0, 20), fresh=st.booleans())
    def put(self, tenant, size, pick, fresh):
        found = self.found[tenant]
        previous = None if fresh or not found else found[pick % len(found)]
        response_id = f"resp_{self.next}"
        self.next += 1
        turn = [{"role": "user", "content": "x" * size}, {"role": "assistant", "content": response_id}]
        earlier = [] if previous is None else previous.conversation()
        self.store.put(tenant, {"id": response_id, "output": []}, turn, previous=previous)
        record = self.store.get(tenant, response_id)
        self.conversations[(tenant, response_id)] = earlier + turn
        if record is None:  # only a conversation larger than the whole budget is not kept
            chain, at = 0, previous
            while at is not None:
                chain, at = chain + at.nbytes, at.previous
            assert chain + len(json.dumps([{"id": response_id, "output": []}, turn]).encode()) > MAX_BYTES
            return
        assert record.conversation() == earlier + turn
        found.append(record)

    @rule(tenant=TENANTS, other=TENANTS, pick=st.integers(0, 50))
    def get(self, tenant, other, pick):
        ids = sorted(self.conversations)
        if not ids:
            return
        owner, response_id = ids[pick % len(ids)]
        record = self.store.get(tenant, response_id)
        if tenant != owner:
            assert record is None  # another tenant's id is not found
            return
        if record is None:
            self.gone.add((owner, response_id))
            return
        assert (owner, response_id) not in self.gone, "a dropped response came back"
        assert record.conversation() == self.conversations[(owner, response_id)]
        self.found[tenant].append(record)

    @rule(tenant=TENANTS, pick=st.integers(0, 50))
    def delete(self, tenant, pick):
        ids = sorted(self.conversations)
        if not ids:
            return
        owner, response_id = ids[pick % len(ids)]
        if tenant == owner and self.store.delete(tenant, response_id):
            assert self.store.get(tenant, response_id) is None
            self.gone.add((owner, response_id))
        else:
            assert self.store.get(tenant, response_id) is None

    @rule(seconds=st.sampled_from([1.0, 30.0, 61.0]))
    def advance(self, seconds):
        self.clock.advance(seconds)

    @invariant()
    def counts_hold(self):
        self.store.check_integrity()
        assert self.store.nbytes <= MAX_BYTES


TestResponseStore = ResponseStoreMachine.TestCase
TestResponseStore.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
