"""Stored responses (``store``, ``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``), in memory.

A stored response keeps its answer (the response object, as ``GET`` returns it) and its
conversation: the chat messages of its input (after any earlier turns it continued, without
its ``instructions``, which OpenAI does not carry over) and its output, as the messages its
output items make when sent back as input (``translate.output_messages``). A turn naming it as
``previous_response_id`` is that conversation plus its own input, so its prompt extends the
stored turn's prompt and reads it from the prefix cache.

Per tenant and bounded: ``PER_TENANT`` responses each (its oldest dropped first), ``TENANTS``
tenants (the least recently storing one's dropped first) and ``MAX_BYTES`` of stored JSON in
all, over which the tenant holding the most bytes (besides the response being stored, which
is kept; on a tie the storing tenant) loses its oldest first, so one tenant's traffic never pushes out another's that holds
less; a response expires ``RETAIN_SECONDS`` after it was stored, on the injected clock. Another
tenant's id is not found, as an unknown or expired one. Only the event loop touches it.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Most responses kept per tenant, tenants kept, how long a response stays, in seconds, and bytes in all.
PER_TENANT = 1024
TENANTS = 4096
RETAIN_SECONDS = 3600.0
MAX_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as answered
    conversation: list[dict[str, Any]]  # chat messages: the input (earlier turns first) and the output
    nbytes: int


class ResponseStore:
    def __init__(self, clock: Callable[[], float], per_tenant: int = PER_TENANT, tenants: int = TENANTS,
                 retain_seconds: float = RETAIN_SECONDS, max_bytes: int = MAX_BYTES):
        self._clock, self.per_tenant, self.tenants, self.retain_seconds = clock, per_tenant, tenants, retain_seconds
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, OrderedDict[str, tuple[float, StoredResponse]]] = OrderedDict()
        self._held: dict[str, int] = {}  # each tenant's bytes
        self._bytes = 0

    def put(self, tenant: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``response`` (its ``id``) and its conversation for ``tenant``; one larger than the whole budget
        is not kept."""
        nbytes = len(json.dumps([response, conversation], ensure_ascii=False, default=str).encode())
        if nbytes > self.max_bytes:
            return
        now = self._clock()
        ids = self._records.pop(tenant, None) or OrderedDict()
        self._records[tenant] = ids  # most recently storing last
        self._drop(tenant, response["id"])
        ids[response["id"]] = (now + self.retain_seconds, StoredResponse(response, conversation, nbytes))
        self._held[tenant] = self._held.get(tenant, 0) + nbytes
        self._bytes += nbytes
        while ids and (len(ids) > self.per_tenant or next(iter(ids.values()))[0] <= now):
            self._drop(tenant, next(iter(ids)))  # responses expire in the order they were stored
        while len(self._records) > self.tenants:
            gone = next(iter(self._records))  # the least recently storing tenant's
            for response_id in list(self._records[gone]):
                self._drop(gone, response_id)
            del self._records[gone]
        while self._bytes > self.max_bytes:  # the oldest of the tenant holding the most besides this response
            largest = max(self._held, key=lambda t: (self._held[t] - (nbytes if t == tenant else 0), t == tenant))
            self._drop(largest, next(iter(self._records[largest])))

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """``tenant``'s response ``response_id``; None if never stored, expired, dropped or another tenant's."""
        ids = self._records.get(tenant)
        found = None if ids is None else ids.get(response_id)
        if found is None:
            return None
        if found[0] <= self._clock():
            self._drop(tenant, response_id)
            return None
        return found[1]

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forget ``tenant``'s response; False if there was none to forget."""
        if self.get(tenant, response_id) is None:
            return False
        self._drop(tenant, response_id)
        return True

    def __len__(self) -> int:
        return sum(len(ids) for ids in self._records.values())

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _drop(self, tenant: str, response_id: str) -> None:
        found = self._records[tenant].pop(response_id, None)
        if found is not None:
            self._bytes -= found[1].nbytes
            self._held[tenant] -= found[1].nbytes
            if not self._held[tenant]:
                del self._held[tenant]
