"""The shipped deployments, read as an attacker would: who can reach Redis, the proxy and the metrics.

Compose files and Kubernetes manifests are parsed (no Docker engine or cluster runs here); the Redis
start-up script they share is also run against a real ``redis-server`` where one is installed.
docs/hardening.md ("Threat model", "Deployments") says what these checks do and do not cover.
"""
from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import ssl
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILES = sorted({ROOT / "docker-compose.yml", *ROOT.glob("deploy/**/compose*.y*ml")})
K8S_FILES = sorted(ROOT.glob("deploy/k8s/*.y*ml"))
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod"}
#: Environment variable names that hold a credential.
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|(^|_)KEYS?($|_)")
#: A compose value that is a required variable (`${NAME:?message}`) and nothing else.
REQUIRED = r"\$\{(?P<name>[A-Z0-9_]+):\?[^}]+\}"
INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?([?-])([^}]*))?\}")
#: Memory quantities Kubernetes accepts, in bytes.
UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
         "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


# -- helpers -----------------------------------------------------------------------------------------
def _compose(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _services(path: Path) -> dict[str, dict]:
    return _compose(path)["services"]


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return {k: ("" if v is None else str(v)) for k, v in env.items()}


def _resolve(value: str, env: dict[str, str]) -> str:
    """A compose value as the container sees it, with ``env`` as the shell compose runs in."""
    def one(m: re.Match) -> str:
        name, op, arg = m.groups()
        if env.get(name):
            return env[name]
        if op == "?":
            raise KeyError(f"compose refuses to start: {arg}")
        return arg or ""
    return INTERPOLATION.sub(one, value).replace("$$", "$")


def _objects() -> list[dict]:
    return [d for path in K8S_FILES for d in yaml.safe_load_all(path.read_text()) if d]


def _pod_spec(obj: dict) -> dict:
    if obj["kind"] == "Pod":
        return obj["spec"]
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return obj["spec"]["template"]["spec"]


def _pod_labels(obj: dict) -> dict[str, str]:
    if obj["kind"] == "Pod":
        return obj["metadata"].get("labels", {})
    return obj["spec"]["template"]["metadata"]["labels"]


def _workloads() -> list[dict]:
    return [o for o in _objects() if o["kind"] in WORKLOADS]


def _containers(obj: dict) -> list[dict]:
    spec = _pod_spec(obj)
    return [*spec.get("initContainers", []), *spec["containers"]]


def _workload(name: str) -> dict:
    (obj,) = [o for o in _workloads() if o["metadata"]["name"] == name]
    return obj


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked here"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([kMGT]i?|)", str(quantity)).groups()
    return int(number) * UNITS[unit]


def _redis_argv(script: str) -> list[str]:
    """The ``redis-server`` argv of a Redis container's ``sh -c`` script, and its here-document."""
    line = next(ln for ln in script.splitlines() if ln.strip().startswith("exec redis-server"))
    argv = shlex.split(line.split("<<", 1)[0])
    return argv[argv.index("redis-server"):]


def _redis_stdin(script: str) -> list[str]:
    """The configuration lines the script feeds ``redis-server -`` on stdin (its here-document)."""
    lines = script.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("exec redis-server"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "EOF")
    return [ln.strip() for ln in lines[start + 1 : end]]


def _is_redis(image: str) -> bool:
    return image.split("/")[-1].split(":")[0] in {"redis", "redis-stack-server", "valkey"}


def _compose_redis() -> list[tuple[str, dict]]:
    return [(f"{p.relative_to(ROOT)}:{name}", s) for p in COMPOSE_FILES for name, s in _services(p).items()
            if _is_redis(s.get("image", ""))]


def _k8s_redis() -> list[tuple[dict, dict]]:
    return [(o, c) for o in _workloads() for c in _containers(o) if _is_redis(c["image"])]


