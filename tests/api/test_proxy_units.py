"""Units of the proxy without a server: CLI, settings, key ring, sampling."""
from __future__ import annotations

import hmac
import socket

import pytest
import torch
from prefixcache_api import Settings
from prefixcache_api.auth import KeyRing, Principal
from prefixcache_api.errors import AuthenticationError, PermissionDeniedError
from prefixcache_api.jobs import Job
from proxy_support import make_cache
from pydantic import ValidationError

from prefixcache.cli import build_parser, main
from prefixcache.errors import ContextLengthExceededError
from prefixcache.serving.request import SamplingParams
from prefixcache.serving.sampling import OpenAIPenalties

# -- CLI -----------------------------------------------------------------------------


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "serve" in capsys.readouterr().err


def test_serve_help_lists_every_setting_with_its_env_var(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in Settings.model_fields:
        flag = "--api-key" if name == "api_keys" else "--" + name.replace("_", "-")
        assert flag in out and f"PREFIXCACHE_{name.upper()}" in out


def test_serve_help_shows_each_default_and_a_short_usage(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: prefixcache serve [-h] [--FLAG VALUE ...] ")
    for shown in ("Bind port. (default: 8000) [PREFIXCACHE_PORT]", "(default: 2147483648 = 2 GiB) [PREFIXCACHE_MAX_BYTES]",
                  "(default: false) [PREFIXCACHE_LOCAL_ADMIN]", "(default: 300.0) [PREFIXCACHE_TTL_SECONDS]"):
        assert shown in out
    assert "(default: None)" not in out and "Undefined" not in out  # unset ones say what unset means
    with pytest.raises(SystemExit):
        main(["serve", "--model"])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 2 and "--model: expected one argument" in err  # not under 70 lines of usage


def test_serve_flags_parse_to_settings_overrides():
    args = build_parser().parse_args(["serve", "--model", "org/model", "--port", "9001", "--api-key", "k1=t1",
                                      "--api-key", "k2=t2", "--ttl-seconds", "none", "--metrics-public",
                                      "--max-bytes", "1048576"])
    assert (args.model, args.port, args.api_keys, args.ttl_seconds, args.metrics_public, args.max_bytes) == (
        "org/model", 9001, [("k1", "t1"), ("k2", "t2")], None, True, 1 << 20)
    assert not hasattr(build_parser().parse_args(["serve"]), "port")  # unset flags leave env vars in charge
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--api-key", "no-tenant"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_runs_uvicorn_with_flags_over_env(monkeypatch, tiny_model, tokenizer):
    import prefixcache_api
    import uvicorn

    seen = {}
    cache = make_cache(tiny_model, tokenizer)
    def build_cache(settings):
        seen["settings"] = settings
        return cache

    monkeypatch.setattr(prefixcache_api, "build_cache", build_cache)
    monkeypatch.setattr(uvicorn, "run", lambda app, host, port, log_level, **options: seen.update(
        app=app, host=host, port=port, options=options))
    monkeypatch.setenv("PREFIXCACHE_PORT", "9100")
    monkeypatch.setenv("PREFIXCACHE_ADMIN_KEY", "from-env")
    port = free_port()
    assert main(["serve", "--port", str(port), "--api-key", "sk-x=team-x", "--log-level", "warning",
                 "--limit-concurrency", "300", "--header-timeout-seconds", "3"]) == 0
    settings = seen["settings"]
    assert (seen["host"], seen["port"]) == ("127.0.0.1", port)  # the flag beats the env var
    assert settings.admin_key.get_secret_value() == "from-env" and settings.api_keys == {"sk-x": "team-x"}
    assert seen["app"].state.settings is settings
    # The server's own limits reach uvicorn: connections, keep-alive, and the protocol with the header deadline.
    options = seen["options"]
    assert options["limit_concurrency"] == 300 and options["timeout_keep_alive"] == 5.0
    assert options["http"].header_timeout == 3.0
    # A shutdown waits as long as a request may take, then closes what a stalled client holds open.
    assert options["timeout_graceful_shutdown"] == settings.body_timeout_seconds + settings.request_timeout_seconds + 5


def test_serve_reports_a_missing_model_and_bad_settings_without_a_traceback(capsys, monkeypatch):
    assert main(["serve", "--model", "/nonexistent/model/folder", "--port", str(free_port())]) == 1
    assert "does not exist" in capsys.readouterr().err
    import prefixcache_api

    monkeypatch.setattr(prefixcache_api, "build_cache", lambda settings: pytest.fail("the model loaded"))
    with socket.socket() as taken:  # a port in use is said before the model loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 3
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1:" in err and "another server holds it" in err and "--port" in err
    assert main(["serve", "--host", "192.0.2.1", "--api-key", "sk-" + "a" * 16 + "=a"]) == 3  # not this machine's
    assert "no interface of this machine has that address (--host" in capsys.readouterr().err
    assert main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "port (--port, PREFIXCACHE_PORT): Input should be less than or equal to 65535" in err
    assert "errors.pydantic.dev" not in err and "[type=" not in err
    monkeypatch.setenv("PREFIXCACHE_API_KEYS", "sk-a")  # not JSON: was a traceback
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "api_keys (--api-key, PREFIXCACHE_API_KEYS): not valid JSON" in err and "Traceback" not in err


# -- settings and keys ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"api_keys": {"sk-a": "a"}, "admin_key": "sk-a"},  # a tenant key equal to the admin key
    {"api_keys": {"sk-a": "admin"}},  # a tenant named like the admin tenant would share its namespace
    {"api_keys": {"": "a"}},
    {"admin_key": ""},
    {"workers": 0},
    {"default_temperature": 3},
])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValidationError):
        Settings(**kwargs)


