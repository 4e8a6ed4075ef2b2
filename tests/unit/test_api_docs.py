"""The API reference builds: pdoc renders every public module, and every name in `lightning_ulysses.__all__` with
its docstring (scripts/api_docs.py, what scripts/docs.sh runs). A module that no longer imports, a public module
pdoc leaves out, or a main entry point without a docstring fails here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _api_docs():
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    api_docs = _api_docs()
    output = tmp_path_factory.mktemp("api")
    modules = api_docs.build(output)
    return output, modules, api_docs


def test_public_modules_are_read_from_the_files():
    modules = _api_docs().public_modules()
    # The modules the README's "How it works" names, and no private or __main__ module.
    for name in ("lightning_ulysses", "lightning_ulysses.integration.strategy", "lightning_ulysses.batch.sharding",
                 "lightning_ulysses.training.loss", "lightning_ulysses.parallel.layout", "lightning_ulysses.attention.core"):
        assert name in modules
    assert not [name for name in modules if any(part.startswith("_") for part in name.split("."))]


def test_every_public_module_has_a_page(built):
    output, modules, api_docs = built
    assert modules == api_docs.public_modules()
    missing = [name for name in modules if not (output / f"{name.replace('.', '/')}.html").is_file()]
    assert not missing, f"pdoc wrote no page for {missing}"
    for name in modules:
        page = (output / f"{name.replace('.', '/')}.html").read_text(encoding="utf-8")
        assert f"<title>{name} API documentation</title>" in page, name
    assert (output / "index.html").is_file() and (output / "search.js").is_file()


def test_every_name_in_all_is_documented(built):
    import lightning_ulysses

    output, _, _ = built
    page = (output / "lightning_ulysses.html").read_text(encoding="utf-8")
    undocumented = []
    for name in lightning_ulysses.__all__:
        match = re.search(rf'<section id="{re.escape(name)}">(.*?)(?=<section id=|\Z)', page, re.S)
        assert match is not None, f"lightning_ulysses.{name} is in __all__ but not in the API reference"
        if 'class="docstring"' not in match.group(1):
            undocumented.append(name)
    assert not undocumented, f"lightning_ulysses.__all__ names without a docstring: {undocumented}"