def _ports(service: dict) -> list[tuple[str | None, str]]:
    """(host IP, "host:container") of each published port, short or long syntax."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            out.append((port.get("host_ip"), f"{port.get('published')}:{port['target']}"))
            continue
        parts = str(port).split(":")
        out.append((":".join(parts[:-2]) or None, ":".join(parts[-2:])) if len(parts) >= 3 else (None, str(port)))
    return out


def test_the_files_are_found():
    assert ROOT / "docker-compose.yml" in COMPOSE_FILES and ROOT / "deploy/replicas/compose.yml" in COMPOSE_FILES
    assert ROOT / "deploy/k8s/replicas.yaml" in K8S_FILES
    assert _compose_redis() and _k8s_redis()


# -- compose: nothing published beyond the host ---------------------------------------------------------
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_published_port_is_on_loopback(path):
    for name, service in _services(path).items():
        for host_ip, mapping in _ports(service):
            assert host_ip == "127.0.0.1", f"{name} publishes {mapping} on every interface"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compose_services_drop_privileges(path):
    for name, service in _services(path).items():
        assert "no-new-privileges:true" in service.get("security_opt", []), name
        assert service.get("cap_drop") == ["ALL"], name
        assert not service.get("privileged"), name
        assert service.get("network_mode") != "host", name
        user = str(service.get("user", "")).split(":")[0]
        assert user not in {"0", "root"}, name


# -- Redis: a password everywhere, never a literal, never on a command line ------------------------------
def _check_redis_script(script: str) -> None:
    argv = _redis_argv(script)
    assert argv[1] == "-", "the configuration (with the password) comes on stdin"
    assert not any("requirepass" in a or a in {"--user", "--masterauth"} for a in argv), argv
    assert _redis_stdin(script) == ["requirepass $REDIS_PASSWORD"]
    # An unset or empty password stops the container instead of starting an open Redis.
    assert '[ -n "$REDIS_PASSWORD" ] || {' in script and "exit 1" in script
    assert "--protected-mode" not in script  # the image's entrypoint would add `no` for a bare redis-server


@pytest.mark.parametrize("where,service", _compose_redis(), ids=[w for w, _ in _compose_redis()])
def test_compose_redis_requires_a_password(where, service):
    env = _environment(service)
    assert re.fullmatch(REQUIRED, env["REDIS_PASSWORD"]) and "REDIS_PASSWORD" in env["REDIS_PASSWORD"], env
    sh, flag, script = service["command"]
    assert (sh, flag) == ("sh", "-c")
    _check_redis_script(script.replace("$$", "$"))
    assert "$REDIS_PASSWORD" not in script.replace("$$", ""), "a single $ would be compose's, not the shell's"
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL" and 'REDISCLI_AUTH="$$REDIS_PASSWORD" redis-cli ping | grep -q PONG' == test[1]
    assert str(service.get("user", "")).split(":")[0] not in {"", "0", "root"}  # sh would otherwise stay root
    assert "ports" not in service  # reached over the compose network only


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_compose_redis_clients_carry_the_password_from_the_environment(path):
    services = _services(path)
    redis = {name for name, s in services.items() if _is_redis(s.get("image", ""))}
    for name, service in services.items():
        command = " ".join(map(str, service.get("command") or []))
        assert "redis://" not in command and "rediss://" not in command, f"{name}: a URL on a command line"
        for key, value in _environment(service).items():
            if "://" not in value or not value.startswith(("redis://", "rediss://")):
                continue
            # userinfo is exactly one required variable (its message may hold any character but `}`).
            url = re.fullmatch(rf"rediss?://:{REQUIRED}@(?P<host>[\w.-]+):\d+/\d+", value)
            assert url, f"{name}.{key}: Redis URL without a required password"
            assert url["host"] in redis, (name, key)


def test_k8s_redis_requires_a_password_from_a_secret():
    for obj, container in _k8s_redis():
        env = {e["name"]: e for e in container["env"]}
        assert "value" not in env["REDIS_PASSWORD"] and env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"]
        assert "command" not in container  # the image's entrypoint runs the script, as in compose
        sh, flag, script = container["args"]
        assert (sh, flag) == ("sh", "-c")
        _check_redis_script(script)
        probe = container["readinessProbe"]["exec"]["command"]
        assert probe == ["sh", "-c", 'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli ping | grep -q PONG']


def test_k8s_redis_clients_carry_the_password_from_a_secret():
    services = {o["metadata"]["name"]: o for o in _objects() if o["kind"] == "Service"}
    redis_labels = [_pod_labels(o) for o, _ in _k8s_redis()]
    for obj in _workloads():
        for container in _containers(obj):
            argv = " ".join(map(str, [*container.get("command", []), *container.get("args", [])]))
            assert "redis://" not in argv and "rediss://" not in argv, obj["metadata"]["name"]
            env = container.get("env", [])
            names = [e["name"] for e in env]
            for e in env:
                if not str(e.get("value", "")).startswith(("redis://", "rediss://")):
                    continue
                url = urlparse(e["value"])
                ref = re.fullmatch(r"\$\((\w+)\)", url.password or "")
                assert ref, f"{e['name']}: a Redis URL without the password's $(VAR)"
                source = env[names.index(ref.group(1))]
                assert names.index(ref.group(1)) < names.index(e["name"]), "$(VAR) expands only earlier variables"
                assert "secretKeyRef" in source["valueFrom"] and "value" not in source
                service = services[url.hostname]
                assert any(_selects({"matchLabels": service["spec"]["selector"]}, labels) for labels in redis_labels)


@pytest.fixture
def redis_from_compose(tmp_path):
    """The compose Redis script run on a loopback port: (process, port, password)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (`make system-deps`)")
    from prefixcache.bench.servers import free_port

    _, service = next((w, s) for w, s in _compose_redis() if w.startswith("deploy/replicas"))
    script = service["command"][2].replace("$$", "$")
    port, password = free_port(), secrets.token_hex(32)
    script = script.replace("redis-server - ", f"redis-server - --port {port} --bind 127.0.0.1 --dir {tmp_path} ", 1)
    env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": password}
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import redis

    client = redis.Redis(port=port, password=password, socket_timeout=1)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"redis did not start: {proc.stderr.read().decode()}")
            time.sleep(0.05)
    try:
        yield proc, port, password
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_compose_redis_script_requires_its_password_and_the_replicas_url_carries_it(
        redis_from_compose, monkeypatch):
    import redis
    from prefixcache_api.settings import ENV_PREFIX, Settings

    proc, port, password = redis_from_compose
    # `exec`: the script's process is redis-server, and its command line holds no password.
    assert password.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=1).set("k", "v")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, password="wrong", socket_timeout=1).ping()
    # The replicas' tier URL, as compose builds it, authenticates (pointed at this loopback port).
    replica = _services(ROOT / "deploy/replicas/compose.yml")["replica-1"]
    shell = {"REDIS_PASSWORD": password, "PREFIXCACHE_ADMIN_KEY": "sk-admin", "PREFIXCACHE_HASH_SECRET": "s" * 32}
    env = {k: _resolve(v, shell) for k, v in _environment(replica).items()}
    for name in list(Settings.model_fields):
        monkeypatch.delenv(f"{ENV_PREFIX}{name.upper()}", raising=False)
    for key, value in env.items():
        if value:
            monkeypatch.setenv(key, value.replace("@redis:6379/", f"@127.0.0.1:{port}/"))
    url = Settings().tier_redis.get_secret_value()
    assert urlparse(url).password == password
    client = redis.Redis.from_url(url, socket_timeout=1)
    assert client.set("prefixcache:probe", b"x") and client.get("prefixcache:probe") == b"x"
    # Compose's health check passes with the password and fails without it.
    if shutil.which("redis-cli"):
        service = next(s for w, s in _compose_redis() if w.startswith("deploy/replicas"))
        check = service["healthcheck"]["test"][1].replace("$$", "$").replace("redis-cli", f"redis-cli -p {port}")
        base = {"PATH": os.environ["PATH"]}
        assert subprocess.run(["sh", "-c", check], env={**base, "REDIS_PASSWORD": password}).returncode == 0
        assert subprocess.run(["sh", "-c", check], env={**base, "REDIS_PASSWORD": "wrong"}).returncode != 0


