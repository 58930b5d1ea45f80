"""The stream vocabulary: a source yields :class:`LogicalTensor` objects, a sink consumes them.

A LogicalTensor names one full parameter and knows how to load each of its states lazily, so a
sink that handles one tensor at a time keeps memory at "one tensor" whatever the model size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from deepspeed_ext.module_inject.layout import TPLayout

#: Optimizer states of Adam-family optimizers, in the names DeepSpeed's universal layout uses.
MASTER_WEIGHTS = "fp32"
ADAM_STATES = ("exp_avg", "exp_avg_sq")
STEP = "step"


@dataclass
class LogicalTensor:
    """One full (unsharded) parameter with lazily loaded states.

    ``layout`` is how the source had it split over TP ranks (kept so tools can show it); ``states``
    lists the states available; ``loader(state)`` returns the full tensor of that state (``step``
    returns the optimizer step as a 0-d tensor or int).
    """

    name: str
    shape: tuple[int, ...]
    layout: TPLayout
    states: tuple[str, ...]
    loader: Callable[[str], torch.Tensor | int]
    dtype: torch.dtype = torch.float32
    extra: dict = field(default_factory=dict)

    def load(self, state: str = MASTER_WEIGHTS) -> torch.Tensor | int:
        if state not in self.states:
            raise KeyError(f"{self.name}: no state {state!r} (have {', '.join(self.states)})")
        return self.loader(state)
