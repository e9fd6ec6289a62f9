"""matplotlib is the optional `bench` extra: `pip install .` does not pull it, and without it `prefixcache plan`
and `prefixcache bench` still write their tables and JSON, skipping only the PNG with one line saying why."""
from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

from prefixcache.bench import report as bench_report
from prefixcache.cli import main
from prefixcache.plotting import MISSING

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESSAGE = "plotting needs matplotlib: pip install 'prefixcache[bench]'"
#: Only the test and bench extras may need these.
NOT_CORE = ("matplotlib", "pytest", "hypothesis", "schemathesis", "openai", "anthropic", "openai-agents", "sglang-router",
            "ruff")


@pytest.fixture
def no_matplotlib(monkeypatch):
    """``import matplotlib`` raises ImportError, as where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~\[;(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_pip_install_dot_pulls_no_plotting_or_test_packages():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_name(r) for r in project["dependencies"]}
    assert not core & set(NOT_CORE), sorted(core & set(NOT_CORE))
    extras = project["optional-dependencies"]
    assert "matplotlib" in {_name(r) for r in extras["bench"]}
    assert {"matplotlib", "ruff", "pytest"} <= {_name(r) for r in extras["test"]}


def test_the_message_is_the_documented_one():
    assert MISSING == MESSAGE


def test_plan_without_matplotlib_writes_table_and_json_and_says_why_no_png(tmp_path, capsys, no_matplotlib):
    trace = tmp_path / "m.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 0, "input_length": 12, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 1000, "input_length": 13, "output_length": 5, "hash_ids": [1, 2, 3, 4]}]))
    out = tmp_path / "out"
    assert main(["plan", str(trace), "--format", "mooncake", "--block-tokens", "4", "--kv-bytes-per-token", "1",
                 "--budgets", "2blocks", "--ttls", "none", "--out", str(out), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["points"]  # stdout is still the JSON alone
    assert MESSAGE in captured.err.splitlines()
    assert (out / "plan.md").read_text().startswith("Replayed 2 requests")
    assert json.loads((out / "plan.json").read_text())["points"]
    assert not (out / "plan.png").exists()
    assert "plan.png" not in captured.err.replace(MESSAGE, "")  # not listed as written


def test_bench_report_without_matplotlib_writes_table_and_json_and_says_why_no_png(
        tmp_path, capsys, monkeypatch, no_matplotlib):
    monkeypatch.setattr(bench_report, "markdown", lambda result: "# table")
    monkeypatch.setattr(bench_report, "to_json", lambda result: {"runs": []})
    paths = bench_report.write(object(), tmp_path)
    assert set(paths) == {"md", "json"}
    assert (tmp_path / "results.md").read_text() == "# table\n"
    assert json.loads((tmp_path / "results.json").read_text()) == {"runs": []}
    assert not (tmp_path / "results.png").exists()
    assert MESSAGE in capsys.readouterr().err.splitlines()