def test_the_redis_script_refuses_to_start_without_a_password():
    _, service = _compose_redis()[0]
    script = service["command"][2].replace("$$", "$")
    for env in ({}, {"REDIS_PASSWORD": ""}):
        run = subprocess.run(["sh", "-c", script.replace("exec redis-server", "exec false")],
                             env={"PATH": os.environ["PATH"], **env}, capture_output=True, timeout=10)
        assert run.returncode == 1 and b"REDIS_PASSWORD is empty" in run.stderr


def test_compose_refuses_to_start_without_the_redis_password():
    for path in COMPOSE_FILES:
        for name, service in _services(path).items():
            for key, value in _environment(service).items():
                if "REDIS_PASSWORD" in value:
                    with pytest.raises(KeyError, match="compose refuses to start"):
                        _resolve(value, {})


def test_the_tier_accepts_rediss_with_certificate_checks():
    import redis
    from prefixcache_api.settings import Settings

    url = "rediss://:pw@redis:6380/0?ssl_ca_certs=/etc/redis-ca/ca.crt"
    settings = Settings(tier_redis=url, hash_secret="s" * 32, admin_key="sk-admin")
    assert settings.cache_config().tier_redis == url
    from prefixcache.cache.tiers.redis_tier import RedisTier

    tier = RedisTier(url, 1 << 20, lambda: 0.0)  # connects at its first call: none here
    pool = tier._client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    conn = pool.make_connection()  # the tier asks for the checks itself, whatever redis-py's defaults
    assert (conn.cert_reqs, conn.check_hostname, conn.ca_certs) == (ssl.CERT_REQUIRED, True, "/etc/redis-ca/ca.crt")
    tier.close()
    plain = RedisTier("redis://:pw@redis:6379/0", 1 << 20, lambda: 0.0)
    assert plain._client.connection_pool.connection_class is redis.Connection
    plain.close()


