"""Build the HTML API reference of `lightning_ulysses` from its docstrings with pdoc.

    python scripts/api_docs.py [OUTPUT_DIR]      (default docs/api; scripts/docs.sh runs this)

Every public module is passed to pdoc by name: the package's `__all__` lists only the main entry points, and pdoc
documents no submodule of a package that `__all__` does not name. A module that fails to import makes the build
fail (pdoc raises), so a broken import surfaces here rather than as a missing page. tests/unit/test_api_docs.py runs
`build` into a temporary folder and checks the pages.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

PACKAGE = "lightning_ulysses"
# "google": the strategy's docstring lists its arguments under "Args:"; the rest is Markdown, which "google" keeps.
DOCFORMAT = "google"
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "api"


def public_modules(package: str = PACKAGE) -> list[str]:
    """Every module of `package` whose dotted name has no part starting with "_", read from the files (importing
    nothing, so a module that fails to import is still listed, and then fails the build)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{package} is not an importable package (is the repository root on PYTHONPATH?)")
    root = Path(next(iter(spec.submodule_search_locations)))
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return sorted(names)


def build(output_directory: Path | str = DEFAULT_OUTPUT) -> list[str]:
    """Render every public module into `output_directory` (HTML, one page per module, plus index.html and
    search.js); return the module names."""
    import pdoc
    import pdoc.extract
    import pdoc.render

    modules = public_modules()
    # pdoc adds the submodules a package's __all__ names by itself; pass each module once.
    specs, covered = [], set()
    for name in modules:
        if name not in covered:
            specs.append(name)
            covered.update(pdoc.extract.walk_specs([name]))
    pdoc.render.configure(docformat=DOCFORMAT, footer_text=PACKAGE, show_source=True)
    output_directory = Path(output_directory)
    output_directory.mkdir(parents=True, exist_ok=True)
    pdoc.pdoc(*specs, output_directory=output_directory)
    return modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", type=Path, default=DEFAULT_OUTPUT, help="folder for the HTML pages")
    args = parser.parse_args(argv)
    modules = build(args.output)
    print(f"API reference of {len(modules)} modules: {args.output / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
