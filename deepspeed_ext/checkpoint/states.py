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



def optimizer_settings(param_groups: Any, ds_config: Any, engine: Mapping[str, Any] | None = None,
                       clip_grad: Any = None, ds_version: Any = None, dp_degree: int = 1) -> dict[str, Any] | None:
    """An optimizer's settings as a checkpoint saved them, for another framework to continue the run with: each
    param group's settings (``lr`` as at save time, ``betas``, ``eps``, ``weight_decay``, ...; not its parameters),
    the DeepSpeed config's optimizer and scheduler sections, and what shapes a step as the engine ran it
    (:func:`effective_step_settings`). None: no param groups."""
    plain = (int, float, str, bool, tuple, list, type(None))
    groups = [{key: value for key, value in group.items() if key != "params" and isinstance(value, plain)}
              for group in (param_groups if isinstance(param_groups, (list, tuple)) else [])
              if isinstance(group, Mapping)]
    if not groups:
        return None
    config = ds_config if isinstance(ds_config, Mapping) else {}
    return {"param_groups": groups, **{key: config[key] for key in ("optimizer", "scheduler") if key in config},
            **effective_step_settings(config, engine, clip_grad, ds_version, dp_degree)}


#: DeepSpeed's ``gradient_clipping`` where a config leaves it out: 0 (none) before 0.19.3, 1.0 from it on
#: (``GRADIENT_CLIPPING_DEFAULT`` in ``deepspeed/runtime/constants.py``).
CLIPPING_DEFAULT_SINCE = ((0, 19, 3), 1.0)


def _release(version: Any) -> tuple[int, ...]:
    import re
    return tuple(int(part) for part in re.findall(r"\d+", str(version or ""))[:3])


def effective_step_settings(config: Mapping[str, Any], engine: Mapping[str, Any] | None, clip_grad: Any,
                            ds_version: Any, dp_degree: int) -> dict[str, Any]:
    """Gradient clipping, accumulation, micro batch and precision as DeepSpeed ran them: what the engine recorded at
    save time (deepspeed-ext's ``engine_settings``), else the optimizer's own record (``clip_grad``, which ZeRO-1/2,
    BF16_Optimizer and the fused stage-0 wrapper save), else the config with the defaults of the DeepSpeed release
    that saved it applied as DeepSpeed applies them (the batch sizes derived from ``train_batch_size``; the
    precision from ``bf16``/``bfloat16`` and ``fp16``)."""
    found: dict[str, Any] = dict(engine or {})
    if "gradient_clipping" not in found:
        if clip_grad is not None:
            found["gradient_clipping"] = float(clip_grad)
        elif config.get("gradient_clipping") is not None:
            found["gradient_clipping"] = float(config["gradient_clipping"])
        else:
            since, value = CLIPPING_DEFAULT_SINCE
            release = _release(ds_version)
            found["gradient_clipping"] = value if release and release >= since else 0.0
    if "gradient_accumulation_steps" not in found or "train_micro_batch_size_per_gpu" not in found:
        total, micro, accumulation = (config.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                                  "gradient_accumulation_steps"))
        dp = max(int(dp_degree or 1), 1)
        if micro is None and total is not None:
            micro = int(total) // (int(accumulation or 1) * dp)
        if accumulation is None:
            accumulation = int(total) // (int(micro) * dp) if total is not None and micro else 1
        found.setdefault("gradient_accumulation_steps", int(accumulation))
        if micro is not None:
            found.setdefault("train_micro_batch_size_per_gpu", int(micro))
    if "dtype" not in found:
        def enabled(section: str) -> bool:
            value = config.get(section)
            return bool(value.get("enabled", False)) if isinstance(value, Mapping) else False
        found["dtype"] = "bf16" if enabled("bf16") or enabled("bfloat16") else "fp16" if enabled("fp16") else "fp32"
    return found