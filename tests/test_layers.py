"""The folder tree is the architecture: imports flow one way, and the fragile contacts stay put.

cache <- model <- serving <- sdk <- api / cli / bench. ``errors`` and ``config`` sit under
everything. ``transformers`` stays out of ``cache/``; its cache and attention internals
are touched in ``model/hf_cache.py`` only.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    return sorted([*(ROOT / "prefixcache").rglob("*.py"), *(ROOT / "api").rglob("*.py")])


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


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_one_way(path: Path):
    me = module_name(path)
    assert not upward_imports(me, path), f"{me} (layer {layer(me)}) imports a higher layer"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_transformers_internals_stay_in_hf_cache(path: Path):
    me = module_name(path)
    assert not internal_imports(me, path), f"{me} touches transformers cache/attention internals"


def test_the_checker_sees_violations(tmp_path):
    """The checks above can fail: upward, relative-upward and internal imports are all found."""
    fake = tmp_path / "probe.py"
    fake.write_text("from prefixcache.serving.engine import BatchEngine\nfrom ..sdk import PrefixCache\n"
                    "from transformers import DynamicCache\nfrom transformers.cache_utils import Cache\n")
    me = "prefixcache.cache.probe"
    assert [m for m, _ in upward_imports(me, fake)] == ["prefixcache.serving.engine", "prefixcache.sdk"]
    assert len(internal_imports(me, fake)) == 4  # transformers twice (cache layer), DynamicCache, cache_utils
    assert internal_imports("prefixcache.model.hf_cache", fake) == []
