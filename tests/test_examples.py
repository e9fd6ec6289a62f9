"""The SDK examples run end to end, as scripts, on a tiny model saved to a folder."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_sdk_quickstart_runs_on_a_model_folder_and_the_second_question_hits(tiny_folder):
    out = run_example("sdk_quickstart.py", "--model", str(tiny_folder), "--system-tokens", "200",
                      "--max-new-tokens", "4")
    runs = {label.strip(): (int(prompt), int(cached))
            for label, prompt, cached in re.findall(r"\[(cold|hit )\] prompt=(\d+) cached=(\d+)", out)}
    assert set(runs) == {"cold", "hit"}, out
    assert runs["cold"][0] > 200 and runs["cold"][1] == 0
    assert 200 < runs["hit"][1] < runs["hit"][0]  # the whole system prompt, not the new question
    assert "'queries': 2" in out and "'hits': 0, 'partial_hits': 1" in out


def test_ttft_example_runs_on_a_model_from_the_environment(tiny_folder):
    out = run_example("ttft_cold_vs_hit.py", "--system-tokens", "128", "--question-tokens", "8", "--repeats", "2",
                      env={"PREFIXCACHE_MODEL": str(tiny_folder)})
    # the script itself asserts that every hit reused exactly the system prompt
    assert "system=128 question=8 repeats=2" in out
    medians = {label: float(value) for label, value in re.findall(r"(cold|hit) +TTFT median ([0-9.]+)s", out)}
    assert set(medians) == {"cold", "hit"} and all(v >= 0 for v in medians.values()), out
    assert float(re.search(r"cold/hit = ([0-9.]+)x", out).group(1)) > 0
