"""Schemathesis against /openapi.json of a live proxy: valid and invalid generated requests, never a 5xx.

Bounded: a fixed number of examples per operation and mode, derandomized, no
example database, so the run is reproducible and takes well under a minute.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, MODEL, auth, leased_refs, live, make_cache, wait_until
from proxy_support import settings as proxy_settings

EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 15}


@pytest.fixture(scope="module")
def fuzzed(tiny_model, tokenizer):
    """A server of its own (the run flushes caches); small max_tokens keeps every generation short."""
    cache = make_cache(tiny_model, tokenizer)
    app = create_app(proxy_settings(max_tokens_limit=16, default_max_tokens=4, request_timeout_seconds=30), cache=cache)
    with live(app) as srv:
        yield srv
    cache.close()


def _operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_lists_every_route(fuzzed):
    labels = {op.label for op in _operations(fuzzed.url)}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "POST /v1/cache/prewarm",
            "DELETE /v1/cache", "GET /v1/cache/stats", "GET /metrics", "GET /healthz", "GET /readyz"} <= labels


@pytest.mark.parametrize("key", [ADMIN, ALPHA])
@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_no_generated_request_gets_a_5xx(fuzzed, key, mode):
    failures, exercised, statuses = [], set(), {}
    for operation in _operations(fuzzed.url):

        @settings(max_examples=EXAMPLES[mode], deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # a random name is a 404 before any generation; fuzz the rest
            response = case.call(headers=auth(key), timeout=60)
            statuses[operation.label, response.status_code] = statuses.get((operation.label, response.status_code), 0) + 1
            if response.status_code == 400 and mode is GenerationMode.POSITIVE: print(operation.label, response.json()["error"]["message"][:150])
            exercised.add(operation.label)
            if response.status_code >= 500:
                failures.append(f"{response.status_code} {case.as_curl_command()}\n  -> {response.text[:300]}")

        try:
            run()
        except Unsatisfiable:  # negative mode: an operation without inputs has no invalid request to send
            assert mode is GenerationMode.NEGATIVE
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /v1/cache/prewarm"} <= exercised
    print(sorted(statuses.items()))
    assert not failures, "\n".join(failures[:10])
    wait_until(lambda: fuzzed.serving.queue() == (0, 0) and leased_refs(fuzzed.cache) == 0, timeout=5)
    fuzzed.cache.check_integrity()
