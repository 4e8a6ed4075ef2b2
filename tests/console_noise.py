"""What a console must not show: the third-party lines users saw before the quiet console (`lightning_ulysses.integration.console`),
shared by the tests that read a whole console (the recipe's main job, a user's own script, the notebook)."""

from __future__ import annotations

import re

# DeepSpeed's op probes (the compiler's commands under INFO logging, the linker's errors), Lightning's tips, its
# migration note on the default logger, its ZeRO-3 save note and its epoch total of a max_steps run (`Epoch 0/-2`),
# the logger's version in the bar, torch's deprecations inside DeepSpeed and Lightning, DeepSpeed's "untested
# optimizer" (for SGD) and its CPU accelerator note, Lightning's "not resumable" (for an exact resume), peft's init of
# partitioned LoRA weights.
THIRD_PARTY_NOISE = [r"-laio", r"compilers\.C", "💡", "Tip:", "tensorboardX", "When saving the DeepSpeed Stage 3",
                     "Epoch 0/-2", "v_num", "is deprecated", "FutureWarning", "untested optimizer",
                     "Setting accelerator to CPU", "not resumable", "zero-element tensors"]


def third_party_noise(console: str) -> list[str]:
    """The lines of `console` that match one of `THIRD_PARTY_NOISE`, or say "warning" (any case: Python's
    `FutureWarning:`, DeepSpeed's `[WARNING]`) without being the package's own (`lightning_ulysses` in the line: its
    warnings print their file's path)."""
    return [line for line in console.splitlines()
            if any(re.search(noise, line) for noise in THIRD_PARTY_NOISE)
            or ("warning" in line.lower() and "lightning_ulysses" not in line)]