def _redis_memory(quantity: str) -> int:
    """A ``redis.conf`` memory size: ``8gb`` is 8 GiB, ``8g`` 8 * 10**9 (Redis' own units)."""
    number, unit = re.fullmatch(r"(\d+)(k|kb|m|mb|g|gb|)", quantity.lower()).groups()
    return int(number) * {"": 1, "k": 10**3, "kb": 1 << 10, "m": 10**6, "mb": 1 << 20, "g": 10**9, "gb": 1 << 30}[unit]


def test_the_tier_budget_leaves_redis_room_under_maxmemory():
    """Redis' own eviction may drop any key (index entries too): the replicas' tier budget stays well under
    maxmemory, so the tier's LRU does the evicting."""
    scripts = [s["command"][2] for _, s in _compose_redis()] + [c["args"][2] for _, c in _k8s_redis()]
    argvs = [s.get("command") or [] for p in COMPOSE_FILES for s in _services(p).values()
             if s.get("image", "").startswith("prefixcache:")]
    argvs += [c["args"] for o in _workloads() for c in _containers(o) if c["image"].startswith("prefixcache:")]
    budgets = [int(a[a.index("--tier-redis-bytes") + 1]) for a in argvs if "--tier-redis-bytes" in a]
    assert scripts and budgets
    for script in scripts:
        argv = _redis_argv(script.replace("$$", "$"))
        maxmemory = _redis_memory(argv[argv.index("--maxmemory") + 1])
        assert all(budget <= 0.9 * maxmemory for budget in budgets), (budgets, maxmemory)


# -- Grafana and Prometheus: per-tenant metrics behind a login and the admin key --------------------------
def _by_image(name: str) -> list[tuple[str, dict, Path]]:
    return [(f"{p.relative_to(ROOT)}:{n}", s, p) for p in COMPOSE_FILES for n, s in _services(p).items()
            if s.get("image", "").split("/")[-1].startswith(name + ":")]


@pytest.mark.parametrize("where,service,path", _by_image("grafana"), ids=[w for w, *_ in _by_image("grafana")])
def test_grafana_needs_a_login_and_a_required_admin_password(where, service, path):
    env = _environment(service)
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    match = re.fullmatch(REQUIRED, env["GF_SECURITY_ADMIN_PASSWORD"])
    assert match and match["name"] == "GRAFANA_ADMIN_PASSWORD"
    with pytest.raises(KeyError, match="compose refuses to start"):
        _resolve(env["GF_SECURITY_ADMIN_PASSWORD"], {})
    assert not any(k.startswith("GF_AUTH_PROXY") or k == "GF_AUTH_DISABLE_LOGIN_FORM" for k in env)


