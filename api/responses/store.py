"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``), in memory.

A stored response keeps its answer (the response object, as ``GET`` returns it) and its own
turn: the chat messages of its ``input`` (without its ``instructions``, which OpenAI does not
carry over) and of its output, as its output items make when sent back as input
(``translate.output_messages``), linked to the response it continued. Its conversation is
the turns of its chain, walked back to the first (``conversation``); a turn naming it as
``previous_response_id`` is that conversation plus its own input, so its prompt extends the
stored turn's prompt and reads it from the prefix cache. Each turn is held and counted once,
however many responses continue it, so a chain's bytes grow with its length, not its square.
A chain is no deeper than the messages one request may hold (each turn adds an input and an
output message, and a turn is stored only once its whole conversation passed
``max_messages``), so walking it costs less than the prompt it makes.

A response continued by others is pinned by them (a count of the kept turns that continue it
directly, walked up the chain as they come and go): dropped (expired, pushed out, deleted),
it can no longer be read or continued, but every response after it keeps its whole
conversation, and its turn's bytes count until the last response holding it goes.

Per tenant and bounded: ``PER_TENANT`` responses each (its oldest dropped first), ``TENANTS``
tenants (the least recently storing one's dropped first) and ``MAX_BYTES`` of stored JSON in
all (each kept or pinned turn with its response), over which the tenant holding the most bytes
(besides the response being stored and the turns it continues, which are kept; on a tie the
storing tenant) loses its oldest first, so one tenant's traffic never pushes out another's that
holds less; a response whose whole conversation is larger than ``MAX_BYTES`` is not kept. A
response expires ``RETAIN_SECONDS`` after it was stored, on the injected clock. Another tenant's
id is not found, as an unknown or expired one. Only the event loop touches it.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Most responses kept per tenant, tenants kept, how long a response stays, in seconds, and bytes in all.
PER_TENANT = 1024
TENANTS = 4096
RETAIN_SECONDS = 3600.0
MAX_BYTES = 256 << 20


@dataclass(eq=False, slots=True)
class StoredResponse:
    """One stored turn. Read-only outside the store, which alone sets ``pins``, ``kept`` and ``counted``."""

    response: dict[str, Any]  # the response object as answered
    turn: list[dict[str, Any]]  # chat messages: this request's own input, then its output
    previous: StoredResponse | None = field(repr=False)  # the response it continued
    nbytes: int  # the JSON of the response and its turn
    expires: float
    pins: int = 0  # counted turns that continue this one directly
    kept: bool = True  # readable and continuable (not yet expired, pushed out or deleted)
    counted: bool = True  # its bytes count: kept, or pinned

    def conversation(self) -> list[dict[str, Any]]:
        """The chat messages of its chain, earliest turn first, ending with its own output."""
        turns = []
        record: StoredResponse | None = self
        while record is not None:
            turns.append(record.turn)
            record = record.previous
        return [message for turn in reversed(turns) for message in turn]


class ResponseStore:
    def __init__(self, clock: Callable[[], float], per_tenant: int = PER_TENANT, tenants: int = TENANTS,
                 retain_seconds: float = RETAIN_SECONDS, max_bytes: int = MAX_BYTES):
        self._clock, self.per_tenant, self.tenants, self.retain_seconds = clock, per_tenant, tenants, retain_seconds
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, OrderedDict[str, StoredResponse]] = OrderedDict()  # kept, oldest first
        self._held: dict[str, int] = {}  # each tenant's counted bytes
        self._bytes = 0

    def put(self, tenant: str, response: dict[str, Any], turn: list[dict[str, Any]],
            previous: StoredResponse | None = None) -> None:
        """Keep ``response`` (its ``id``) and its ``turn`` for ``tenant``, continuing ``previous`` (the tenant's
        response it named, as ``get`` found it: still held if it has been dropped since). One whose whole
        conversation is larger than the whole budget is not kept."""
        nbytes = len(json.dumps([response, turn], ensure_ascii=False, default=str).encode())
        chain = [previous] if previous is not None else []
        while chain and chain[-1].previous is not None:
            chain.append(chain[-1].previous)
        whole = nbytes + sum(r.nbytes for r in chain)
        if whole > self.max_bytes:
            return
        now = self._clock()
        ids = self._records.pop(tenant, None) or OrderedDict()
        self._records[tenant] = ids  # most recently storing last
        self._drop(tenant, response["id"])
        record = StoredResponse(response, turn, previous, nbytes, now + self.retain_seconds)
        ids[response["id"]] = record
        self._count(tenant, nbytes)
        self._pin(tenant, previous)
        while ids and (len(ids) > self.per_tenant or next(iter(ids.values())).expires <= now):
            self._drop(tenant, next(iter(ids)))  # responses expire in the order they were stored
        while len(self._records) > self.tenants:
            gone = next(iter(self._records))  # the least recently storing tenant's
            for response_id in list(self._records[gone]):
                self._drop(gone, response_id)
            del self._records[gone]
        protected = {record, *chain}  # dropping them would free nothing the new response does not hold
        while self._bytes > self.max_bytes:  # the oldest of the tenant holding the most besides this conversation
            largest = max(self._held, key=lambda t: (self._held[t] - (whole if t == tenant else 0), t == tenant))
            self._drop(largest, next(i for i, r in self._records[largest].items() if r not in protected))

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """``tenant``'s response ``response_id``; None if never stored, expired, dropped or another tenant's."""
        ids = self._records.get(tenant)
        found = None if ids is None else ids.get(response_id)
        if found is None:
            return None
        if found.expires <= self._clock():
            self._drop(tenant, response_id)
            return None
        return found

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget ``tenant``'s response; False if there was none to forget. The responses that continued it keep
        its turn in their conversation."""
        if self.get(tenant, response_id) is None:
            return False
        self._drop(tenant, response_id)
        return True

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._records.values())

    @property
    def nbytes(self) -> int:
        """Bytes counted: every kept response with its turn, and the turns the kept ones continue."""
        return self._bytes

    def check_integrity(self) -> None:
        """Assert the counts: the counted turns are exactly those of the kept responses' chains, each pinned by
        the counted turns continuing it, their bytes the store's and each tenant's."""
        held: dict[str, int] = {}
        for tenant, ids in self._records.items():
            seen: dict[int, StoredResponse] = {}
            for record in ids.values():
                assert record.kept and record.counted
                while record is not None and id(record) not in seen:
                    seen[id(record)] = record
                    record = record.previous
            for record in seen.values():
                assert record.counted and record.pins == sum(r.previous is record for r in seen.values())
            if seen:
                held[tenant] = sum(r.nbytes for r in seen.values())
        assert held == self._held and sum(held.values()) == self._bytes, (held, self._held, self._bytes)

    def _count(self, tenant: str, nbytes: int) -> None:
        self._bytes += nbytes
        self._held[tenant] = self._held.get(tenant, 0) + nbytes
        if not self._held[tenant]:
            del self._held[tenant]

    def _pin(self, tenant: str, record: StoredResponse | None) -> None:
        """A counted turn continues ``record``: pin it, counting again the turns of a chain released meanwhile."""
        while record is not None:
            record.pins += 1
            if record.counted:
                return
            record.counted = True
            self._count(tenant, record.nbytes)
            record = record.previous

    def _drop(self, tenant: str, response_id: str) -> None:
        record = self._records[tenant].pop(response_id, None)
        if record is None:
            return
        record.kept = False
        while not record.kept and not record.pins and record.counted:  # held no more: up the chain it pinned
            record.counted = False
            self._count(tenant, -record.nbytes)
            if record.previous is None:
                return
            record = record.previous
            record.pins -= 1
