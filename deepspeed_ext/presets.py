"""DeepSpeed AutoTP and AutoEP settings per model family: the keys a DeepSpeed config's ``"tensor_parallel"``
section needs for the family to initialize and train with AutoTP, and its AutoEP preset (docs/support-matrix.md
lists them).

Each comes from the family's file under :mod:`deepspeed_ext.checkpoint.families` and is used as it is by the
end-to-end tests. A family without one trains with AutoTP's defaults (transformers' own tp_plan). A transformers
``model_type`` outside the registry gets its tp_plan translated into DeepSpeed's terms
(:func:`partition_config_from_tp_plan`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

#: transformers tp_plan styles DeepSpeed 0.19.8's AutoTP runs as they are. Every other style (``colwise_gather_output``
#: and ``rowwise_split_input`` around norms that span a whole projection, ``packed_colwise`` / ``moe_tp_experts`` on
#: fused 3-D experts, ``mla_kv_a_proj``, ...) is kept whole on every rank: correct whatever it stands for, never split.
_SPLIT_STYLES = {"colwise": "column", "rowwise": "row"}
_GRAD_SUMMED_STYLES = ("replicated_with_grad_allreduce", )


def tensor_parallel_preset(family: str) -> dict[str, Any]:
    """The keys to merge into the ``"tensor_parallel"`` section for ``family`` (``mixtral``, ``qwen3-moe``, ...;
    the HF spelling ``qwen3_moe`` works too); ``{}`` when AutoTP's defaults work. A transformers ``model_type``
    deepspeed-ext has no family for (``glm4_moe``, ``olmo3``, ...) gets its tp_plan translated
    (:func:`partition_config_from_tp_plan`)::

        ds_config["tensor_parallel"] = {"autotp_size": 2, **deepspeed_ext.tensor_parallel_preset("mixtral")}
    """
    from deepspeed_ext.checkpoint.families import family_names, get_family
    from deepspeed_ext.errors import CheckpointError
    try:
        return copy.deepcopy(dict(get_family(family).tensor_parallel or {}))
    except CheckpointError:
        plan = _transformers_tp_plan(family)
    if plan is None:
        raise CheckpointError(f"unknown model family {family!r}: neither a deepspeed-ext family "
                              f"({', '.join(family_names())}) nor a transformers model_type") from None
    return partition_config_from_tp_plan(plan)


def _transformers_tp_plan(model_type: str) -> dict[str, str] | None:
    """transformers' default ``base_model_tp_plan`` of ``model_type`` (None: transformers has no such type)."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.for_model(model_type)
    except ValueError:  # "Unrecognized model identifier"
        return None
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def partition_config_from_tp_plan(plan: Mapping[str, str]) -> dict[str, Any]:
    """A transformers tp_plan (``{"layers.*.self_attn.q_proj": "colwise", ...}``) as the keys of DeepSpeed's
    ``tensor_parallel`` section: ``colwise`` / ``rowwise`` layers split, ``replicated_with_grad_allreduce`` ones
    whole with their gradients summed over the TP ranks, every other style whole, and the output head split by
    vocabulary with its logits gathered. The patterns are unanchored, so a peft model's names match too."""
    specs: list[dict[str, Any]] = []
    for module, style in plan.items():
        pattern = r"(^|.*\.)" + re.escape(module).replace(r"\*", r"\d+") + r"\.weight$"
        if style in _SPLIT_STYLES:
            specs.append({"patterns": [pattern], "partition_type": _SPLIT_STYLES[style]})
        elif style in _GRAD_SUMMED_STYLES:
            specs.append({"patterns": [pattern], "partition_type": "skip", "grad_allreduce": True})
        else:
            specs.append({"patterns": [pattern], "partition_type": "skip"})
    specs.append({"patterns": [r"(^|.*\.)lm_head\.weight$"], "partition_type": "column", "gather_output": True})
    return {"partition_config": {"use_default_specs": False, "layer_specs": specs}}


def expert_parallel_preset(family: str) -> dict[str, Any]:
    """The keys to merge into the ``"expert_parallel"`` section (DeepSpeed AutoEP) for an MoE ``family``: the
    AutoEP ``preset_model`` for it. Refused for a family AutoEP has no preset for::

        ds_config["expert_parallel"] = {"enabled": True, "autoep_size": 2,
                                        **deepspeed_ext.expert_parallel_preset("mixtral")}
    """
    from deepspeed_ext.checkpoint.families import family_names, get_family
    preset = get_family(family).expert_parallel
    if preset is None:
        served = [name for name in family_names() if get_family(name).expert_parallel is not None]
        raise ValueError(f"family {family!r} has no DeepSpeed AutoEP preset (AutoEP serves the MoE families "
                         f"{', '.join(served)})")
    return {"preset_model": preset} if isinstance(preset, str) else copy.deepcopy(dict(preset))
