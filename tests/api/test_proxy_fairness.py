"""Fairness between tenant keys over HTTP: a key over its request rate or its places in flight gets 429
with Retry-After before its body is read; other keys and the admin key go on being served."""
from __future__ import annotations

import time

import pytest
from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, BETA, MODEL, held_stream, live, make_cache, settings, wait_until
from test_proxy_errors import assert_error

CHAT = "/v1/chat/completions"
HUGE = b'{"model": "m", "prompt": "' + b"x" * (6 << 20) + b'"}'  # over max_body_bytes: 413 if it were read


def ok_chat(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def cache(tiny_model, tokenizer):
    cache = make_cache(tiny_model, tokenizer)
    yield cache
    cache.close()


def test_a_key_over_its_rate_gets_429_with_retry_after_before_its_body_is_read(cache, clock):
    app = create_app(settings(tenant_rate_limit=0.5, tenant_rate_burst=2), cache=cache, clock=clock)
    with live(app) as srv, srv.client(ALPHA) as alpha, srv.client(BETA) as beta, srv.client(ADMIN) as admin:
        assert alpha.post(CHAT, json=ok_chat()).status_code == 200
        assert alpha.get("/v1/models").status_code == 200  # every request of the key counts
        r = alpha.post(CHAT, content=HUGE, headers={"content-type": "application/json"})
        err = assert_error(r, 429, code="rate_limit_exceeded", kind="rate_limit_error")
        assert r.headers["retry-after"] == "2" and "0.5 requests a second" in err["message"]
        clock.advance(1.0)  # half a token: still refused, one second to go
        assert alpha.post(CHAT, json=ok_chat()).headers["retry-after"] == "1"
        assert beta.post(CHAT, json=ok_chat()).status_code == 200  # another key's bucket is its own
        assert all(admin.get("/v1/models").status_code == 200 for _ in range(5))  # the admin key is exempt
        r = alpha.post("/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"  # Anthropic's shape
        clock.advance(1.0)
        assert alpha.post(CHAT, json=ok_chat()).status_code == 200


def test_a_key_that_keeps_sending_bad_input_is_held_then_refused_before_its_body_is_read(cache, clock):
    app = create_app(settings(tenant_invalid_rate=0.5, tenant_invalid_burst=3, tenant_invalid_hold_seconds=0.2),
                     cache=cache, clock=clock)
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}
    with live(app) as srv, srv.client(ALPHA) as alpha, srv.client(BETA) as beta, srv.client(ADMIN) as admin:
        assert alpha.post(CHAT, json=ok_chat()).status_code == 200  # what is served costs nothing
        assert alpha.post(CHAT, json=bad).status_code == 400
        assert alpha.post(CHAT, json={**ok_chat(), "model": "another"}).status_code == 404
        assert alpha.post(CHAT, content=HUGE, headers={"content-type": "application/json"}).status_code == 413
        started = time.monotonic()
        r = alpha.post(CHAT, json=ok_chat())  # even a good request: the key's budget is spent
        assert time.monotonic() - started >= 0.2  # held before the answer
        err = assert_error(r, 429, code="too_many_invalid_requests", kind="rate_limit_error")
        assert r.headers["retry-after"] == "2" and "too many invalid requests" in err["message"]
        r = alpha.post(CHAT, content=HUGE, headers={"content-type": "application/json"})
        assert_error(r, 429, code="too_many_invalid_requests")  # not 413: refused before the body is read
        r = alpha.post("/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                             "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"  # Anthropic's shape
        assert beta.post(CHAT, json=ok_chat()).status_code == 200  # another key's budget is its own
        assert all(admin.post(CHAT, json=bad).status_code == 400 for _ in range(5))  # the admin key is exempt
        assert admin.post(CHAT, json=ok_chat()).status_code == 200
        clock.advance(2.0)  # a token back: the key is served again
        assert alpha.post(CHAT, json=ok_chat()).status_code == 200


def test_a_held_request_goes_on_when_its_keys_budget_refills_and_a_served_one_gives_its_token_back(cache):
    app = create_app(settings(tenant_invalid_rate=4.0, tenant_invalid_burst=2, tenant_invalid_hold_seconds=2.0),
                     cache=cache)  # the real clock: a token every 0.25 s
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}
    with live(app) as srv, srv.client(ALPHA) as alpha:
        assert [alpha.post(CHAT, json=bad).status_code for _ in range(2)] == [400, 400]
        started = time.monotonic()
        assert alpha.post(CHAT, json=ok_chat()).status_code == 200  # held for the next token, then served
        assert 0.1 <= time.monotonic() - started
        budget = srv.app.state.invalid_budget
        assert budget.bucket.wait("alpha") == 0.0  # the served request gave its token back


def test_a_key_with_all_its_places_taken_gets_429_and_another_key_is_served(cache, tokenizer):
    app = create_app(settings(workers=2, tenant_max_in_flight=1), cache=cache)
    long_job = ok_chat(max_tokens=1500, logit_bias={str(tokenizer.eos_token_id): -100}, stream=True)
    with live(app) as srv:
        with held_stream(srv, ALPHA, CHAT, long_job):
            with srv.client(ALPHA) as alpha, srv.client(BETA) as beta, srv.client(ADMIN) as admin:
                r = alpha.post(CHAT, content=HUGE, headers={"content-type": "application/json"})
                err = assert_error(r, 429, code="tenant_busy", kind="rate_limit_error")  # not 413: body unread
                assert int(r.headers["retry-after"]) >= 1 and "1 requests in flight" in err["message"]
                assert_error(alpha.post(CHAT, json=ok_chat()), 429, code="tenant_busy")
                assert alpha.get("/v1/models").status_code == 200  # what takes no place is not refused
                assert beta.post(CHAT, json=ok_chat()).status_code == 200
                assert admin.post(CHAT, json=ok_chat()).status_code == 200
                assert srv.serving.admission.in_flight("alpha") == 1
        wait_until(lambda: srv.serving.queue() == (0, 0), timeout=30)
        with srv.client(ALPHA) as alpha:
            assert alpha.post(CHAT, json=ok_chat()).status_code == 200  # its place is back