def test_env_json_api_keys_and_local_mode(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_API_KEYS", '{"sk-1": "one"}')
    assert Settings().api_keys == {"sk-1": "one"} and not Settings().local_mode
    monkeypatch.setenv("PREFIXCACHE_API_KEYS", "")  # empty = unset
    assert Settings().local_mode
    assert "sk-1" not in repr(Settings(api_keys={"sk-1": "one"}, admin_key="secret"))  # keys never logged
    assert "s3cr3t-value" not in repr(Settings(admin_key="s3cr3t-value"))


def test_key_ring_compares_every_key_in_constant_time(monkeypatch):
    ring = KeyRing(Settings(api_keys={f"sk-{i}": f"t{i}" for i in range(5)}, admin_key="sk-admin"))
    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert ring.authenticate("Bearer sk-0") == Principal("t0", admin=False)
    first = len(calls)
    calls.clear()
    assert ring.authenticate("bearer  sk-4 ") == Principal("t4", admin=False)
    assert len(calls) == first == 6  # all five keys and the admin key, whichever matched
    assert ring.authenticate("Bearer sk-admin") == Principal("admin", admin=True)
    for header in (None, "", "Bearer ", "Basic sk-0", "Bearer sk-5", "Bearer sk-0x"):
        with pytest.raises(AuthenticationError):
            ring.authenticate(header)


def test_principal_scopes():
    tenant, admin = Principal("a", admin=False), Principal("admin", admin=True)
    assert tenant.scope(None) == "a" and tenant.scope("a") == "a" and tenant.target(None) == "a"
    with pytest.raises(PermissionDeniedError):
        tenant.scope("b")
    assert admin.scope(None) is None and admin.scope("b") == "b"
    assert admin.target(None) == "admin" and admin.target("b") == "b"


def test_local_mode_principal_is_the_default_tenant_with_admin_rights_only_when_asked():
    assert KeyRing(Settings()).authenticate(None) == Principal("default", admin=False, local=True)
    assert KeyRing(Settings(local_admin=True)).authenticate(None) == Principal("default", admin=True, local=True)
    local = KeyRing(Settings()).authenticate(None)  # its refusals say how to open the admin routes
    with pytest.raises(PermissionDeniedError, match="--local-admin"):
        KeyRing(Settings()).require_admin(local)
    with pytest.raises(PermissionDeniedError, match="--local-admin"):
        local.scope("other")
    with pytest.raises(PermissionDeniedError) as keyed:
        Principal("a", admin=False).scope("b")
    assert "--local-admin" not in str(keyed.value)


# -- sampling -------------------------------------------------------------------------


def test_default_max_tokens_is_capped_to_the_context_and_overlong_requests_refused():
    job = Job("chat", "t")
    assert job.max_new_tokens(100, 2048, 256) == 256
    assert job.max_new_tokens(2000, 2048, 256) == 48
    with pytest.raises(ContextLengthExceededError):
        job.max_new_tokens(2048, 2048, 256)
    asked = Job("completions", "t", max_tokens=100)
    assert asked.max_new_tokens(1948, 2048, 8) == 100
    with pytest.raises(ContextLengthExceededError) as err:
        asked.max_new_tokens(1949, 2048, 8)
    assert err.value.param == "prompt"


def test_openai_penalties_count_generated_tokens_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, logit_bias=((3, 10.0),))
    proc = OpenAIPenalties(params, prompt_len=3)
    scores = torch.zeros(1, 5)
    prompt = torch.tensor([[1, 1, 2]])
    first = proc(prompt, scores)  # prefill step: nothing generated yet, only the bias
    assert first.tolist() == [[0, 0, 0, 10, 0]]
    out = proc(torch.tensor([[1, 1, 2, 4, 4]]), scores)  # two generated 4s
    assert out.tolist() == [[0, 0, 0, 10, -2.5]]
    assert scores.tolist() == [[0] * 5]  # the input is not modified


# -- fail closed ---------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org", ""])
def test_open_server_on_a_reachable_host_is_refused(host):
    with pytest.raises(ValidationError, match="without API keys"):
        Settings(host=host)
    assert Settings(host=host, allow_insecure_no_auth=True).local_mode  # said explicitly: allowed
    assert not Settings(host=host, admin_key="sk-admin-" + "a" * 32).local_mode
    assert not Settings(host=host, api_keys={"sk-a-" + "a" * 16: "a"}).local_mode


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_open_server_on_loopback_is_local_mode(host):
    assert Settings(host=host).local_mode


def test_serve_refuses_an_open_public_bind_before_loading_a_model(monkeypatch, capsys):
    import prefixcache_api

    monkeypatch.setattr(prefixcache_api, "build_cache", lambda settings: pytest.fail("loaded a model"))
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "without API keys" in err and "--allow-insecure-no-auth" in err
