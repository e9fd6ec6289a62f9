"""The folder tree is the architecture: imports flow one way, and the fragile contacts stay put.

cache <- model <- serving <- sdk <- api / cli / bench <- tests/support <- benchmarks. ``errors``
and ``config`` sit under everything; nothing installed imports ``tests/`` or ``benchmarks/``, and
``tests/support`` imports no test module. ``transformers`` stays out of ``cache/``; its cache and attention internals
are touched in ``model/hf_cache.py`` only.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Layer of each module prefix (the longest matching prefix wins); a module may import its own layer or lower.
LAYERS = {
    "prefixcache.errors": 0,
    "prefixcache.config": 0,
    "prefixcache.cache": 1,
    "prefixcache.model": 2,
    "prefixcache.serving": 3,
    "prefixcache.loading": 3,
    "prefixcache.sdk": 4,
    "prefixcache": 4,  # the package's __init__: the public surface
    "prefixcache.planner": 4,  # replays traces through cache/ (no model code); the proxy writes its request log
    "prefixcache.bench": 5,
    "prefixcache.cli": 5,
    "prefixcache.admin": 5,  # an HTTP client of the replicas, beside the command that runs it
    "prefixcache_api": 5,
    "tests.support": 6,  # fleets and redis-server as processes: what the tests and the measurements start
    "benchmarks": 7,  # one-off measurements (not installed): may start what tests/support starts
    "tests": 8,  # the tests themselves: nothing above imports them
}
#: transformers internals that change between releases: only ``hf_cache`` may import them.
INTERNALS = ("transformers.cache_utils", "transformers.masking_utils", "transformers.integrations",
             "transformers.modeling_utils")
INTERNAL_NAMES = {"DynamicCache", "Cache", "DynamicLayer", "AttentionInterface", "AttentionMaskInterface"}
#: The benchmark's transformers baseline reuses a DynamicCache as transformers' docs teach: a peer, not our cache.
PEER_BASELINES = {"prefixcache.bench.systems", "prefixcache.bench.gpu"}  # what users would run instead


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "api":
        parts[0] = "prefixcache_api"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[Path]:
    """Every module whose imports are checked: the package, the proxy, tests/support and benchmarks/."""
    return sorted(path for folder in ("prefixcache", "api", "tests/support", "benchmarks")
                  for path in (ROOT / folder).rglob("*.py"))


def imports(path: Path, me: str) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in ``path`` (module ``me``), relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out.append((base, [alias.name for alias in node.names]))
    return out


def layer(module: str) -> int | None:
    best = None
    for prefix in LAYERS:
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best)):
            best = prefix
    return None if best is None else LAYERS[best]


def test_every_module_has_a_layer():
    missing = [module_name(p) for p in sources() if layer(module_name(p)) is None]
    assert not missing


def upward_imports(me: str, path: Path) -> list[tuple[str, int]]:
    mine = layer(me)
    return [(mod, layer(mod)) for mod, _ in imports(path, me) if layer(mod) is not None and layer(mod) > mine]


def internal_imports(me: str, path: Path) -> list[str]:
    found = []
    for mod, names in imports(path, me):
        if me.startswith("prefixcache.cache") and mod.split(".")[0] == "transformers":
            found.append(mod)  # the cache layer knows nothing of models
        if me != "prefixcache.model.hf_cache" and me not in PEER_BASELINES and (
                mod.startswith(INTERNALS) or (mod.split(".")[0] == "transformers" and INTERNAL_NAMES & set(names))):
            found.append(f"{mod}: {sorted(INTERNAL_NAMES & set(names)) or '*'}")
    return found


def test_imports_flow_one_way():
    """Every checked module (one test for all: a finding names each module and what it imports)."""
    found = {}
    for path in sources():
        me = module_name(path)
        if upward := upward_imports(me, path):
            found[f"{me} (layer {layer(me)})"] = upward
    assert not found, f"modules importing a higher layer: {found}"


def test_transformers_internals_stay_in_hf_cache():
    found = {me: bad for me, bad in ((module_name(p), internal_imports(module_name(p), p)) for p in sources()) if bad}
    assert not found, f"modules touching transformers cache/attention internals: {found}"


def test_the_new_folders_are_covered():
    """tests/support and benchmarks/ are checked, and their modules have layers above the package's."""
    names = {module_name(p) for p in sources()}
    assert {"tests.support.fleet", "tests.support.redis_server", "benchmarks.tiers", "benchmarks.replicas"} <= names
    assert layer("prefixcache.bench.runner") < layer("tests.support.fleet") < layer("benchmarks.soak") < layer("tests")


def test_the_checker_sees_violations(tmp_path):
    """The checks above can fail: upward, relative-upward and internal imports are all found."""
    fake = tmp_path / "probe.py"
    fake.write_text("from prefixcache.serving.engine import BatchEngine\nfrom ..sdk import PrefixCache\n"
                    "from transformers import DynamicCache\nfrom transformers.cache_utils import Cache\n")
    me = "prefixcache.cache.probe"
    assert [m for m, _ in upward_imports(me, fake)] == ["prefixcache.serving.engine", "prefixcache.sdk"]
    assert len(internal_imports(me, fake)) == 4  # transformers twice (cache layer), DynamicCache, cache_utils
    assert internal_imports("prefixcache.model.hf_cache", fake) == []
    shipped = tmp_path / "shipped.py"
    shipped.write_text("from tests.support.fleet import Fleet\nimport benchmarks.tiers\nfrom tests import conftest\n")
    assert [m for m, _ in upward_imports("prefixcache.bench.http", shipped)] == [
        "tests.support.fleet", "benchmarks.tiers", "tests"]
    assert [m for m, _ in upward_imports("tests.support.fleet", shipped)] == ["benchmarks.tiers", "tests"]
