"""The states of a parameter, in the names DeepSpeed's universal layout uses: the fp32 master weights, then whatever
the optimizer keeps per parameter under its own keys (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's and Muon's
``momentum_buffer``, Adagrad's ``sum``, ...), then its scalars (the ``step``). A module of its own so that the
tensor and source layers share them, torch-free.

An optimizer's per-parameter *tensor* states have the parameter's elements (they are resharded like it); its
*scalar* states (a number, or a tensor of one element without dimensions) are per param group and carried as they
are. Anything else (a state with its own shape) is refused by whoever meets it, naming the optimizer, the state and
its shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MASTER_WEIGHTS = "fp32"
ADAM_STATES = ("exp_avg", "exp_avg_sq")
STEP = "step"
#: DeepSpeed's Muon: the momentum of the matrices it steps, and the param-group flag that marks them.
MUON_MOMENTUM = "momentum_buffer"
USE_MUON = "use_muon"
#: Not an optimizer state: the trained module's own lower-precision copy of the weights (bf16 or fp16), which
#: DeepSpeed's ZeRO-0/1/2 model-states files hold beside the fp32 masters and refreshes from them after every
#: step. Fingerprinted at save so that a reader may take a bf16 export from it (half the bytes of the masters,
#: no cast) with the same end-to-end check; no converter writes it as a state of its own.
MODULE_WEIGHTS = "module"


def is_scalar_state(value: Any) -> bool:
    """A scalar state (carried per param group, not resharded): a number, or a tensor without dimensions."""
    shape = getattr(value, "shape", None)
    return shape is None or len(shape) == 0


def ordered_states(names: Iterable[str], scalars: Iterable[str] = ()) -> tuple[str, ...]:
    """States in the order every reader reports them: the master, Adam's moments (in upstream's order), any other
    tensor states by name, then the scalars with the step last. An Adam checkpoint's order is what it always was:
    ``fp32, exp_avg, exp_avg_sq, step``."""
    tensors, scalar_set = set(names) - {MASTER_WEIGHTS}, set(scalars)
    tensors -= scalar_set
    front = [state for state in ADAM_STATES if state in tensors]
    rest = sorted(tensors - set(front))
    tail = sorted(scalar_set - {STEP}) + ([STEP] if STEP in scalar_set else [])
    return (MASTER_WEIGHTS, *front, *rest, *tail)


def optimizer_state_keys(group_state: Mapping[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(tensor states, scalar states)`` of one torch optimizer state entry, by key."""
    tensors = tuple(key for key, value in group_state.items() if not is_scalar_state(value))
    scalars = tuple(key for key, value in group_state.items() if is_scalar_state(value))
    return tensors, scalars


#: Scalar states besides the step that optimizers keep (torch's NAdam: ``mu_product``), known by name so that a
#: reader need not open a file to tell.
KNOWN_SCALARS = frozenset({STEP, "mu_product"})


def has_optimizer(states: Iterable[str]) -> bool:
    """Whether ``states`` carry an optimizer's state (more than the master weights)."""
    return any(state != MASTER_WEIGHTS for state in states)


def optimizer_states_summary(param_states: Mapping[str, tuple[str, ...]]) -> dict[str, int]:
    """What ``inspect`` shows of the optimizer: for each set of states, how many parameters have it."""
    counts: dict[str, int] = {}
    for states in param_states.values():
        key = "/".join(states)
        counts[key] = counts.get(key, 0) + 1
    return counts


#: The DeepSpeed config sections that shape an optimizer step beside the torch optimizer's own settings.
STEP_CONFIG_KEYS = ("optimizer", "scheduler", "gradient_clipping", "gradient_accumulation_steps",
                    "train_micro_batch_size_per_gpu")


def optimizer_settings(param_groups: Any, ds_config: Any) -> dict[str, Any] | None:
    """An optimizer's settings as a checkpoint saved them, for another framework to continue the run with: each
    param group's settings (``lr`` as at save time, ``betas``, ``eps``, ``weight_decay``, ...; not its parameters)
    and the DeepSpeed config's sections that shape a step (:data:`STEP_CONFIG_KEYS`). None: no param groups."""
    plain = (int, float, str, bool, tuple, list, type(None))
    groups = [{key: value for key, value in group.items() if key != "params" and isinstance(value, plain)}
              for group in (param_groups if isinstance(param_groups, (list, tuple)) else [])
              if isinstance(group, Mapping)]
    if not groups:
        return None
    config = ds_config if isinstance(ds_config, Mapping) else {}
    return {"param_groups": groups, **{key: config[key] for key in STEP_CONFIG_KEYS if key in config}}
