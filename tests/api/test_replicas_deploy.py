"""The replicas deployments (deploy/replicas/ for compose, deploy/k8s/ for Kubernetes), parsed and
cross-checked: no Docker engine or cluster runs here.

Replica commands are parsed by ``prefixcache serve``'s own parser and the router's by
sglang-router's. The shared tier's flags (``TIER_FLAGS``) are checked by the parser as
soon as ``prefixcache serve --help`` lists them; until then they are set aside.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from prefixcache_api.settings import ENV_PREFIX, Settings

from prefixcache.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "replicas"
#: The shared Redis tier's serve flags and their env var names.
TIER_FLAGS = ("--tier-redis", "--tier-redis-bytes", "--hash-secret")
TIER_ENV = {f"{ENV_PREFIX}{f[2:].replace('-', '_').upper()}" for f in TIER_FLAGS}
SMG_METRIC = re.compile(r"\bsmg_[a-z_]+\b")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((HERE / "compose.yml").read_text())


def _replicas(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if name.startswith("replica-")}


def redis_server_argv(script: str) -> list[str]:
    """The ``redis-server`` arguments of the Redis container's ``sh -c`` script (its ``exec`` line)."""
    line = next(ln for ln in script.splitlines() if ln.strip().startswith("exec redis-server"))
    argv = shlex.split(line.split("<<", 1)[0])
    return argv[argv.index("redis-server"):]


def _serve_flags() -> set[str]:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    return {opt for action in serve._actions for opt in action.option_strings}


