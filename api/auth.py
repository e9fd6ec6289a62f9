"""Tenancy: a bearer API key names the tenant, and so the cache namespace.

Nothing in a request body or query can pick another tenant's namespace: the tenant
is only ever the one the key maps to (admin may name a tenant for admin routes).
Keys are compared in constant time (SHA-256 digests, every key checked) so response
timing reveals neither a key's prefix nor which key matched.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from .errors import AuthenticationError, PermissionDeniedError
from .settings import LOCAL_TENANT, Settings


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the tenant whose namespace they use, whether they hold the admin key (or have admin
    rights in local mode), and whether the server runs in local mode (no keys: one tenant)."""

    tenant: str
    admin: bool
    local: bool = False

    @property
    def exempt(self) -> bool:
        """Not held to a key's rate, budget or places: the admin, and local mode's one tenant (nobody to share with)."""
        return self.admin or self.local

    def scope(self, requested: str | None) -> str | None:
        """The tenant an admin route acts on: one's own; admin may name one, or (None) all."""
        if self.admin:
            return requested
        if requested is not None and requested != self.tenant:
            hint = "; in local mode (no API keys): restart with --local-admin (PREFIXCACHE_LOCAL_ADMIN=true) to give local callers admin rights" if self.local else ""
            raise PermissionDeniedError(f"only the admin key may act on another tenant{hint}", param="tenant")
        return self.tenant

    def target(self, requested: str | None) -> str:
        """The tenant a prewarm fills: one's own, or (admin only) a named one."""
        scoped = self.scope(requested)
        return self.tenant if scoped is None else scoped


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    def __init__(self, settings: Settings):
        self.local_mode = settings.local_mode
        self.local_admin = settings.local_admin
        self._tenants = [(_digest(k), t) for k, t in settings.api_keys.items()]
        self._admin = None if settings.admin_key is None else _digest(settings.admin_key.get_secret_value())
        self._admin_tenant = settings.admin_tenant

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> Principal:
        """Resolve an ``Authorization: Bearer`` header, or else an ``x-api-key`` header (Anthropic's).

        Raises ``AuthenticationError`` (401).
        """
        if self.local_mode:
            return Principal(LOCAL_TENANT, admin=self.local_admin, local=True)
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if not authorization and api_key:
            scheme, token = "bearer", api_key.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("You didn't provide an API key. Send it as 'Authorization: Bearer KEY' "
                                      "(or 'x-api-key: KEY').")
        given = _digest(token)
        tenant = None
        for digest, name in self._tenants:  # no early exit: timing must not depend on which key matched
            if hmac.compare_digest(digest, given):
                tenant = name
        if self._admin is not None and hmac.compare_digest(self._admin, given):
            return Principal(self._admin_tenant, admin=True)
        if tenant is None:
            raise AuthenticationError("Incorrect API key provided.")
        return Principal(tenant, admin=False)

    def require_admin(self, principal: Principal) -> None:
        if not principal.admin:
            hint = "; in local mode (no API keys): restart with --local-admin (PREFIXCACHE_LOCAL_ADMIN=true) to give local callers admin rights" if principal.local else ""
            raise PermissionDeniedError(f"this route needs the admin key{hint}")