@pytest.mark.parametrize("where,service,path", _by_image("prometheus"), ids=[w for w, *_ in _by_image("prometheus")])
def test_prometheus_scrapes_the_proxy_with_the_admin_key_from_a_secret(where, service, path):
    compose = _compose(path)
    mounts = {c: (path.parent / h).resolve() for h, c, *_ in (v.split(":") for v in service["volumes"])}
    config_file = next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(mounts[config_file].read_text())
    assert "--web.enable-admin-api" not in service["command"] and "--web.enable-lifecycle" not in service["command"]
    proxies = {n for n, s in compose["services"].items()
               if s.get("image", "").startswith("prefixcache:")}
    scraped = set()
    for job in config["scrape_configs"]:
        targets = {t.split(":")[0] for sc in job["static_configs"] for t in sc["targets"]}
        assert "bearer_token" not in job and "credentials" not in job.get("authorization", {}), job["job_name"]
        if targets & proxies:
            scraped |= targets & proxies
            credentials = job["authorization"]["credentials_file"]
            assert credentials.startswith("/run/secrets/")
            secret = credentials.removeprefix("/run/secrets/")
            assert secret in service["secrets"]
            assert compose["secrets"][secret] == {"environment": "PREFIXCACHE_ADMIN_KEY"}
    assert scraped == proxies  # every proxy is scraped, each with the key


def test_the_proxies_keep_metrics_behind_the_admin_key():
    for path in COMPOSE_FILES:
        for name, service in _services(path).items():
            env = _environment(service)
            assert env.get("PREFIXCACHE_METRICS_PUBLIC", "false").lower() in {"", "false", "0"}, name
            assert "--metrics-public" not in service.get("command", []), name
    for obj in _workloads():
        for container in _containers(obj):
            assert "--metrics-public" not in container.get("args", [])
            assert "PREFIXCACHE_METRICS_PUBLIC" not in {e["name"] for e in container.get("env", [])}


# -- Kubernetes: who reaches whom, and what each container may do -------------------------------------------
def _policies_for(labels: dict[str, str]) -> list[dict]:
    return [o for o in _objects() if o["kind"] == "NetworkPolicy" and _selects(o["spec"]["podSelector"], labels)]


def test_only_the_proxy_pods_reach_redis():
    proxy_labels = _pod_labels(_workload("prefixcache"))
    others = [_pod_labels(o) for o in _workloads() if o["metadata"]["name"] != "prefixcache"]
    for obj, container in _k8s_redis():
        (policy,) = _policies_for(_pod_labels(obj))
        spec = policy["spec"]
        assert set(spec["policyTypes"]) == {"Ingress", "Egress"} and spec["egress"] == []  # Redis calls no one
        (rule,) = spec["ingress"]
        assert rule["from"], "an empty `from` admits every pod"
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "no namespaceSelector / ipBlock: this namespace's pods only"
            assert _selects(peer["podSelector"], proxy_labels)
            assert not any(_selects(peer["podSelector"], labels) for labels in others)
        assert rule["ports"] == [{"protocol": "TCP", "port": container["ports"][0]["containerPort"]}]


