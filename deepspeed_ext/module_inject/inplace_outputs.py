"""Row-parallel layers whose output the model adds to in place.

AutoTP's row-parallel layer returns its all-reduced output from a custom autograd Function, and torch forbids
modifying such an output in place ("Output 0 of RowParallel is a view and is being modified inplace"). Llama 4's MoE
block adds the routed experts' sum into its shared expert's output that way, so with the shared expert split the
first forward fails. For the layers a family names (:attr:`Family.inplace_outputs`) the output is cloned once, right
after the layer: the same values, and a tensor of its own that autograd lets the model add to.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from deepspeed_ext.checkpoint.engine_private.autotp_hook import around_autotp
from deepspeed_ext.checkpoint.engine_private.autotp_layers import is_autotp_layer

__all__ = ["inplace_outputs_cloned"]


def _family_patterns(model: torch.nn.Module) -> tuple[str, ...]:
    from deepspeed_ext.checkpoint.families import families_of_model_type
    config = getattr(model, "config", None)
    model_type = getattr(getattr(config, "text_config", None) or config, "model_type", None)
    return tuple(pattern for family in families_of_model_type(model_type) for pattern in family.inplace_outputs)


def _clone_output(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output.clone()


def clone_inplace_outputs(model: torch.nn.Module) -> int:
    """Give every AutoTP layer of ``model`` that its family names a hook that clones its output; how many."""
    patterns = [re.compile(r"(^|.*\.)" + pattern + "$") for pattern in _family_patterns(model)]
    if not patterns:
        return 0
    layers = [module for name, module in model.named_modules()
              if is_autotp_layer(module) and any(pattern.match(name) for pattern in patterns)]
    for layer in layers:
        layer.register_forward_hook(_clone_output)
    return len(layers)


def inplace_outputs_cloned() -> Any:
    """A context in which every engine that AutoTP shards gets :func:`clone_inplace_outputs` on its model."""
    def after(model: torch.nn.Module, state: Any, sharded: bool) -> None:
        if sharded:
            clone_inplace_outputs(model)

    return around_autotp(lambda model: None, after)
