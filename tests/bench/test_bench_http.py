"""The HTTP path: both real servers spawned on the small preset's model, and the subprocess handling."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import pytest

from prefixcache.bench import add_arguments, run, servers
from prefixcache.bench.options import DEFAULT_SYSTEMS, HTTP_SYSTEMS, options_from_args

HTTP = ("http-prefixcache", "http-transformers-serve")


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture(scope="module")
def http_run(tmp_path_factory) -> tuple[dict, str, float]:
    out = tmp_path_factory.mktemp("bench-http")
    start = time.perf_counter()
    code = run(_args("--preset", "small", "--workloads", "shared-prefix,multi-turn", "--systems",
                     "generate,prefixcache," + ",".join(HTTP), "--out", str(out), "--no-progress", "--no-plot"))
    assert code == 0
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), \
        time.perf_counter() - start


def test_both_servers_run_end_to_end_with_sane_figures(http_run):
    data, md, seconds = http_run
    assert seconds < 240, seconds  # generous: a shared 2-core machine
    o = data["options"]["output_tokens"]
    for wrun in data["runs"]:
        rows = {s["system"]: s for s in wrun["summaries"]}
        assert set(HTTP) <= set(rows), wrun["workload"]
        for name in HTTP:
            row, records = rows[name], wrun["records"][name]
            assert len(records) == row["requests"] == rows["generate"]["requests"]
            assert all(r["ttft"] > 0 and r["total"] >= r["ttft"] for r in records), name
            # EOS ignored (proxy: the saved folder has no EOS id; transformers: eos_token_id -1).
            assert [r["completion_tokens"] for r in records] == [o] * len(records), name
            assert row["output_tokens"] == o * row["requests"]
            assert row["tokens_per_s"] > 0 and row["requests_per_s"] > 0 and row["tpot"] > 0
            assert row["ttft_p50"] <= row["ttft_p99"] + 1e-12
            # float32, same weights, greedy: the streamed answers are generate()'s, token for token.
            texts = [(r["text"], g["text"]) for r, g in zip(records, wrun["records"]["generate"], strict=True)]
            assert row["match_vs_generate"] == 1.0, (wrun["workload"], name, texts)
            assert row["ttft_speedup"] > 0 and row["throughput_vs_generate"] > 0
            gen = wrun["records"]["generate"]
            assert [r["prompt_tokens"] for r in records] == [r["prompt_tokens"] for r in gen], name
        ours, theirs = rows["http-prefixcache"], rows["http-transformers-serve"]
        assert ours["hit_rate"] > 0 and ours["peak_kv_bytes"] > 0
        assert theirs["hit_rate"] is None and theirs["peak_kv_bytes"] is None  # the server reports neither
    assert "| http-prefixcache |" in md and "| http-transformers-serve |" in md
    assert "peak KV n/a" in md


def test_the_proxy_hit_rate_is_bounded_by_the_achievable_one(http_run):
    data, _, _ = http_run
    shared = next(r for r in data["runs"] if r["workload"] == "shared-prefix")
    rows = {s["system"]: s for s in shared["summaries"]}
    # Concurrent clients: a request sent before its group's prefix was stored misses.
    assert 0 < rows["http-prefixcache"]["hit_rate"] <= shared["ideal_hit_rate"] + 1e-9
    records = shared["records"]["http-prefixcache"]
    assert all(0 <= r["cached_tokens"] < r["prompt_tokens"] for r in records)


def test_http_systems_are_opt_in_and_selectable():
    assert not set(HTTP_SYSTEMS) & set(DEFAULT_SYSTEMS)
    assert options_from_args(_args("--systems", "http-transformers-serve")).systems == ("http-transformers-serve",)
    with pytest.raises(SystemExit):
        _args("--systems", "http-vllm")


def test_the_transformers_serve_peer_without_the_bench_extra_says_how_to_install_it(capsys, monkeypatch):
    """Without openai (part of the `bench` extra), ``prefixcache bench --systems http-transformers-serve`` exits 2
    with the pip line, before loading anything; the proxy's own HTTP system needs no extra."""
    monkeypatch.setitem(sys.modules, "openai", None)  # `import openai` fails, as where the extra is not installed
    assert run(_args("--systems", "http-transformers-serve,generate")) == 2
    assert ("needs openai (not installed): pip install 'prefixcache[bench]'"
            in capsys.readouterr().err)
    assert options_from_args(_args("--systems", "http-prefixcache")).systems == ("http-prefixcache",)


def test_word_tokenizer_round_trips_every_token():
    tok = servers.word_tokenizer(700)
    ids = list(range(700))
    text = tok.decode(ids)
    assert text.startswith(" x") and tok.encode(text).ids == ids


def test_a_server_that_dies_reports_its_output(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('model folder is broken', file=sys.stderr); sys.exit(3)"]
    server = servers.Server("fake", argv, "/health")
    try:
        with pytest.raises(servers.ServerError, match=r"(?s)exited with code 3.*model folder is broken"):
            server.start(servers.free_port())
    finally:
        server.stop()


def test_a_server_never_ready_times_out_and_is_killed(monkeypatch):
    monkeypatch.setattr(servers, "READY_TIMEOUT", 1.0)
    monkeypatch.setattr(servers, "STOP_TIMEOUT", 1.0)
    # Ignores SIGTERM and never listens: start() gives up, stop() has to kill it.
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('loading', flush=True); " \
           "time.sleep(60)"
    server = servers.Server("stuck", [sys.executable, "-c", code], "/health")
    with pytest.raises(servers.ServerError, match=r"(?s)not ready after 1 s.*loading"):
        server.start(servers.free_port())
    t0 = time.monotonic()
    server.stop()
    assert not server.alive() and time.monotonic() - t0 < 20  # killed after STOP_TIMEOUT, not left hanging
    assert server.proc.returncode == -9


def test_model_folder_of_a_saved_model_is_used_as_is(tmp_path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from prefixcache.bench.models import TINY_CONFIG

    model = LlamaForCausalLM(LlamaConfig(**TINY_CONFIG))
    model.save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=servers.word_tokenizer(TINY_CONFIG["vocab_size"])).save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    folder = servers.model_folder(loaded, None)
    assert folder.path == str(tmp_path) and folder.temporary is None
    in_memory = servers.model_folder(model, None)
    try:
        saved = json.loads((Path(in_memory.path) / "generation_config.json").read_text())
        assert saved["eos_token_id"] is None and Path(in_memory.path, "tokenizer.json").exists()
    finally:
        in_memory.cleanup()
    assert not Path(in_memory.path).exists()
