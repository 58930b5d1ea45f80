"""What a live module says of itself, as checkpoints record it: its model config, the class that was trained, its
peft adapters. The save records them (``deepspeed_ext.json``); the weight streams send them to their receivers."""

from __future__ import annotations

import json
from typing import Any

import torch


def model_config_of(module: torch.nn.Module) -> dict[str, Any] | None:
    """The model's config as ``config.json`` holds it (None: a module without a transformers-style config)."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    if hasattr(config, "to_json_string"):
        found: dict[str, Any] = json.loads(config.to_json_string(use_diff=False))
        return found
    try:
        found = json.loads(json.dumps(vars(config), default=str))
        return found
    except TypeError:
        return None


def model_class_of(module: torch.nn.Module) -> str:
    """The class of the model trained: a ``PeftModel``'s base model's (its adapters are recorded beside)."""
    get_base_model = getattr(module, "get_base_model", None)
    return type(get_base_model() if callable(get_base_model) else module).__name__


def adapters_of(module: torch.nn.Module) -> dict[str, Any] | None:
    """The peft adapters of ``module`` (a ``PeftModel``, or a model given adapters by transformers' ``add_adapter``):
    each one's config, as ``adapter_config.json`` holds it, and the active ones. None without adapters."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    from deepspeed_ext.checkpoint.adapters import peft_config_json
    active = getattr(module, "active_adapters", None)
    active = active() if callable(active) else active
    return {"configs": {str(name): peft_config_json(config.to_dict() if hasattr(config, "to_dict") else vars(config))
                        for name, config in configs.items()},
            "active": [str(name) for name in (active or [])]}
