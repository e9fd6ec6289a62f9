"""A real Prometheus (Debian's ``prometheus``) scrapes a live proxy; every dashboard query returns a series.

The queries are read from the provisioned dashboard's JSON, Grafana's variables
substituted, and run through Prometheus' HTTP API after some traffic (hits, a
client error, the prompt-cache parameters, a cache miss reason, a reused document, a flush and a restore from a disk tier), so a query that names a real metric but selects nothing
(wrong label, wrong aggregation) fails here.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prefixcache_api import create_app
from proxy_support import ADMIN, ALPHA, MODEL, auth, live, make_cache, settings

from prefixcache.bench.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"  # Debian's, from scripts/system-deps.sh
pytestmark = pytest.mark.skipif(not Path(PROMETHEUS).exists(),
                                reason="prometheus is not installed: run `make system-deps` as root, or apt-get "
                                       "install prometheus")
SCRAPE_SECONDS = 0.5  # the rounds below wait for scrapes: the shorter, the sooner every series has a rate
#: Grafana's variables, as it would expand them for a dashboard refreshed every few seconds.
VARIABLES = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m"}


def dashboard_queries(path: Path) -> list[tuple[str, str]]:
    """(panel title, query) of every target, variables substituted; fails on a variable it does not know."""
    out = []
    for panel in json.loads(path.read_text())["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, (panel["title"], expr)
            out.append((panel["title"], expr))
    return out


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer, tmp_path_factory):
    """A live proxy with a disk tier written through, so the tier panels have series too."""
    cache = make_cache(tiny_model, tokenizer, tier_disk=str(tmp_path_factory.mktemp("tier")),
                       tier_write_policy="write-through")
    with live(create_app(settings(), cache=cache)) as srv:
        yield srv
    cache.close()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """Prometheus on a free loopback port, scraping the live proxy's /metrics with the admin key."""
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "admin_key").write_text(ADMIN)
    config = {"global": {"scrape_interval": f"{round(SCRAPE_SECONDS * 1000)}ms", "evaluation_interval": "5s"},
              "scrape_configs": [{"job_name": "prefixcache", "metrics_path": "/metrics",
                                  "authorization": {"type": "Bearer", "credentials_file": str(tmp / "admin_key")},
                                  "static_configs": [{"targets": [server.url.removeprefix("http://")]}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: httpx.get(url + "/-/ready", timeout=2).status_code == 200, 60, proc, tmp)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        log.close()


def _until(predicate, timeout: float, proc: subprocess.Popen | None = None, tmp: Path | None = None) -> None:
    """Poll ``predicate`` (an HTTP error counts as false); fail with Prometheus' log if ``proc`` dies or time is up."""
    def log() -> str:
        return (tmp / "prometheus.log").read_text()[-2000:] if tmp is not None else ""

    deadline = time.monotonic() + timeout
    while True:
        assert proc is None or proc.poll() is None, log()
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log()
        time.sleep(0.3)


def _query(url: str, expr: str) -> list[dict]:
    answer = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def _traffic(server) -> None:
    system = "You are a careful assistant for a port authority. " * 20
    with httpx.Client(base_url=server.url, headers=auth(ALPHA), timeout=60) as client:
        for i in range(4):
            body = {"model": MODEL, "max_tokens": 3, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Ship {i}?"}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert client.post("/v1/chat/completions", json={"model": MODEL}).status_code == 400  # an error series
        body = {"model": MODEL, "max_tokens": 3, "prompt_cache_key": "port", "prompt_cache_retention": "24h",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Berth?"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        body = {"model": MODEL, "max_tokens": 3, "diagnostics": {"previous_message_id": "msg-unknown"},  # a miss reason
                "messages": [{"role": "user", "content": "Tide?"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        doc = {"type": "text", "text": "Berths are assigned by draught and length. " * 4, "prefixcache_chunk": True}
        for question in ("Which berth?", f"Which berth for ship {time.monotonic_ns()}?"):  # a document reused
            body = {"model": MODEL, "max_tokens": 3, "messages": [
                {"role": "user", "content": [{"type": "text", "text": question}, doc]}]}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
    with httpx.Client(base_url=server.url, headers=auth(ADMIN), timeout=60) as admin:
        assert admin.request("DELETE", "/v1/cache", params={"tenant": "alpha"}).status_code == 200
    with httpx.Client(base_url=server.url, headers=auth(ALPHA), timeout=60) as client:
        body = {"model": MODEL, "max_tokens": 3, "temperature": 0,  # a device miss the disk tier restores
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Ship 0?"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_every_dashboard_query_returns_a_series_from_a_real_prometheus(server, prometheus):
    def scraped() -> bool:
        return any(s["value"][1] == "1" for s in _query(prometheus, 'up{job="prefixcache"}'))

    _until(scraped, 120)
    queries = dashboard_queries(ROOT / "deploy/grafana/dashboards/prefixcache.json")
    assert len(queries) >= 20
    # A series' first sample has no rate: counters must grow after they were scraped once. Traffic
    # goes on in rounds until every query answers (a loaded machine scrapes late), or time is up.
    deadline, rounds = time.monotonic() + 180, 0
    while True:
        _traffic(server)
        rounds += 1
        time.sleep(SCRAPE_SECONDS * 2.5)
        empty = [(title, expr) for title, expr in queries if not _query(prometheus, expr)]
        if (not empty and rounds >= 3) or time.monotonic() > deadline:
            break
    assert empty == []
    # The per-replica panels have one line per scrape target.
    (line,) = _query(prometheus, dict(queries)["Requests per replica"])
    assert line["metric"]["instance"] == server.url.removeprefix("http://") and float(line["value"][1]) > 0

