"""lightning-ulysses: DeepSpeed-Ulysses sequence parallelism for PyTorch Lightning.

`import lightning_ulysses` registers the strategy names "ulysses", "ulysses_stage_{1,2,3}",
"ulysses_stage_3_offload", "ulysses_notebook" (DeepSpeed) and "ulysses_fsdp" (FSDP2) in Lightning's StrategyRegistry (Lightning has no entry points
for strategies).
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_ulysses import families  # noqa: F401  (every family registers itself: adapters/registry.py)
from lightning_ulysses.attention import UlyssesAttention
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import prepare_hf_model
from lightning_ulysses.integration.fsdp_strategy import UlyssesFSDPStrategy
from lightning_ulysses.integration.strategy import UlyssesDeepSpeedStrategy
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.training.loss import sequence_parallel_cross_entropy

__version__ = "0.1.0"

# The modules users import by their short names (the README's API table) live in the folders of their layers; each
# is also importable by its short name, so code written against `lightning_ulysses.metrics` & co. keeps working.
import sys as _sys  # noqa: E402

from lightning_ulysses.integration import callbacks, inference  # noqa: E402
from lightning_ulysses.planning import planner  # noqa: E402
from lightning_ulysses.training import metrics, optim  # noqa: E402

for _module in (callbacks, inference, planner, metrics, optim):
    _sys.modules.setdefault(f"{__name__}.{_module.__name__.rpartition('.')[2]}", _module)
del _module, _sys

if UlyssesDeepSpeedStrategy.strategy_name not in StrategyRegistry:
    UlyssesDeepSpeedStrategy.register_strategies(StrategyRegistry)
if UlyssesFSDPStrategy.strategy_name not in StrategyRegistry:
    UlyssesFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "ParallelLayout",
    "SequenceParallelGroups",
    "SequenceSharder",
    "UlyssesAttention",
    "UlyssesDeepSpeedStrategy",
    "UlyssesFSDPStrategy",
    "prepare_hf_model",
    "sequence_parallel_cross_entropy",
]
