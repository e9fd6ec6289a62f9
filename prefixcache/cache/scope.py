"""Where a request's blocks live and for how long: one value passed instead of loose arguments."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Scope:
    """A request's cache scope.

    ``namespace``: the trie it reads and writes (tenant, model identity, template fingerprint
    and, when given, the caller's salt: calls with different namespaces never share a block).
    ``tenant``: whose quotas, pins and counters it uses. ``ttl_seconds``: how long its blocks
    stay after their last use (None: no expiry). ``salt``: the caller's ``cache_salt``, already
    part of ``namespace``; kept for reports.
    """

    namespace: tuple[str, ...]
    tenant: str
    ttl_seconds: float | None = None
    salt: str | None = None

    def with_ttl(self, ttl_seconds: float | None) -> Scope:
        return dataclasses.replace(self, ttl_seconds=ttl_seconds)

    def within(self, part: str) -> Scope:
        """The same scope one namespace level down (e.g. a tenant's stored chunks beside its prefixes)."""
        return dataclasses.replace(self, namespace=(*self.namespace, part))
