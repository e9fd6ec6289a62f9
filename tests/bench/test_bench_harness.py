"""The harness end to end on the small preset, so it cannot rot: tables, JSON, plot, sane numbers."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixcache.bench import add_arguments, models, run
from prefixcache.bench.concurrent import PrefixCacheBatched
from prefixcache.bench.systems import PrefixCacheSystem, Served


def _run(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args([*argv, "--no-progress"]))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("bench")
    start = time.perf_counter()
    assert _run("--preset", "small", "--out", str(out)) == 0
    return out, time.perf_counter() - start


def _summaries(out: Path) -> dict[tuple[str, str], dict]:
    data = json.loads((out / "results.json").read_text())
    return {(run["workload"], s["system"]): s for run in data["runs"] for s in run["summaries"]}


def test_small_preset_writes_table_json_and_plot_quickly(small_run):
    out, seconds = small_run
    assert seconds < 240  # generous: a shared 2-core machine
    md = (out / "results.md").read_text()
    for heading in ("## shared-prefix (float32)", "## multi-turn (float32)", "## no-reuse (float32)", "## Targets"):
        assert heading in md
    assert "| prefixcache |" in md and "| generate-batch |" in md and "| limit |" in md
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["cpus"] >= 1 and data["kv_bytes_per_token"]["float32"] > 0


def test_small_preset_numbers_are_sane(small_run):
    out, _ = small_run
    s = _summaries(out)
    assert s[("shared-prefix", "prefixcache")]["hit_rate"] > 0
    assert s[("multi-turn", "prefixcache")]["hit_rate"] > 0
    assert s[("no-reuse", "prefixcache")]["hit_rate"] == 0
    assert s[("shared-prefix", "generate")]["hit_rate"] == 0
    for (workload, system), row in s.items():
        assert row["ttft_mean"] > 0 and row["ttft_p50"] <= row["ttft_p99"] + 1e-12, (workload, system)
        if system != "limit":
            assert row["tokens_per_s"] > 0 and row["requests_per_s"] > 0 and row["peak_kv_bytes"] > 0
            assert row["output_tokens"] == row["requests"] * 8  # EOS ignored: exactly O tokens each
        if system in ("generate", "prefixcache"):
            assert row["match_vs_generate"] == 1.0
    assert s[("shared-prefix", "generate")]["throughput_vs_generate"] == pytest.approx(1.0)
    data = json.loads((out / "results.json").read_text())
    shared = next(r for r in data["runs"] if r["workload"] == "shared-prefix")
    assert shared["formula_hit_rate"] == pytest.approx((1 - 1 / 3) * 96 / 112)
    assert s[("shared-prefix", "prefixcache")]["hit_rate"] == pytest.approx(shared["ideal_hit_rate"])
    assert data["targets"][0]["hit_over_limit"] is not None


def test_a_wrong_answer_fails_the_run_loudly(monkeypatch, tmp_path, capsys):
    real = PrefixCacheSystem.serve

    def corrupt(self, request, prompt):
        served = real(self, request, prompt)
        return Served((served.output[0] + 1,) + served.output[1:], served.ttft, served.total, served.cached_tokens)

    monkeypatch.setattr(PrefixCacheSystem, "serve", corrupt)
    code = _run("--workloads", "no-reuse", "--systems", "generate,prefixcache", "--unique-prompts", "1",
                "--out", str(tmp_path))
    assert code == 1
    assert "CORRECTNESS CHECK FAILED" in capsys.readouterr().err
    assert not (tmp_path / "results.md").exists()


def test_module_entry_point_runs_standalone():
    proc = subprocess.run([sys.executable, "-m", "prefixcache.bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--preset" in proc.stdout and "--dtype" in proc.stdout


def test_batch_systems_alone_run_without_a_sequential_one(tmp_path):
    """Only the batched system chosen: no per-request loop to run, still a table (it divided by zero)."""
    assert _run("--preset", "small", "--workloads", "shared-prefix", "--systems", "prefixcache-batched",
                "--no-plot", "--out", str(tmp_path)) == 0
    assert ("shared-prefix", "prefixcache-batched") in _summaries(tmp_path)


def test_the_sequential_halves_bracket_the_batch_run(monkeypatch, tmp_path):
    """Serial first half, then the batch system, then the serial second half: a drift of the
    machine's speed during the run weighs on both sides of the batched/serial ratio alike."""
    events: list[str] = []
    serve, call = PrefixCacheSystem.serve, PrefixCacheBatched.call

    def logged_serve(self, request, prompt):
        if request.session != "w":  # not the harness's warm-up calls
            events.append(f"serial {request.index}")
        return serve(self, request, prompt)

    def logged_call(self, prompts):
        events.append(f"batch {len(prompts)}")
        return call(self, prompts)

    monkeypatch.setattr(PrefixCacheSystem, "serve", logged_serve)
    monkeypatch.setattr(PrefixCacheBatched, "call", logged_call)
    assert _run("--preset", "small", "--workloads", "shared-prefix", "--systems", "prefixcache,prefixcache-batched",
                "--no-plot", "--out", str(tmp_path)) == 0
    serial = [e for e in events if e.startswith("serial")]
    n = len(serial)
    assert n >= 2 and events == [*serial[: n // 2], f"batch {n}", *serial[n // 2:]]
    assert serial == [f"serial {i}" for i in range(n)]
    assert list(_summaries(tmp_path)) == [("shared-prefix", "prefixcache"), ("shared-prefix", "prefixcache-batched")]
    speed = json.loads((tmp_path / "results.json").read_text())["runs"][0]["speed_ms"]  # the machine, around each run
    assert [p["moment"] for p in speed] == ["start", "before prefixcache-batched", "after prefixcache-batched", "end"]
    assert all(p["ms"] > 0 for p in speed) and "machine speed (ms of one fixed" in (tmp_path / "results.md").read_text()


def test_speed_probe_is_the_median_product_time_in_ms():
    ticks = iter([0.0, 0.010, 1.0, 1.002, 2.0, 2.002, 3.0, 3.002, 4.0, 4.009, 5.0, 5.003])  # 3 warm-up calls, then 3
    assert models.speed_probe(clock=lambda: next(ticks), calls=3) == pytest.approx(3.0)


def test_warmup_requests_serve_untimed_and_leave_the_caches_warm(tmp_path):
    """--warmup-requests 1 (SGLang bench_serving's convention): each system serves the first request
    untimed first, so the timed run's first request already hits its system prompt; nothing of the
    warm-up is recorded, and the ideal hit rate counts the warm-up prompt as cacheable."""
    assert _run("--preset", "small", "--workloads", "shared-prefix", "--systems", "generate,prefixcache,"
                "prefixcache-batched", "--warmup-requests", "1", "--no-plot", "--out", str(tmp_path)) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    run = data["runs"][0]
    assert data["options"]["warmup_requests"] == 1 and "warm-up" in (tmp_path / "results.md").read_text()
    for name in ("prefixcache", "prefixcache-batched"):
        records = run["records"][name]
        assert [r["index"] for r in records] == list(range(len(records)))  # the warm-up is not among them
        assert records[0]["cached_tokens"] > 0, name  # request 0 was the warm-up's prompt: a full hit
    assert run["records"]["generate"][0]["cached_tokens"] == 0
    s = _summaries(tmp_path)
    assert s[("shared-prefix", "prefixcache")]["hit_rate"] == pytest.approx(run["ideal_hit_rate"])
    assert run["ideal_hit_rate"] > run["formula_hit_rate"]  # the warm prompt's group starts warm


def test_warmup_requests_must_not_be_negative():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--warmup-requests", "-1"])
    assert parser.parse_args([]).warmup_requests == 0
