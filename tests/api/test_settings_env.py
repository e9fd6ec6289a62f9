"""Optional settings can be unset from the environment, as from the command line (compose and Kubernetes
pass settings as environment variables only)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from prefixcache_api.settings import Settings


def optional_fields() -> list[str]:
    import typing

    return [name for name, field in Settings.model_fields.items() if type(None) in typing.get_args(field.annotation)]


@pytest.mark.parametrize("word", ["none", "null", "NULL", " None "])
def test_every_optional_setting_is_unset_by_none_or_null_in_the_environment(word, monkeypatch):
    for name in optional_fields():
        monkeypatch.setenv(f"PREFIXCACHE_{name.upper()}", word)
    settings = Settings()
    assert {name: getattr(settings, name) for name in optional_fields()} == dict.fromkeys(optional_fields())


def test_a_required_field_keeps_refusing_none(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_PORT", "none")
    with pytest.raises(ValueError):
        Settings()


def test_the_command_reads_no_ttl_from_the_environment():
    """The command's own parsing: ``PREFIXCACHE_TTL_SECONDS=none prefixcache serve`` reads no TTL."""
    code = ("import os, sys; from prefixcache.cli import build_parser; from prefixcache_api import Settings;"
            "args = build_parser().parse_args(['serve']);"
            "s = Settings(**{k: v for k, v in vars(args).items() if k in Settings.model_fields});"
            "print(s.ttl_seconds, s.pin_ttl_seconds, s.cache_config().ttl_seconds)")
    env = {"PREFIXCACHE_TTL_SECONDS": "none", "PREFIXCACHE_PIN_TTL_SECONDS": "null", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", "None"]


def test_serve_starts_with_ttl_none_in_the_environment(tmp_path, tiny_model, tokenizer):
    """``PREFIXCACHE_TTL_SECONDS=none prefixcache serve`` starts (it was a validation error, exit 2)."""
    import httpx

    from prefixcache.bench.servers import Server, free_port

    tiny_model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    argv = [sys.executable, "-m", "prefixcache.cli", "serve", "--model", str(tmp_path), "--host", "127.0.0.1",
            "--workers", "1", "--torch-threads", "1", "--log-level", "warning", "--local-admin"]
    server = Server("prefixcache serve", argv + ["--port", str(port := free_port())], "/readyz", threads=1)
    server.env.update(PREFIXCACHE_TTL_SECONDS="none", PREFIXCACHE_PIN_TTL_SECONDS="null")
    server.start(port)
    try:
        assert httpx.get(server.url + "/readyz", timeout=10).status_code == 200
    finally:
        server.stop()
