"""Cache admin across replicas: prewarm, flush and stats sent to every replica, answers aggregated.

A router does not forward ``/v1/cache`` (and would send it to one replica if it did), so
the admin command talks to each replica's own address with the admin key. Every
replica is asked even when one fails; the result names each replica's answer or
error, and ``ok`` is false if any failed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

#: Counters summed over replicas; rates are recomputed from the sums, never averaged.
SUMMED = ("queries", "hits", "partial_hits", "misses", "bypassed", "prompt_tokens", "cached_tokens",
          "completion_tokens", "bytes", "budget_bytes", "entries", "pinned_bytes")


class FanOut:
    """One admin call on each replica, concurrently. ``client`` is injected so tests and callers share pools."""

    def __init__(self, replicas: Sequence[str], admin_key: str, *, timeout: float = 300.0,
                 client: httpx.Client | None = None):
        if not replicas:
            raise ValueError("give at least one replica URL")
        self.replicas = [url.rstrip("/") for url in replicas]
        self._client = client or httpx.Client(timeout=timeout)
        self._headers = {"Authorization": f"Bearer {admin_key}"}

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> FanOut:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, path: str, *, params: dict[str, str] | None = None,
             body: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """Replica URL -> its JSON answer, or ``{"error": ..., "status": ...}``."""
        def one(url: str) -> dict[str, Any]:
            try:
                response = self._client.request(method, url + path, params=params, json=body, headers=self._headers)
            except httpx.HTTPError as exc:
                return {"error": f"{type(exc).__name__}: {exc}", "status": None}
            try:
                data = response.json()
            except ValueError:
                data = {"error": {"message": response.text[:200]}}
            if response.status_code != 200:
                error = data.get("error", data) if isinstance(data, dict) else data
                message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
                return {"error": message, "status": response.status_code}
            return data

        with ThreadPoolExecutor(min(len(self.replicas), 16), thread_name_prefix="prefixcache-admin") as pool:
            return dict(zip(self.replicas, pool.map(one, self.replicas), strict=True))

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        return _report(_scoped(self.call("GET", "/v1/cache/stats", params=_tenant(tenant)), tenant), aggregate_stats)

    def flush(self, tenant: str | None = None) -> dict[str, Any]:
        return _report(_scoped(self.call("DELETE", "/v1/cache", params=_tenant(tenant)), tenant),
                       lambda answers: {"freed_bytes": sum(a["freed_bytes"] for a in answers)})

    def prewarm(self, body: dict[str, Any], tenant: str | None = None) -> dict[str, Any]:
        """The same prefix on every replica (each prefills it: without a shared tier, each holds its own copy)."""
        return _report(self.call("POST", "/v1/cache/prewarm", params=_tenant(tenant), body=body),
                       lambda answers: {"stored_tokens": sum(a["stored_tokens"] for a in answers),
                                        "prompt_tokens": max(a["prompt_tokens"] for a in answers)})


def aggregate_stats(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Sum the counters of several replicas' ``/v1/cache/stats`` and recompute the rates."""
    total: dict[str, Any] = {name: sum(a.get(name) or 0 for a in answers) for name in SUMMED}
    total["hit_rate"] = (total["hits"] + total["partial_hits"]) / total["queries"] if total["queries"] else 0.0
    prompt = total["prompt_tokens"]
    total["token_hit_rate"] = total["cached_tokens"] / prompt if prompt else 0.0
    return total


def _report(answers: dict[str, dict[str, Any]], combine: Callable[[list[dict[str, Any]]], dict[str, Any]]
            ) -> dict[str, Any]:
    good = [a for a in answers.values() if "error" not in a]
    return {"ok": len(good) == len(answers), "total": combine(good) if good else None, "replicas": answers}


def _scoped(answers: dict[str, dict[str, Any]], tenant: str | None) -> dict[str, dict[str, Any]]:
    """Each answer, or an error where the replica acted on another tenant than asked (None: all): a tenant's key
    is scoped to its own tenant without an error, so a wrong key would otherwise pass for the admin key."""
    def check(answer: dict[str, Any]) -> dict[str, Any]:
        if "error" in answer or answer.get("tenant") == tenant:
            return answer
        asked = "every tenant" if tenant is None else f"tenant {tenant!r}"
        return {"error": f"the replica answered for tenant {answer.get('tenant')!r}, not {asked}: this key is not "
                         "the admin key", "status": 200}
    return {url: check(answer) for url, answer in answers.items()}


def _tenant(tenant: str | None) -> dict[str, str] | None:
    return {"tenant": tenant} if tenant is not None else None