def _without_missing_tier_flags(argv: list[str]) -> list[str]:
    """``argv`` minus any tier flag (and its value) the CLI does not have yet."""
    known, out, skip = _serve_flags(), [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in TIER_FLAGS and flag not in known:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def test_services(compose):
    services = compose["services"]
    assert set(services) == {"redis", "replica-1", "replica-2", "router", "prometheus", "grafana"}
    assert len(_replicas(compose)) >= 2
    assert "127.0.0.1:30000:30000" in services["router"]["ports"]  # loopback only
    for name in _replicas(compose):
        assert services["router"]["depends_on"][name]["condition"] == "service_healthy"
        assert "ports" not in services[name]  # clients go through the router


def test_replica_commands_parse_and_share_one_tier_and_one_secret(compose):
    replicas = _replicas(compose)
    assert len({json.dumps(r, sort_keys=True) for r in replicas.values()}) == 1  # identical replicas
    for name, replica in replicas.items():
        argv = replica["command"]
        assert argv[0] == "serve"
        # The tier's URL comes from the environment (it carries Redis' password: never on a command line),
        # pointing at the compose Redis with the password compose requires.
        assert "--tier-redis" not in argv
        tier = replica["environment"]["PREFIXCACHE_TIER_REDIS"]
        assert re.fullmatch(r"redis://:\$\{REDIS_PASSWORD:\?.+\}@redis:6379/\d+", tier), tier
        assert int(argv[argv.index("--tier-redis-bytes") + 1]) > 0
        # Written through: a prefix reaches Redis when cached, not when evicted (a crash would lose it).
        assert argv[argv.index("--tier-write-policy") + 1] == "write-through"
        args = build_parser().parse_args(_without_missing_tier_flags(argv))
        assert args.host == "0.0.0.0" and args.port == 8000, name
        for flag in set(TIER_FLAGS) & _serve_flags() & set(argv):  # given flags parse to their values
            assert getattr(args, flag[2:].replace("-", "_")) is not None, flag
        env = replica["environment"]
        fields = {f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields}
        assert set(env) <= fields | TIER_ENV, set(env) - fields - TIER_ENV
        # The admin key and the hash secret are required, never defaulted, never in the file.
        for key in ("PREFIXCACHE_ADMIN_KEY", "PREFIXCACHE_HASH_SECRET"):
            assert re.fullmatch(rf"\$\{{{key}:\?.+\}}", env[key]), key
    redis = redis_server_argv(compose["services"]["redis"]["command"][-1])
    assert redis[redis.index("--maxmemory-policy") + 1] == "allkeys-lru"


def test_router_command_parses_with_explicit_workers_and_loopback_free_binds(compose):
    from sglang_router.launch_router import parse_router_args

    router = compose["services"]["router"]
    args = parse_router_args(router["command"])
    assert args.worker_urls == [f"http://{name}:8000" for name in _replicas(compose)]
    assert args.policy == "cache_aware" and args.balance_abs_threshold < 64  # see docs/deployment.md
    assert args.host == "0.0.0.0" and args.prometheus_host == "0.0.0.0"  # reachable from the other containers
    assert f"127.0.0.1:{args.port}:{args.port}" in router["ports"]
    dockerfile = (HERE / router["build"]["dockerfile"]).read_text()
    pinned = re.search(r'"sglang-router==([\w.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert re.search(rf"^ARG SGLANG_ROUTER_VERSION={re.escape(pinned)}$", dockerfile, re.M)
    assert router["image"].endswith(f":{pinned}")
    assert json.loads(re.search(r"^ENTRYPOINT (.+)$", dockerfile, re.M).group(1))[-1] == "sglang_router.launch_router"


def test_prometheus_scrapes_every_replica_and_the_router(compose):
    config = yaml.safe_load((HERE / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    replicas = jobs["prefixcache"]
    assert replicas["static_configs"][0]["targets"] == [f"{name}:8000" for name in _replicas(compose)]
    assert replicas["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/admin_key"}
    assert compose["secrets"]["admin_key"]["environment"] == "PREFIXCACHE_ADMIN_KEY"
    assert "admin_key" in compose["services"]["prometheus"]["secrets"]
    args_port = compose["services"]["router"]["command"]
    metrics_port = args_port[args_port.index("--prometheus-port") + 1]
    assert jobs["sglang-router"]["static_configs"][0]["targets"] == [f"router:{metrics_port}"]
    mounts = dict(v.split(":")[1::-1] for v in compose["services"]["prometheus"]["volumes"])
    assert (HERE / mounts["/etc/prometheus/prometheus.yml"]).resolve() == (HERE / "prometheus.yml").resolve()


def test_grafana_has_the_per_replica_panels_and_the_router_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounts = {container: (HERE / host).resolve() for host, container in
              (v.split(":")[:2] for v in grafana["volumes"])}
    assert mounts["/etc/grafana/provisioning"] == ROOT / "deploy/grafana/provisioning"
    dashboards = mounts["/var/lib/grafana/dashboards"]
    main = json.loads((dashboards / "prefixcache.json").read_text())
    per_replica = [p for p in main["panels"] if "per replica" in p["title"]]
    assert len(per_replica) >= 2
    assert all("by (instance)" in t["expr"] for p in per_replica for t in p["targets"])
    router = json.loads((dashboards / "router.json").read_text())
    assert router["uid"] != main["uid"]
    for panel in router["panels"]:
        for target in panel["targets"]:
            assert SMG_METRIC.search(target["expr"]), target["expr"]


def test_deployment_page_documents_the_replicas(compose):
    page = (ROOT / "docs" / "deployment.md").read_text()
    for text in ("deploy/replicas/compose.yml", "prefixcache admin --replicas", "--balance-abs-threshold",
                 "python -m benchmarks.replicas", "deploy/k8s/replicas.yaml", "--tier-write-policy write-through",
                 "round_robin + shared Redis tier"):
        assert text in page, text


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict]:
    """The Kubernetes objects of deploy/k8s/replicas.yaml by (kind, name)."""
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "replicas.yaml").read_text()))
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(objects) == len(docs)  # no name given twice
    return objects


