"""The docs cannot drift: generated pages match the code, and the README's links resolve."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> dict[Path, str]:
    return _generator().render()


def test_generated_pages_match_the_code(generated):
    for path, text in generated.items():
        assert path.exists(), f"{path.relative_to(ROOT)} missing: run `python scripts/gen_docs.py`"
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run `python scripts/gen_docs.py`"


def test_configuration_names_every_setting_and_field(generated):
    import dataclasses

    from prefixcache_api.settings import ENV_PREFIX, Settings

    from prefixcache.config import CacheConfig
    from prefixcache.serving.engine import BatchConfig

    page = generated[ROOT / "docs" / "configuration.md"]
    for name in Settings.model_fields:
        assert f"`{ENV_PREFIX}{name.upper()}`" in page
    for cls in (CacheConfig, BatchConfig):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page, f"{cls.__name__}.{f.name}"


def test_metrics_page_names_every_metric(generated):
    from prefixcache_api import metrics

    page = generated[ROOT / "docs" / "metrics.md"]
    for name in metrics.NAMES:
        assert f"`{name}" in page, name


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    for page in sorted((ROOT / "docs").glob("*.md")):  # where to go: every page is linked from the front page
        assert f"](docs/{page.name})" in text, f"README.md does not link docs/{page.name}"
    for name in ("LICENSE", "CHANGELOG.md"):
        assert f"]({name})" in text and (ROOT / name).is_file(), name


def test_license_is_the_one_pyproject_declares():
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_every_error_and_documented_name_is_exported():
    """Each error class, and every name the docs import from ``prefixcache``, is importable from it."""
    import inspect

    import prefixcache
    from prefixcache import errors

    classes = {n for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.PrefixCacheError)}
    assert classes <= set(prefixcache.__all__), sorted(classes - set(prefixcache.__all__))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for names in re.findall(r"from prefixcache import ([\w, ]+)", page.read_text()):
            for name in (n.strip() for n in names.split(",")):
                assert hasattr(prefixcache, name), f"{page.name}: `from prefixcache import {name}` fails"


@pytest.mark.parametrize("page", ["README.md", "CHANGELOG.md", *sorted(p.relative_to(ROOT).as_posix()
                                                                       for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(page):
    source = ROOT / page
    for target in LINK.findall(source.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path = (source.parent / target.partition("#")[0]).resolve()
        assert path.exists(), f"{page} links to {target}, which does not exist"