def test_only_the_router_reaches_the_proxy_pods():
    router_labels = _pod_labels(_workload("router"))
    others = [_pod_labels(o) for o in _workloads() if o["metadata"]["name"] != "router"]
    sts = _workload("prefixcache")
    (policy,) = _policies_for(_pod_labels(sts))
    assert "Ingress" in policy["spec"]["policyTypes"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"]
    for peer in rule["from"]:
        assert set(peer) == {"podSelector"} and _selects(peer["podSelector"], router_labels)
        assert not any(_selects(peer["podSelector"], labels) for labels in others)
    (container,) = _pod_spec(sts)["containers"]
    assert rule["ports"] == [{"protocol": "TCP", "port": container["ports"][0]["containerPort"]}]


@pytest.mark.parametrize("name", [o["metadata"]["name"] for o in _workloads()])
def test_every_pod_and_container_is_locked_down(name):
    obj = _workload(name)
    spec = _pod_spec(obj)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod.get("runAsUser", 1) != 0 and pod.get("runAsGroup", 1) != 0
    assert spec["automountServiceAccountToken"] is False
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    assert all(set(v) <= {"name", "emptyDir", "configMap", "secret", "projected", "persistentVolumeClaim"}
               for v in volumes.values()), "no hostPath"
    for container in _containers(obj):
        sc = container["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False, container["name"]
        assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"] == {"drop": ["ALL"]}, container["name"]
        assert not sc.get("privileged") and sc.get("runAsUser", 1) != 0
        resources = container["resources"]
        assert _bytes(resources["limits"]["memory"]) >= _bytes(resources["requests"]["memory"]) > 0
        for mount in container.get("volumeMounts", []):  # what it writes goes to a bounded emptyDir
            assert mount["name"] in volumes and "sizeLimit" in volumes[mount["name"]]["emptyDir"]


@pytest.mark.parametrize("dockerfile,workload", [("Dockerfile", "prefixcache"),
                                                 ("deploy/replicas/router.Dockerfile", "router")])
def test_images_run_as_the_numeric_user_kubernetes_expects(dockerfile, workload):
    users = re.findall(r"^USER (\S+)$", (ROOT / dockerfile).read_text(), re.M)
    uid, gid = users[-1].split(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit()  # runAsNonRoot cannot check a user name
    pod = _pod_spec(_workload(workload))["securityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"]) == (int(uid), int(gid))


def test_no_literal_secrets_in_the_manifests():
    for obj in _objects():
        assert obj["kind"] != "Secret", "Secrets are created from the command line, never kept in the file"
        if obj["kind"] not in WORKLOADS:
            continue
        for container in _containers(obj):
            for e in container.get("env", []):
                if SECRET_NAME.search(e["name"]):
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], e["name"]
                value = str(e.get("value", ""))
                if "@" in value and "://" in value:
                    assert re.fullmatch(r"\$\(\w+\)", urlparse(value).password or ""), e["name"]
    for path in COMPOSE_FILES:
        for name, service in _services(path).items():
            for key, value in _environment(service).items():
                if SECRET_NAME.search(key):
                    # Required, or optional with an empty default: never a value written here.
                    assert re.fullmatch(REQUIRED, value) or re.fullmatch(r"\$\{[A-Z0-9_]+:-\}", value), (name, key)
    for path in [*COMPOSE_FILES, *K8S_FILES]:
        text = path.read_text()
        assert "--requirepass" not in text and "redis-cli -a" not in text
        for m in re.finditer(r"requirepass\s+(\S+)", text):
            assert m.group(1).lstrip("$").startswith("REDIS_PASSWORD"), f"{path.name}: requirepass {m.group(1)}"


# -- shutdown: the grace period covers a tier flush ---------------------------------------------------------
def test_the_grace_period_covers_a_tier_flush():
    """At SIGTERM the proxy finishes its requests, then ``persist``: write-back drains the device's blocks
    (up to DRAIN_SECONDS) and every policy flushes queued writes (up to DRAIN_SECONDS)."""
    from prefixcache.sdk import DRAIN_SECONDS

    def needed(argv: list[str], env: set[str]) -> float:
        tiers = {"PREFIXCACHE_TIER_REDIS", "PREFIXCACHE_TIER_DISK", "PREFIXCACHE_TIER_HOST_BYTES"} & env or \
            {"--tier-redis", "--tier-disk", "--tier-host-bytes"} & set(argv)
        if not tiers:
            return 0  # persist is a no-op: only the requests in flight need the time
        policy = argv[argv.index("--tier-write-policy") + 1] if "--tier-write-policy" in argv else "write-back"
        return DRAIN_SECONDS * (1 if policy == "write-through" else 2)

    sts = _workload("prefixcache")
    grace = _pod_spec(sts)["terminationGracePeriodSeconds"]
    (container,) = _pod_spec(sts)["containers"]
    k8s_needed = needed(container["args"], {e["name"] for e in container["env"]})
    assert k8s_needed > 0 and grace > k8s_needed and grace > 30  # 30: Kubernetes' default
    for path in COMPOSE_FILES:
        for name, service in _services(path).items():
            if service.get("image", "").startswith("prefixcache:"):
                stop = int(re.fullmatch(r"(\d+)s", service["stop_grace_period"]).group(1))
                assert stop > needed(service.get("command") or [], set(_environment(service))), name
                assert stop > 10, f"{name}: docker's default stop timeout"
    doc = (ROOT / "docs" / "hardening.md").read_text()
    assert f"terminationGracePeriodSeconds: {grace}" in doc


def test_the_hardening_page_has_the_threat_model_and_the_deployments():
    doc = (ROOT / "docs" / "hardening.md").read_text()
    headings = re.findall(r"^## (.+)$", doc, re.M)
    assert "Threat model" in headings and "Deployments" in headings
    assert headings.index("Threat model") < headings.index("Protections")
    for text in ("127.0.0.1", "rediss://", "NetworkPolicy", "GRAFANA_ADMIN_PASSWORD", "REDIS_PASSWORD",
                 "tests/security/test_deploy.py"):
        assert text in doc, text