def _pod(obj: dict) -> dict:
    """The single container of a workload, after checking its selector picks its own pods."""
    spec = obj["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (container,) = spec["template"]["spec"]["containers"]
    return container


def _service_for(k8s: dict, name: str, workload: dict) -> dict:
    service = k8s["Service", name]
    assert service["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
    return service


def test_k8s_replicas_run_the_compose_replicas_command_with_secrets_from_one_secret(k8s, compose):
    from prefixcache_api.replica import replica
    from prefixcache_api.routes import router

    sts = k8s["StatefulSet", "prefixcache"]
    container = _pod(sts)
    argv = container["args"]
    assert argv == next(iter(_replicas(compose).values()))["command"]  # one replica command for both
    args = build_parser().parse_args(argv)
    assert args.host == "0.0.0.0" and {p["containerPort"] for p in container["ports"]} == {args.port}
    assert argv[argv.index("--tier-write-policy") + 1] == "write-through"
    headless = _service_for(k8s, sts["spec"]["serviceName"], sts)
    assert headless["spec"]["clusterIP"] == "None"  # one DNS name per replica
    assert [p["targetPort"] for p in headless["spec"]["ports"]] == [args.port]
    env = {e["name"]: e for e in container["env"]}
    redis = urlparse(env["PREFIXCACHE_TIER_REDIS"]["value"])  # the URL comes from the environment, as in compose
    assert "--tier-redis" not in argv and redis.password == "$(REDIS_PASSWORD)"
    redis_pod = _pod(k8s["Deployment", redis.hostname])
    assert redis.port in [p["port"] for p in _service_for(k8s, redis.hostname, k8s["Deployment", redis.hostname])
                          ["spec"]["ports"]]
    assert redis.port in [p["containerPort"] for p in redis_pod["ports"]]
    redis_argv = redis_server_argv(redis_pod["args"][-1])
    assert redis_argv[redis_argv.index("--maxmemory-policy") + 1] == "allkeys-lru"
    # Redis runs the compose file's script (compose writes a shell `$` as `$$`).
    assert redis_pod["args"] == [a.replace("$$", "$") for a in compose["services"]["redis"]["command"]]
    fields = {f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields}
    assert set(env) <= fields | TIER_ENV | {"REDIS_PASSWORD"}, set(env) - fields - TIER_ENV
    # $(REDIS_PASSWORD) in the URL expands only to a variable defined before it.
    assert list(env).index("REDIS_PASSWORD") < list(env).index("PREFIXCACHE_TIER_REDIS")
    secret_env = ("PREFIXCACHE_ADMIN_KEY", "PREFIXCACHE_HASH_SECRET", "REDIS_PASSWORD")
    secrets = {env[k]["valueFrom"]["secretKeyRef"]["name"] for k in secret_env}
    assert len(secrets) == 1 and all("value" not in env[k] for k in secret_env)
    assert ("Secret", secrets.pop()) not in k8s  # created from the command line, never kept in the file
    paths = {route.path for route in [*router.routes, *replica.routes]}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in paths, probe
    # Not ready drops a replica from the headless Service's DNS: readiness is the router's own check.
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"


def test_k8s_router_lists_every_replica_by_its_stable_name(k8s):
    from sglang_router.launch_router import parse_router_args

    sts = k8s["StatefulSet", "prefixcache"]
    port = build_parser().parse_args(_pod(sts)["args"]).port
    deployment = k8s["Deployment", "router"]
    container = _pod(deployment)
    args = parse_router_args(container["args"])
    name, service = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert args.worker_urls == [f"http://{name}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])]
    assert args.policy == "cache_aware" and args.balance_abs_threshold < 64  # see docs/deployment.md
    assert args.host == "0.0.0.0" and args.prometheus_host == "0.0.0.0"
    assert {p["containerPort"] for p in container["ports"]} == {args.port, args.prometheus_port}
    assert {p["targetPort"] for p in _service_for(k8s, "router", deployment)["spec"]["ports"]} == \
        {args.port, args.prometheus_port}
    pinned = re.search(r'"sglang-router==([\w.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert container["image"].endswith(f":{pinned}")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"
