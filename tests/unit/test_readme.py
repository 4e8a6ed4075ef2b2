"""The README stays true: its Results are rendered from benchmarks/results/claims.json (one current figure per
claim, every folder and figure present), and its layout names every module of the package."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _readme_results():
    spec = importlib.util.spec_from_file_location("readme_results", ROOT / "scripts" / "readme_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_table_is_rendered_from_the_claims_file():
    results = _readme_results()
    assert results.readme_with_results(README, results.render()) == README, (
        "README's Results differ from benchmarks/results/claims.json: run python scripts/readme_results.py")


def test_every_claim_is_stated_once_and_points_at_committed_results():
    data = json.loads((ROOT / "benchmarks" / "results" / "claims.json").read_text())
    claims = [claim["claim"] for claim in data["claims"]]
    assert len(claims) == len(set(claims)), "a claim appears twice: keep its current figure only"
    for claim in data["claims"]:
        for folder in claim["folders"]:
            assert (ROOT / "benchmarks" / "results" / folder / "README.md").is_file(), folder
    for figure in data["figures"]:
        assert (ROOT / "benchmarks" / "results" / figure["path"]).is_file(), figure["path"]


def _layout_entries() -> dict[str, str]:
    """The README's layout block as {entry: its text}: an entry starts at a line indented by two spaces."""
    block = README.split("## Repository layout", 1)[1].split("```", 2)[1]
    entries, current = {}, None
    for line in block.splitlines():
        if line.startswith("  ") and not line.startswith("   "):
            current = line.split()[0]
            entries[current] = line
        elif current is not None:
            entries[current] += "\n" + line
    return entries


def test_layout_names_every_module_of_the_package():
    entries = _layout_entries()
    package = ROOT / "lightning_ulysses"
    root_text = "\n".join(text for name, text in entries.items() if not name.endswith("/"))
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if len(relative.parts) == 1:
            if not re.search(rf"(?<![\w/]){re.escape(path.name)}", root_text):
                missing.append(str(relative))
            continue
        folder = f"{relative.parts[0]}/"
        assert folder in entries, f"README's layout has no entry for {folder}"
        if folder == "families/" or path.name == "__init__.py":
            continue  # "one file per family"; a subpackage's __init__ is the folder itself
        if path.name not in entries[folder]:
            missing.append(str(relative))
    assert not missing, f"README's repository layout does not name {missing}"


def test_guide_points_at_no_issue_numbers():
    """Issues are the team's tracker, not the reader's: the guide says what is and is not done instead."""
    assert not re.search(r"\bissue \d+", (ROOT / "docs" / "guide.md").read_text())


# The documents whose relative links must resolve (the API reference and figures are generated, not linked here).
LINKED_DOCUMENTS = ("README.md", "CHANGELOG.md", "tests/README.md", "benchmarks/results/LOG.md", *(
    str(path.relative_to(ROOT)) for path in sorted((ROOT / "docs").glob("*.md"))))


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, each space a hyphen."""
    headings = re.findall(r"(?m)^#{1,6} (.+)$", _outside_code(markdown))
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


def _outside_code(markdown: str) -> str:
    return re.sub(r"(?ms)^```.*?^```", "", markdown)


def test_every_relative_link_of_the_docs_resolves():
    broken = []
    for name in LINKED_DOCUMENTS:
        document = ROOT / name
        text = _outside_code(document.read_text())
        for target in re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (document.parent / path).resolve() if path else document
            if not resolved.exists():
                broken.append(f"{name}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved.read_text()):
                broken.append(f"{name}: {target} (no such heading)")
    assert not broken, broken


def test_readme_is_a_map_that_points_inside_the_repository():
    """README ≤ 25,000 characters; no links out of the repository and no issue numbers (the tracker is the team's)."""
    assert len(README) <= 25_000, f"README.md has {len(README)} characters: move detail into docs/"
    assert not re.findall(r"https?://", README)
    assert not re.search(r"\bissues? #?\d+|(?<![\w/&])#\d+\b", README)
