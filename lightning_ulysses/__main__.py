"""`python -m lightning_ulysses <command>`: the package's command-line tools.

    checkpoint inspect|export ...   check a checkpoint; export weights and Hugging Face folders
    preflight ...                   check this machine for a planned run
    plan ...                        per-GPU memory of a planned run; the longest sequence that fits
    example-finetune <folder>       a tiny model folder and data files (offline) to try experiment=finetune_cpu on
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"checkpoint": "lightning_ulysses.integration.checkpoint.command_line",
                "preflight": "lightning_ulysses.planning.preflight", "plan": "lightning_ulysses.planning.plan",
                "example-finetune": "lightning_ulysses.recipe.example"}
    if not argv or argv[0] not in commands:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
