"""A Lightning profiler that also prints each profiled action's per-call seconds, for a step's split by hook
(`training_step`: forward; `backward`; `optimizer_step`: Lightning's wraps the closure, i.e. forward + backward +
the optimizer's step). Lightning's SimpleProfiler reports only means over all calls, the first step's included.

    python recipes/train.py ... '+trainer.profiler={_target_: benchmarks.step_split.SplitProfiler}'

prints one line `STEP_SPLIT {"<action>": [seconds per call], ...}` at the end of fit (actions whose name holds
training_step, backward, optimizer_step or run_training_batch).
"""

from __future__ import annotations

import json

from lightning.pytorch.profilers import SimpleProfiler

WATCHED = ("training_step", "backward", "optimizer_step", "run_training_batch")


class SplitProfiler(SimpleProfiler):
    def summary(self) -> str:
        calls = {action: [round(seconds, 4) for seconds in durations]
                 for action, durations in self.recorded_durations.items()
                 if any(w in action for w in WATCHED) and not action.startswith("[Callback]")}
        print("STEP_SPLIT " + json.dumps(calls), flush=True)
        return super().summary()
