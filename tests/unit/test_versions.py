"""Every lower bound in pyproject.toml names a version the suite has run on (docs/versions.md's table)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _verified() -> dict[str, list[Version]]:
    """Package → the versions in the table's "the suite ran on" column."""
    table = {}
    for line in (ROOT / "docs" / "versions.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.match(r"^\d", cells[2]):
            table[cells[0]] = [Version(re.match(r"[\d.]+", v.strip()).group().rstrip(".")) for v in cells[2].split(",")]
    return table


def _floors() -> list[tuple[str, Version]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += [r for r in extra if not r.startswith("lightning-ulysses")]
    floors = [("python", Version(project["requires-python"].removeprefix(">=")))]
    for requirement in map(Requirement, requirements):
        lower = [Version(spec.version) for spec in requirement.specifier if spec.operator in (">=", "==", "~=")]
        floors += [(requirement.name, version) for version in lower]
    return floors


@pytest.mark.parametrize("name,floor", _floors(), ids=lambda value: str(value))
def test_every_floor_is_a_verified_version(name, floor):
    verified = _verified()
    assert name in verified, f"{name}: no row in docs/versions.md"
    # A floor of 2.13 is met by 2.13.0; the floor must be exactly a version run (to its precision), not below all.
    precision = len(floor.release)
    assert any(v.release[:precision] == floor.release for v in verified[name]), (
        f"{name}>={floor}: the suite ran on {[str(v) for v in verified[name]]} only")


def test_every_requirement_has_a_floor():
    names = {name for name, _ in _floors()}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in map(Requirement, project["dependencies"]):
        assert requirement.name in names, f"{requirement}: no lower bound"


def test_hugging_face_models_are_refused_below_the_verified_transformers(monkeypatch):
    """A model prepared on an older transformers than the floor is refused before anything is swapped (on 5.17 a
    Nemotron-H model ran transformers' own quadratic scan while ours reported itself bound)."""
    import importlib.metadata

    from lightning_ulysses.hf import validation
    from tests.distributed.common import tiny_llama

    floors = dict(_floors())
    assert Version(validation.VERIFIED_TRANSFORMERS) == floors["transformers"]  # one floor, pyproject's
    model = tiny_llama(2)
    assert validation.validate_hf_model(model, 2) in ("sdpa", "eager")  # the installed one passes
    installed = importlib.metadata.version

    def pretend(version):
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name: version if name == "transformers" else installed(name))

    pretend("5.17.0")
    with pytest.raises(RuntimeError, match=r"transformers 5\.17\.0.*pip install 'transformers>=5\.25,<5\.26'"):
        validation.validate_hf_model(model, 2)
    pretend("5.24.0")
    with pytest.raises(RuntimeError, match="transformers 5.24.0"):
        validation.validate_hf_model(model, 1)  # SP 1 too: the swaps of the memory features are the same
    pretend("5.25.1")
    validation.validate_hf_model(model, 2)
